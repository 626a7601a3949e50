"""Link impairments the kernel can do without netem: random loss with nftables.

A netdev-family table in the receiving host's namespace drops a random share
of the RoCE frames arriving on its interface, and counts each drop: the count
is what a loss-recovery experiment compares retransmissions against. (Kernels
with netem could use it instead; nftables works on both.)
"""
from __future__ import annotations

import json
import subprocess

from lab.core.errors import LabError
from traffic.constants import ROCE_V2_UDP_PORT

TABLE = "fl_loss"
RESOLUTION = 100_000     # loss probability steps of 0.001 %


class RandomLoss:
    def __init__(self, host_pid: int, intf: str, percent: float):
        if not 0 <= percent < 100:
            raise LabError(f"loss percent must be in [0, 100), got {percent}")
        self.pid, self.intf, self.percent = host_pid, intf, percent

    def _nft(self, *args: str, script: str | None = None) -> str:
        """Run nft inside the host's namespace (a script on stdin, or arguments)."""
        cmd = ["mnexec", "-a", str(self.pid), "nft"] + (["-f", "-"] if script else list(args))
        r = subprocess.run(cmd, input=script, capture_output=True, text=True)
        if r.returncode:
            raise LabError(f"nftables refused the loss rule: {r.stderr.strip()} "
                           f"(see 'fabriclab doctor': nftables-netdev)")
        return r.stdout

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
        out = json.loads(self._nft("-j", "list", "table", "netdev", TABLE))
        for item in out["nftables"]:
            rule = item.get("rule")
            if rule:
                for expr in rule["expr"]:
                    if "counter" in expr:
                        return expr["counter"]["packets"]
        raise LabError("the loss rule's counter was not found")

    def __exit__(self, *exc) -> None:
        self._nft("delete", "table", "netdev", TABLE)
