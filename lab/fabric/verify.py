"""Reachability of a built fabric, measured: every host pair, RTT and hop count."""
from __future__ import annotations

from dataclasses import dataclass

from controllers.routes import hop_distances, switch_graph
from lab.kernel.probe import PairResult, probe
from topologies.fabric import Fabric


@dataclass
class ProbePair:
    src: str
    dst: str
    dst_ip: str
    network: str
    expected_hops: int   # TTL decrements on the shortest path


def pairs_to_probe(fabric: Fabric) -> list[ProbePair]:
    """All scale-out pairs, and the scale-up pairs inside each rack."""
    graph = switch_graph(fabric)
    dist_cache: dict[str, dict[str, int]] = {}
    out = []
    for a, b in fabric.host_pairs("scale-out"):
        sa, sb = a.interface().switch, b.interface().switch
        if sb not in dist_cache:
            dist_cache[sb] = hop_distances(graph, sb)
        # every switch on the path routes (decrements the TTL): path length + 1
        out.append(ProbePair(a.name, b.name, b.interface().ip, "scale-out",
                             dist_cache[sb][sa] + 1))
    for a, b in fabric.host_pairs("scale-up"):
        if a.rack == b.rack:
            out.append(ProbePair(a.name, b.name, b.interface("scale-up").ip, "scale-up", 0))
    return out


@dataclass
class Reachability:
    pairs: list[ProbePair]
    results: list[PairResult]

    def count(self, network: str) -> tuple[int, int]:
        sel = [r for p, r in zip(self.pairs, self.results) if p.network == network]
        return sum(r.rtt_ms is not None for r in sel), len(sel)

    @property
    def reachable(self) -> int:
        return sum(r.rtt_ms is not None for r in self.results)

    @property
    def wrong_hops(self) -> list[tuple[ProbePair, PairResult]]:
        return [(p, r) for p, r in zip(self.pairs, self.results)
                if r.hops is not None and r.hops != p.expected_hops]

    def lines(self) -> list[str]:
        out = []
        for network in ("scale-out", "scale-up"):
            ok, total = self.count(network)
            if total:
                label = "host pairs" if network == "scale-out" else "scale-up pairs (in-rack)"
                out.append(f"reachable: {ok}/{total} {label}")
        return out


def measure(fabric: Fabric, host_pids: dict[str, int], tries: int = 3) -> Reachability:
    pairs = pairs_to_probe(fabric)
    results = probe([(p.src, p.dst, p.dst_ip) for p in pairs], host_pids, tries=tries)
    return Reachability(pairs, results)
