"""Reachability of a built fabric, measured: every host pair, RTT and hop count."""
from __future__ import annotations

import random
from dataclasses import dataclass

from controllers.routes import hop_distances, switch_graph
from lab.kernel.probe import PairResult, probe
from topologies.base import plane_of
from topologies.fabric import Fabric


MAX_TRIES = 10     # probe rounds while a round still gains answers (lab/kernel/probe.py)
# Every probe of a verify is a first contact: a new flow at each switch it crosses, set
# up by OVS's slow path (an upcall), which has its limit. Measured (2 cores, userspace
# datapath, 12-05): 256 hosts all pairs, 20k probes/s: 60% answered in the first round,
# 3 rounds, 9.4 s; 5k/s: all in one round, 13.3 s. 1024 hosts, 64 sampled per host:
# 20k/s 7 rounds, 23.5 s; 10k/s 4 rounds, 19.6 s; 5k/s one round, 16.5 s.
RATE_PPS = 5000
SUGGEST_SAMPLE_PAIRS = 100_000    # above this many pairs (~20 s) a verify suggests --sample
SAMPLE_PER_HOST = 64              # what it suggests (bench/scale.py samples as many)


@dataclass
class ProbePair:
    src: str
    dst: str
    dst_ip: str
    network: str
    expected_hops: int   # TTL decrements on the shortest path


def routed_networks(fabric: Fabric) -> list[str]:
    """scale-out, then a multi-plane fabric's other planes, in order."""
    nets = {i.network for h in fabric.hosts for i in h.interfaces}
    return sorted((n for n in nets if plane_of(n) is not None), key=plane_of)


def pairs_to_probe(fabric: Fabric) -> list[ProbePair]:
    """All scale-out pairs (on every plane of a multi-plane fabric), and the scale-up
    pairs inside each rack."""
    graph = switch_graph(fabric)
    dist_cache: dict[str, dict[str, int]] = {}
    out = []
    for net in routed_networks(fabric):
        for a, b in fabric.host_pairs(net):
            sa, sb = a.interface(net).switch, b.interface(net).switch
            if sb not in dist_cache:
                dist_cache[sb] = hop_distances(graph, sb)
            # every switch on the path routes (decrements the TTL): path length + 1
            out.append(ProbePair(a.name, b.name, b.interface(net).ip, net,
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
        for network in dict.fromkeys(p.network for p in self.pairs):
            ok, total = self.count(network)
            label = "host pairs" if network == "scale-out" else \
                "scale-up pairs (in-rack)" if network == "scale-up" else f"{network} pairs"
            out.append(f"reachable: {ok}/{total} {label}")
        return out


def sample(pairs: list[ProbePair], per_host: int, seed: int = 1) -> list[ProbePair]:
    """At most `per_host` destinations of each source, chosen at random (the same for a
    seed): every host sends and (nearly surely) receives, every leaf pair is covered at
    scale, at a fraction of all pairs' probes."""
    rng = random.Random(seed)
    by_src: dict[str, list[ProbePair]] = {}
    for p in pairs:
        by_src.setdefault(p.src, []).append(p)
    return [p for src in by_src for p in
            (rng.sample(by_src[src], per_host) if len(by_src[src]) > per_host
             else by_src[src])]


def planned(fabric: Fabric, per_host: int | None = None) -> list[ProbePair]:
    """The pairs a verify probes: every pair, or `per_host` random destinations of each
    host (sample(): the same on every machine of a cluster)."""
    pairs = pairs_to_probe(fabric)
    return pairs if per_host is None else sample(pairs, per_host)


def announce(pairs: list[ProbePair], per_host: int | None) -> str:
    """What a verify is about to do and its least time, said before the fabric is built:
    at 1024 hosts all pairs are a million probes (~4 min at RATE_PPS, more where the
    switches' slow paths drop first contacts and rounds repeat)."""
    what = f"{len(pairs)} host pairs to probe" + \
        (f" ({per_host} destinations of each host)" if per_host is not None else " (all)")
    out = f"{what}: at least {len(pairs) / RATE_PPS:.0f} s at {RATE_PPS} probes/s"
    if per_host is None and len(pairs) > SUGGEST_SAMPLE_PAIRS:
        out += f"; --sample {SAMPLE_PER_HOST} probes {SAMPLE_PER_HOST} random destinations " \
               f"of each host instead"
    return out


def measure(fabric: Fabric, host_pids: dict[str, int], tries: int = 3,
            per_host: int | None = None, sources: set[str] | None = None) -> Reachability:
    """The planned pairs (planned()); only those from `sources` if given (a cluster's
    machine probes from its own hosts)."""
    pairs = planned(fabric, per_host)
    if sources is not None:
        pairs = [p for p in pairs if p.src in sources]
    results = probe([(p.src, p.dst, p.dst_ip) for p in pairs], host_pids, tries=tries,
                    rate_pps=RATE_PPS, max_tries=MAX_TRIES)
    return Reachability(pairs, results)
