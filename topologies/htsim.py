"""htsim's input files from a lab fabric: its topology file (`-topo`) and its
connection matrix (`-tm`), so that the packet-level simulator runs the fabric the lab
emulates (bench/htsim_compare.py, docs/htsim.md).

Pure: no kernel, no Mininet at run time, no subprocess; text in, text out.

Scale. The lab's links run slow and stand for fast ones: a link of `rate_mbps` with the
fabric's `rate_scale` stands for rate_mbps x rate_scale real Mb/s (10 Mb/s x 10000 =
100 Gb/s). htsim runs at the real rate, so the files carry the real rates, and times in
them (flow starts, link latency) are real time, not the lab's stretched time.

Node numbering. htsim numbers its hosts 0..N-1 and puts host i under ToR i // (hosts per
ToR). The lab's leaf-spine builder adds its GPU hosts leaf by leaf (g0..g{H-1} on fl-lf0,
then fl-lf1, ...), so htsim node i is the lab's i-th host in the fabric's order, which
for that builder is host `g<i>` (`node_numbers()`); the exporter checks that order
against the links rather than assuming it.

What maps: a two-tier leaf-spine (every leaf one link to every spine, one NIC per host,
one rate for host links and one for fabric links) is htsim's 2-tier fat tree in one pod:
tier 0 the leaves (radix down = hosts per leaf, radix up = spines), tier 1 the spines
(radix down = leaves). Anything else is refused with a ValueError that says why.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from topologies.fabric import Fabric

# htsim refuses a tier without a link latency (0 reads as "missing"); the lab's links have
# no delay, its round trip is the hosts' software. 1 us per link is htsim's own default
# and the setting of the reference runs (docs/htsim.md).
LINK_LATENCY_NS = 1000
SWITCH_LATENCY_NS = 0
# htsim reads a flow's size with stoi: a 32-bit int.
MAX_FLOW_BYTES = 2**31 - 1
DEFAULT_RATE_SCALE = 1000     # topologies/base.py's, for a fabric.json that lacks one
WHOLE_GBPS_TOLERANCE = 1e-3   # relative: how far from a whole Gb/s a real rate may be


@dataclass(frozen=True)
class Flow:
    """One connection of the matrix, in the lab's host names and htsim's (real) time."""
    src: str                  # lab host name, e.g. "g1"
    dst: str
    size_bytes: int           # payload bytes the sender moves
    start_us: float = 0.0     # real time (the lab's emulated time / rate_scale)


@dataclass(frozen=True)
class LeafSpineShape:
    """What htsim's 2-tier file says about a leaf-spine fabric."""
    spines: int
    leaves: int
    hosts_per_leaf: int
    host_link_gbps: int       # a host's NIC and its leaf's downlink, real rate
    fabric_link_gbps: int     # a leaf-spine link, real rate

    @property
    def nodes(self) -> int:
        return self.leaves * self.hosts_per_leaf

    @property
    def oversubscription(self) -> int:
        """Host bandwidth into a leaf over its uplink bandwidth (htsim takes an integer)."""
        return (self.hosts_per_leaf * self.host_link_gbps) // (self.spines
                                                                * self.fabric_link_gbps)


def rate_scale(fabric: Fabric) -> int:
    return int(fabric.params.get("rate_scale", DEFAULT_RATE_SCALE))


def real_gbps(fabric: Fabric, rate_mbps: float) -> float:
    """The real rate a lab link of `rate_mbps` stands for."""
    return rate_mbps * rate_scale(fabric) / 1000.0


def node_numbers(fabric: Fabric) -> dict[str, int]:
    """Lab host name -> htsim node: the host's position in the fabric's order."""
    return {h.name: i for i, h in enumerate(fabric.hosts)}


def _whole_gbps(fabric: Fabric, rates_mbps: set[float], what: str) -> int:
    if len(rates_mbps) != 1:
        raise ValueError(f"htsim's file has one rate per tier; the fabric's {what} links run "
                         f"at {sorted(rates_mbps)} Mb/s")
    gbps = real_gbps(fabric, rates_mbps.pop())
    # a calibrated run's rate_scale is rounded to an integer (lab/runner.py), so its
    # 100 Gb/s may come out as 99.9999: within WHOLE_GBPS_TOLERANCE it is 100
    if gbps < 1 or abs(gbps - round(gbps)) > WHOLE_GBPS_TOLERANCE * gbps:
        raise ValueError(f"htsim's file takes whole Gb/s; the {what} links stand for "
                         f"{gbps:g} Gb/s (rate_mbps x rate_scale {rate_scale(fabric)} / 1000)")
    return int(round(gbps))


