"""Link delay and random loss with netem, on a GPU host's interface.

netem takes the place of the leaf FIFO queues of the interface (those lab/kernel/queues.py
puts under its htb classes, directly or inside a tbf gate), so the shaping above
still paces at the link rate and netem then holds each packet for the delay, or
drops it at the loss rate. Whatever classes queues.py makes, every leaf FIFO
becomes a netem; leaving the context puts the FIFOs back.

    with Netem(host_pid, "g0-eth0", LinkImpairment(delay_ms=20, loss_pct=1)):
        ...

Kernels without sch_netem (module-less CI kernels) refuse it: the error says so
and where to run instead (the lab VM); it is never silently ignored. For loss
alone, lab/kernel/impair.py's nftables RandomLoss works on any kernel.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from lab.core.errors import LabError

NO_NETEM = ("this kernel has no netem (sch_netem), which link delay and netem loss need. "
            "Run in a full kernel: 'fabriclab vm run -- COMMAND' (the lab VM) or the Vagrant "
            "VM; for loss alone, nftables loss (lab/kernel/impair.py) works on any kernel")
FIFOS = ("bfifo", "pfifo")


@dataclass(frozen=True)
class LinkImpairment:
    delay_ms: float = 0.0
    loss_pct: float = 0.0
    # packets netem may hold (its queue includes those waiting out the delay):
    # 1000 (netem's default) covers 80 ms at 100 Mb/s of 1 KB frames
    limit_packets: int = 1000

    def __post_init__(self):
        if self.delay_ms < 0:
            raise LabError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if not 0 <= self.loss_pct < 100:
            raise LabError(f"loss_pct must be in [0, 100), got {self.loss_pct}")
        if self.limit_packets < 1:
            raise LabError(f"limit_packets must be positive, got {self.limit_packets}")

    def netem_args(self) -> list[str]:
        return ["netem", "limit", str(self.limit_packets), "delay", f"{self.delay_ms}ms",
                "loss", f"{self.loss_pct}%"]


@dataclass
class Leaf:
    """A leaf FIFO netem takes the place of, and puts back."""
    parent: str
    handle: str      # "0:": the default FIFO inside a classful qdisc such as tbf
    kind: str
    limit: int


class Netem:
    def __init__(self, host_pid: int, intf: str, impairment: LinkImpairment):
        self.pid, self.intf, self.impairment = host_pid, intf, impairment
        self.replaced: list[Leaf] = []

    def _tc(self, *args: str) -> str:
        r = subprocess.run(["mnexec", "-a", str(self.pid), "tc", *args], capture_output=True,
                           text=True)
        if r.returncode:
            if "qdisc kind is unknown" in r.stderr:
                raise LabError(NO_NETEM)
            raise LabError(f"tc {' '.join(args)} failed on {self.intf}: {r.stderr.strip()}")
        return r.stdout

    def qdiscs(self) -> list[dict]:
        # invisible: the FIFO a tbf (or similar) holds inside is a leaf too
        return json.loads(self._tc("-s", "-j", "qdisc", "show", "dev", self.intf, "invisible")
                          or "[]")

    def _leaves(self) -> list[Leaf]:
        qdiscs = self.qdiscs()
        has_children = {q["parent"].split(":")[0] + ":" for q in qdiscs if q.get("parent")}
        leaves = [Leaf(q["parent"], q["handle"], q["kind"], q.get("options", {}).get("limit", 0))
                  for q in qdiscs if q.get("parent") and q["handle"] not in has_children]
        odd = [leaf.kind for leaf in leaves if leaf.kind not in FIFOS]
        if odd or not leaves:
            raise LabError(f"netem replaces leaf FIFO queues, and {self.intf}'s leaves are "
                           f"{odd or 'none'} (have the fabric's queues been applied?)")
        return leaves

    def _swap(self, leaf: Leaf, spec: list[str]) -> None:
        """Put `spec` where the leaf is. A FIFO with its own handle keeps it (statistics
        key on it): tc cannot change a qdisc's kind in place, so delete (htb gives the
        class a default FIFO meanwhile), then add. A default FIFO inside a tbf is
        replaced in one step: deleting it would leave the tbf a queue that drops all."""
        where = ["dev", self.intf, "parent", leaf.parent]
        if leaf.handle == "0:":
            self._tc("qdisc", "replace", *where, *spec)
        else:
            self._tc("qdisc", "del", *where, "handle", leaf.handle)
            self._tc("qdisc", "add", *where, "handle", leaf.handle, *spec)

    def __enter__(self) -> "Netem":
        for leaf in self._leaves():
            self._swap(leaf, self.impairment.netem_args())
            self.replaced.append(leaf)
        return self

    def counters(self) -> dict[str, int]:
        """Packets sent and dropped by the netem queues, summed."""
        sent = dropped = 0
        for q in self.qdiscs():
            if q["kind"] == "netem":
                sent += q.get("packets", 0)
                dropped += q.get("drops", 0)
        return {"sent_packets": sent, "dropped_packets": dropped}

    def __exit__(self, *exc) -> None:
        for leaf in self.replaced:
            netem = Leaf(leaf.parent, "0:" if leaf.handle == "0:" else leaf.handle, "netem", 0)
            self._swap(netem, [leaf.kind, "limit", str(leaf.limit)])
        self.replaced = []
