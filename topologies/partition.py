"""A fabric spread over machines: which machine runs which node, and the links
that cross between them (each carried by a tunnel between the two machines).

Hosts go with their scale-out switch, whole switches' worth at a time, in
contiguous blocks of about equal host counts (a leaf and its GPUs on one machine);
a switch with hosts goes where most of its hosts are; a switch without (spines,
aggregation, cores), once some of its neighbours are placed, on the machine of
those neighbours that has the fewest switches. A k=4 fat-tree's pod stays on one
machine with its aggregation switches; spines and cores are shared out.
Only switch-to-switch links cross: a host's NIC is always on its own machine.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from topologies.fabric import Fabric, Link
from topologies.params import ParamError

MAX_TUNNEL_KEY = (1 << 24) - 1     # VXLAN's network identifier is 24 bits


@dataclass(frozen=True)
class Crossing:
    """A link whose ends are on two machines: `key` tells its frames apart in the
    tunnel between them (the VXLAN network identifier)."""
    link: Link
    key: int
    machines: tuple[int, int]      # of link.a, of link.b

    def local_end(self, machine: int) -> tuple[str, int]:
        """(switch, port) of this link's end on `machine`."""
        return (self.link.a, self.link.a_port) if self.machines[0] == machine else \
            (self.link.b, self.link.b_port)

    def far_end(self, machine: int) -> tuple[str, int]:
        """(switch, port) of this link's end on the other machine."""
        return (self.link.b, self.link.b_port) if self.machines[0] == machine else \
            (self.link.a, self.link.a_port)

    def peer(self, machine: int) -> int:
        return self.machines[1] if self.machines[0] == machine else self.machines[0]


@dataclass
class Partition:
    fabric: Fabric
    machines: int
    placement: dict[str, int]      # node name -> machine index

    def nodes(self, machine: int) -> set[str]:
        return {n for n, m in self.placement.items() if m == machine}

    @property
    def crossings(self) -> list[Crossing]:
        out = []
        for i, ln in enumerate(self.fabric.links):
            ma, mb = self.placement[ln.a], self.placement[ln.b]
            if ma != mb:
                out.append(Crossing(ln, i + 1, (ma, mb)))
        return out

    def local(self, machine: int) -> Fabric:
        """What `machine` builds and watches: its switches and hosts, the links between
        them, and its ends of the crossing links (their far ends are not its own)."""
        mine = self.nodes(machine)
        return dataclasses.replace(
            self.fabric,
            switches=[s for s in self.fabric.switches if s.name in mine],
            hosts=[h for h in self.fabric.hosts if h.name in mine],
            links=[ln for ln in self.fabric.links if ln.a in mine or ln.b in mine])

    def summary(self) -> str:
        parts = []
        for m in range(self.machines):
            mine = self.nodes(m)
            hosts = sum(h.name in mine for h in self.fabric.hosts)
            switches = sum(s.name in mine for s in self.fabric.switches)
            parts.append(f"machine {m}: {hosts} hosts, {switches} switches")
        return "; ".join(parts) + f"; {len(self.crossings)} links cross"

    def to_dict(self) -> dict:
        return {"machines": self.machines, "placement": self.placement}


def split(fabric: Fabric, machines: int) -> Partition:
    if machines < 1:
        raise ParamError(f"machines must be at least 1, got {machines}")
    by_switch: dict[str, list[str]] = {}     # scale-out switch -> its hosts, in order
    for h in fabric.hosts:
        by_switch.setdefault(h.interfaces[0].switch, []).append(h.name)
    if machines > len(by_switch):
        raise ParamError(f"{machines} machines for a fabric whose hosts hang off "
                         f"{len(by_switch)} switches: at most {len(by_switch)} machines")
    placement: dict[str, int] = {}
    # contiguous blocks of switches' host groups, each block about total/machines hosts
    total, placed = len(fabric.hosts), 0
    for group in by_switch.values():
        m = min(machines - 1, placed * machines // total)
        for h in group:
            placement[h] = m
        placed += len(group)
    neighbours: dict[str, list[str]] = {s.name: [] for s in fabric.switches}
    for ln in fabric.links:
        for a, b in ((ln.a, ln.b), (ln.b, ln.a)):
            if a in neighbours:
                neighbours[a].append(b)
    host_names = {h.name for h in fabric.hosts}
    load = [0] * machines
    left = [s.name for s in fabric.switches]
    while left:
        # the switches with hosts first (their hosts are placed), then outwards
        progress = False
        for name in list(left):
            votes = [0] * machines
            for n in neighbours[name]:
                if n in placement:
                    votes[placement[n]] += 1
            if not any(votes):
                continue
            hosts = [n for n in neighbours[name] if n in host_names]
            if hosts:      # a switch with hosts: where most of them are
                votes = [0] * machines
                for h in hosts:
                    votes[placement[h]] += 1
                best = max(range(machines), key=lambda m: (votes[m], -load[m]))
            else:          # shared (a spine, a core): the least loaded of its neighbours'
                best = min((m for m in range(machines) if votes[m]), key=lambda m: load[m])
            placement[name] = best
            load[best] += 1
            left.remove(name)
            progress = True
        if not progress:    # an island without hosts: the least loaded machine
            name = left.pop(0)
            best = min(range(machines), key=lambda m: load[m])
            placement[name] = best
            load[best] += 1
    part = Partition(fabric, machines, placement)
    for c in part.crossings:
        if c.link.kind != "fabric":
            raise ParamError(f"link {c.link.a}-{c.link.b} ({c.link.kind}) would cross "
                             f"machines: only switch-to-switch links can")
        if c.key > MAX_TUNNEL_KEY:
            raise ParamError("too many links for VXLAN's 24-bit keys")
    return part
