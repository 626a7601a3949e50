"""Link impairments the kernel can do without netem: random loss with nftables, links
that go down, flap, or lose bursts.

RandomLoss: a netdev-family table in the receiving host's namespace drops a random
share of the RoCE frames arriving on its interface, and counts each drop: the count
is what a loss-recovery experiment compares retransmissions against. (Kernels with
netem could use it instead; nftables works on both.)

The gray failures of a link between switches (link-failure): Flap takes it down and
up again, BurstLoss drops every RoCE frame arriving on one end for a burst, again and
again. A link whose rate drops is its queues' business (queues.set_rate).
"""
from __future__ import annotations

import json
import subprocess
import threading

from lab.core.errors import LabError
from topologies.fabric import NAME_PREFIX
from traffic.constants import ROCE_V2_UDP_PORT

TABLE = "fl_loss"
RESOLUTION = 100_000     # loss probability steps of 0.001 %
# BurstLoss's table, in the root namespace (the switches' ports): a lab object that
# outlives a run that dies, so cleanup looks for the prefix (lab/fabric/cleanup.py)
GRAY_TABLE = f"{NAME_PREFIX.replace('-', '_')}gray"


def set_link(intf: str, up: bool) -> None:
    r = subprocess.run(["ip", "link", "set", intf, "up" if up else "down"],
                       capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"could not set {intf} {'up' if up else 'down'}: {r.stderr.strip()}")


def nft(*args: str, script: str | None = None, pid: int | None = None) -> str:
    """nft in the root namespace, or in a host's (pid): a script on stdin, or arguments."""
    cmd = (["mnexec", "-a", str(pid)] if pid else []) + \
        ["nft"] + (["-f", "-"] if script else list(args))
    r = subprocess.run(cmd, input=script, capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"nftables refused a lab rule: {r.stderr.strip()} "
                       f"(see 'fabriclab doctor': nftables-netdev)")
    return r.stdout


def counted(listing: str) -> int:
    """The packets of the first counter in `nft -j list ...` output."""
    for item in json.loads(listing)["nftables"]:
        for where in (item.get("rule", {}).get("expr", []), [item]):
            for expr in where:
                if "counter" in expr and "packets" in expr["counter"]:
                    return expr["counter"]["packets"]
    raise LabError("the lab's nftables counter was not found")


class Repeating:
    """Something done to a link every `period_s` until stopped (a thread): `on()` for
    the first `share` of each period, `off()` for the rest; off() last."""

    def __init__(self, period_s: float, share: float):
        self.period_s, self.share = period_s, share
        self.cycles = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            self.on()
            self.cycles += 1
            if self.stopped.wait(self.period_s * self.share):
                break
            self.off()
            self.stopped.wait(self.period_s * (1 - self.share))
        self.off()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)

    def on(self) -> None:
        raise NotImplementedError

    def off(self) -> None:
        raise NotImplementedError


class Flap(Repeating):
    """The link of interface `intf` down for half of every period, up for the other."""

    def __init__(self, intf: str, period_s: float):
        super().__init__(period_s, 0.5)
        self.intf = intf

    def on(self) -> None:
        set_link(self.intf, up=False)

    def off(self) -> None:
        set_link(self.intf, up=True)


class BurstLoss(Repeating):
    """Every RoCE frame leaving on `intf` (a switch port, root namespace) dropped for
    `burst_s` of every `period_s`, counted. On the way out, at netfilter's egress hook:
    on the way in, OVS's userspace datapath (an all-protocol packet socket) takes a
    frame before any ingress hook. The egress hook runs before the data path's egress
    program, so the frame never counts into the port's queue: the data path sees it
    lost inside the switch, and its queues' accounting stays true."""

    def __init__(self, intf: str, burst_s: float, period_s: float):
        super().__init__(period_s, burst_s / period_s)
        self.intf = intf

    def start(self) -> None:
        nft(script=f"""table netdev {GRAY_TABLE} {{
    counter dropped {{ }}
    chain egress {{
        type filter hook egress device "{self.intf}" priority 0;
    }}
}}""")
        super().start()

    def on(self) -> None:
        nft("add", "rule", "netdev", GRAY_TABLE, "egress", "udp", "dport",
            str(ROCE_V2_UDP_PORT), "counter", "name", "dropped", "drop")

    def off(self) -> None:
        nft("flush", "chain", "netdev", GRAY_TABLE, "egress")

    def dropped(self) -> int:
        return counted(nft("-j", "list", "counter", "netdev", GRAY_TABLE, "dropped"))

    def stop(self) -> None:
        super().stop()
        self.lost = self.dropped()
        remove_gray_table()


def gray_tables() -> list[str]:
    """The lab's gray-failure tables left in the root namespace (none, or one)."""
    try:
        out = subprocess.run(["nft", "list", "tables", "netdev"], capture_output=True,
                             text=True).stdout
    except FileNotFoundError:          # no nftables: nothing of the lab's there either
        return []
    return [ln.split()[-1] for ln in out.splitlines() if ln.split()[-1:] == [GRAY_TABLE]]


def remove_gray_table() -> None:
    if gray_tables():
        nft("delete", "table", "netdev", GRAY_TABLE)


class RandomLoss:
    def __init__(self, host_pid: int, intf: str, percent: float):
        if not 0 <= percent < 100:
            raise LabError(f"loss percent must be in [0, 100), got {percent}")
        self.pid, self.intf, self.percent = host_pid, intf, percent

    def _nft(self, *args: str, script: str | None = None) -> str:
        """nft inside the host's namespace."""
        return nft(*args, script=script, pid=self.pid)

    def __enter__(self) -> "RandomLoss":
        threshold = round(self.percent / 100 * RESOLUTION)
        self._nft(script=f"""table netdev {TABLE} {{
    chain ingress {{
        type filter hook ingress device "{self.intf}" priority 0;
        udp dport {ROCE_V2_UDP_PORT} numgen random mod {RESOLUTION} < {threshold} counter drop
    }}
}}""")
        return self

    def dropped(self) -> int:
        return counted(self._nft("-j", "list", "table", "netdev", TABLE))

    def __exit__(self, *exc) -> None:
        self._nft("delete", "table", "netdev", TABLE)