def leaf_spine_shape(fabric: Fabric) -> LeafSpineShape:
    """The fabric as htsim's 2-tier leaf-spine, or a ValueError naming what does not fit."""
    roles = {sw.role for sw in fabric.switches}
    if not roles <= {"spine", "leaf"} or "leaf" not in roles or "spine" not in roles:
        raise ValueError(f"only two-tier leaf-spine fabrics are exported to htsim; this "
                         f"{fabric.kind} fabric has switch roles {sorted(roles)}")
    multi = [h for h in fabric.hosts if len(h.interfaces) != 1]
    if multi:
        networks = ", ".join(i.network for i in multi[0].interfaces)
        raise ValueError(f"htsim's hosts have one NIC each; {multi[0].name} has "
                         f"{len(multi[0].interfaces)} ({networks}): a scale-up network or a "
                         f"second plane has no place in htsim's fat-tree file (export one "
                         f"plane: planes=1)")
    spines = [sw.name for sw in fabric.switches if sw.role == "spine"]
    leaf_order: list[str] = []              # leaves in the order their hosts come
    for h in fabric.hosts:
        leaf = h.interfaces[0].switch
        if fabric.switch(leaf).role != "leaf":
            raise ValueError(f"host {h.name} hangs off {leaf}, not a leaf")
        if leaf not in leaf_order:
            leaf_order.append(leaf)
    leaves = [sw.name for sw in fabric.switches if sw.role == "leaf"]
    if set(leaf_order) != set(leaves):
        raise ValueError("htsim puts the same number of hosts under every ToR; leaves "
                         f"{sorted(set(leaves) - set(leaf_order))} have none")
    per_leaf = len(fabric.hosts) // len(leaves)
    for i, h in enumerate(fabric.hosts):
        if per_leaf * len(leaves) != len(fabric.hosts) \
                or h.interfaces[0].switch != leaf_order[i // per_leaf]:
            raise ValueError("htsim puts host i under ToR i // (hosts per ToR): the fabric's "
                             "hosts must come leaf by leaf, the same number on each "
                             f"({h.name} is on {h.interfaces[0].switch})")
    host_rates, fabric_rates, uplinks = set(), set(), {}
    for ln in fabric.links:
        ends = {fabric.switch(n).role if n in spines + leaves else "host": n
                for n in (ln.a, ln.b)}
        if ln.kind == "host":
            host_rates.add(ln.rate_mbps)
        elif set(ends) == {"leaf", "spine"}:
            fabric_rates.add(ln.rate_mbps)
            key = (ends["leaf"], ends["spine"])
            uplinks[key] = uplinks.get(key, 0) + 1
        else:
            raise ValueError(f"link {ln.a}-{ln.b} ({ln.kind}) is not a host link or a "
                             f"leaf-spine link")
    if any(uplinks.get((lf, sp)) != 1 for lf in leaves for sp in spines):
        raise ValueError("htsim's 2-tier file needs exactly one link from every leaf to every "
                         "spine")
    shape = LeafSpineShape(spines=len(spines), leaves=len(leaves), hosts_per_leaf=per_leaf,
                           host_link_gbps=_whole_gbps(fabric, host_rates, "host"),
                           fabric_link_gbps=_whole_gbps(fabric, fabric_rates, "leaf-spine"))
    # htsim computes the leaves' uplinks from the oversubscription (an integer) and then
    # checks radix_down / radix_up == oversubscription in integer division
    down = shape.hosts_per_leaf * shape.host_link_gbps
    up = shape.spines * shape.fabric_link_gbps
    if down % up or shape.hosts_per_leaf // shape.spines != down // up:
        raise ValueError(f"htsim's 2-tier file needs a leaf's host bandwidth to be a whole "
                         f"multiple of its uplink bandwidth, equal to hosts_per_leaf // "
                         f"spines; here {down} Gb/s down, {up} Gb/s up, "
                         f"{shape.hosts_per_leaf} hosts and {shape.spines} spines per leaf")
    return shape


def topology_text(fabric: Fabric, link_latency_ns: int = LINK_LATENCY_NS) -> str:
    """htsim's `-topo` file. Queue sizes are left out: the drivers take them from `-q`
    and refuse a file that sets them too."""
    s = leaf_spine_shape(fabric)
    if link_latency_ns < 1:
        raise ValueError("htsim reads a link latency of 0 as missing: give 1 ns or more")
    nodes = node_numbers(fabric)
    first, last = fabric.hosts[0].name, fabric.hosts[-1].name
    return "\n".join([
        f"# fabriclab {fabric.kind}: spines={s.spines} leaves={s.leaves} "
        f"hosts_per_leaf={s.hosts_per_leaf}; lab rates x rate_scale {rate_scale(fabric)}",
        f"# htsim node i = the lab's i-th host ({first} = {nodes[first]} .. "
        f"{last} = {nodes[last]}), under ToR i // {s.hosts_per_leaf}",
        f"Nodes {s.nodes}",
        "Tiers 2",
        f"Podsize {s.nodes}",
        "",
        "Tier 0",
        f"Downlink_speed_Gbps {s.host_link_gbps}",
        f"Radix_Down {s.hosts_per_leaf}",
        f"Radix_Up {s.spines}",
        f"Downlink_Latency_ns {link_latency_ns}",
        f"Switch_Latency_ns {SWITCH_LATENCY_NS}",
        f"Oversubscribed {s.oversubscription}",
        "",
        "Tier 1",
        f"Downlink_speed_Gbps {s.fabric_link_gbps}",
        f"Radix_Down {s.leaves}",
        f"Downlink_Latency_ns {link_latency_ns}",
        f"Switch_Latency_ns {SWITCH_LATENCY_NS}",
        "",
    ])


TRAFFIC = ("incast", "permutation")


def incast_flows(fabric: Fabric, senders: int, size_bytes: int) -> list[Flow]:
    """The lab's incast at any size: the fabric's first host receives from the next
    `senders` (lab/experiments/incast.py's choice of hosts)."""
    hosts = [h.name for h in fabric.hosts]
    if not 1 <= senders < len(hosts):
        raise ValueError(f"an incast of {senders} senders needs {senders + 1} hosts; the "
                         f"fabric has {len(hosts)}")
    return [Flow(s, hosts[0], size_bytes) for s in hosts[1:senders + 1]]


def permutation_flows(fabric: Fabric, size_bytes: int, seed: int = 1) -> list[Flow]:
    """Every host sends to one other and receives from one other: a random permutation
    without fixed points (Sattolo's algorithm: one cycle through every host), the
    load that shows how evenly a fabric's paths carry traffic."""
    hosts = [h.name for h in fabric.hosts]
    if len(hosts) < 2:
        raise ValueError("a permutation needs 2 hosts or more")
    order = list(hosts)
    rng = random.Random(seed)
    for i in range(len(order) - 1, 0, -1):
        j = rng.randrange(i)
        order[i], order[j] = order[j], order[i]
    return [Flow(order[i], order[(i + 1) % len(order)], size_bytes)
            for i in range(len(order))]


def connection_matrix_text(fabric: Fabric, flows: list[Flow]) -> str:
    """htsim's `-tm` file: one line per flow, in the order given. This htsim reads a
    start as picoseconds (its older parser took microseconds)."""
    nodes = node_numbers(fabric)
    if not flows:
        raise ValueError("no flows")
    lines = [f"Nodes {len(nodes)}", f"Connections {len(flows)}"]
    for f in flows:
        missing = [n for n in (f.src, f.dst) if n not in nodes]
        if missing:
            raise ValueError(f"flow {f}: no host {', '.join(missing)} in the fabric")
        if f.src == f.dst:
            raise ValueError(f"flow {f}: source and destination are the same host")
        if not 0 < f.size_bytes <= MAX_FLOW_BYTES:
            raise ValueError(f"flow {f}: htsim takes sizes of 1 to {MAX_FLOW_BYTES} bytes")
        if f.start_us < 0:
            raise ValueError(f"flow {f}: negative start")
        lines.append(f"{nodes[f.src]}->{nodes[f.dst]} start {round(f.start_us * 1e6)} "
                     f"size {f.size_bytes}")
    return "\n".join(lines) + "\n"
