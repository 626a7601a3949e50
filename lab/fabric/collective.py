"""Collectives on the fabric's GPU agents, checked against numpy and measured in
nccl-tests' terms: all-reduce (shared by `fabriclab allreduce`, the API and the
`allreduce` and `rack-vs-scaleout` experiments), and reduce-scatter, all-gather and
broadcast over the ring (run_ring: the API, and the building blocks of training jobs)."""
from __future__ import annotations

import math

import numpy as np

from lab.fabric.gpus import GpuAgents
from lab.fabric.network import FabricNetwork
from topologies.leafspine import LeafSpine, LeafSpineParams
from topologies.rack import Rack, RackParams
from traffic.collectives import chunk_bounds

ALGORITHMS = ("ring", "tree", "hier")
TRANSPORTS = ("rc", "mrc")


def fabric_for(n_gpus: int, algorithm: str = "ring") -> LeafSpine | Rack:
    """A small fabric with one GPU host per rank: a leaf-spine with two per leaf, or
    for the hierarchical algorithm GPU racks (two when the count is even)."""
    if algorithm == "hier":
        racks = 2 if n_gpus % 2 == 0 else 1
        return Rack(RackParams(racks=racks, gpus_per_rack=n_gpus // racks))
    return LeafSpine(LeafSpineParams(spines=2, leaves=math.ceil(n_gpus / 2), hosts_per_leaf=2))


# nccl-tests' bus bandwidth: algbw (S/t, S the whole buffer) times what each link of a
# ring must carry of S, per collective over n ranks (its doc/PERFORMANCE.md)
BUSBW_FACTOR = {"allreduce": lambda n: 2 * (n - 1) / n,
                "reduce_scatter": lambda n: (n - 1) / n,
                "all_gather": lambda n: (n - 1) / n,
                "broadcast": lambda n: 1.0,
                "alltoall": lambda n: (n - 1) / n,
                "sendrecv": lambda n: 1.0}
RING_KINDS = ("reduce_scatter", "all_gather", "broadcast")


def nccl_figures(size_bytes: int, n: int, time_s: float, kind: str = "allreduce") -> dict:
    """nccl-tests' yardsticks: algbw = S/t, busbw = algbw x BUSBW_FACTOR (all-reduce:
    2(n-1)/n)."""
    algbw = size_bytes / time_s if time_s > 0 else float("inf")
    return {"time_s": time_s, "size_bytes": size_bytes, "algbw_mbps": algbw * 8 / 1e6,
            "busbw_mbps": algbw * BUSBW_FACTOR[kind](n) * 8 / 1e6}


def p2p_figures(flows: list[dict], kind: str) -> dict:
    """nccl-tests' figures for point-to-point collectives over the flows of one call:
    "alltoall" (S: the largest send buffer of a rank, all its messages together) or
    "sendrecv" (a pipeline step; S: the largest message); t: the last flow's completion.
    Every message intact too."""
    ranks = {f["src"] for f in flows} | {f["dst"] for f in flows}
    per_rank: dict[str, int] = {}
    for f in flows:
        per_rank[f["src"]] = per_rank.get(f["src"], 0) + f["bytes"]
    size = max(per_rank.values()) if kind == "alltoall" else max(f["bytes"] for f in flows)
    done = [f["completion_s"] for f in flows]
    time_s = max(done) if None not in done else float("inf")
    return {**nccl_figures(size, len(ranks), time_s, kind),
            "intact": all(f["intact"] for f in flows)}


def expected_ring(kind: str, tensors: list[np.ndarray], root: int = 0) -> list[np.ndarray]:
    """What each host must hold after `kind` (numpy): reduce-scatter, host r chunk r of
    the sum; all-gather, every host chunk r of host r's buffer, for every r; broadcast,
    every host the root's buffer."""
    n = len(tensors)
    stack = np.stack(tensors).astype(np.float32)
    bounds = chunk_bounds(stack.shape[1], n)
    if kind == "reduce_scatter":
        total = stack.sum(axis=0)
        return [total[lo:hi] for lo, hi in bounds]
    if kind == "all_gather":
        gathered = np.concatenate([stack[r, lo:hi] for r, (lo, hi) in enumerate(bounds)])
        return [gathered] * n
    if kind == "broadcast":
        return [stack[root]] * n
    raise ValueError(f"unknown collective {kind!r}; one of {', '.join(RING_KINDS)}")


def run_ring(net: FabricNetwork, kind: str, tensors: list[np.ndarray], transport: str = "rc",
             root: int = 0, first_collective_id: int = 1) -> dict:
    """Reduce-scatter, all-gather or broadcast of `tensors` (one per GPU host, in host
    order) over the ring of hosts; every host's result checked against numpy."""
    n = len(tensors)
    expected = expected_ring(kind, tensors, root)
    hosts = [h.name for h in net.fabric.hosts[:n]]
    with GpuAgents(net, hosts, first_collective_id=first_collective_id) as gpus:
        call = {"reduce_scatter": gpus.reduce_scatter, "all_gather": gpus.all_gather,
                "broadcast": lambda d, t: gpus.broadcast(d, root, t)}[kind]
        res = call(tensors, transport)
        cpu_bound = gpus.cpu_bound()
    errors = [float(np.max(np.abs(r - e))) if e.size else 0.0
              for r, e in zip(res.results, expected)]
    scale = max([1.0] + [float(np.max(np.abs(e))) for e in expected if e.size])
    tol = 1e-5 * scale * n
    link_mbps = net.fabric.hosts[0].interface().rate_mbps
    figures = nccl_figures(tensors[0].nbytes, n, res.time_s, kind)
    return {"kind": kind, "hosts": hosts, "transport": transport, "n": n, "root": root,
            "results": res.results, "expected": expected, "max_abs_error": max(errors),
            "tolerance": tol, "agree": all(e <= tol for e in errors),
            "per_host_error": errors, "link_rate_mbps": link_mbps,
            "busbw_over_link": figures["busbw_mbps"] / link_mbps,
            "retransmitted_packets": sum(c.get("retransmitted", 0) for per_host in res.counters
                                         for c in per_host.values()),
            "cpu_bound_hosts": cpu_bound, **figures}


def run(net: FabricNetwork, tensors: list[np.ndarray], transport: str = "rc",
        mean: bool = True, algorithm: str = "ring", first_collective_id: int = 1) -> dict:
    """All-reduce `tensors` (one per GPU host, in host order) and check every result.
    One value per host (the teaching example): "per_host" says what each gave and holds."""
    n = len(tensors)
    hosts = [h.name for h in net.fabric.hosts[:n]]
    with GpuAgents(net, hosts, first_collective_id=first_collective_id) as gpus:
        res = gpus.allreduce(tensors, transport, op="mean" if mean else "sum",
                             algorithm=algorithm)
        cpu_bound = gpus.cpu_bound()
    expected = np.sum(np.stack(tensors).astype(np.float32), axis=0)
    if mean:
        expected = expected / n
    results = res.results
    errors = [float(np.max(np.abs(r - expected))) if r.size else 0.0 for r in results]
    tol = 1e-5 * max(1.0, float(np.max(np.abs(expected))) if expected.size else 1.0) * n
    retx = sum(c.get("retransmitted", 0) for per_host in res.counters
               for c in per_host.values())
    link_mbps = net.fabric.hosts[0].interface().rate_mbps
    figures = nccl_figures(tensors[0].nbytes, n, res.time_s)
    per_host = {h: {"gave": float(t[0]), "holds": round(float(r[0]), 6)}
                for h, t, r in zip(hosts, tensors, results)} \
        if all(t.size == 1 for t in tensors) else None
    # a phase ends for the collective when its slowest host ends it
    phases = {k: max(p.get(k, 0.0) for p in res.phase_s) for k in res.phase_s[0]}
    return {
        "hosts": hosts, "per_host": per_host, "transport": transport, "phase_s": phases, "algorithm": algorithm, "n": n,
        "results": results, "expected": expected,
        "max_abs_error": max(errors), "tolerance": tol,
        "agree": all(e <= tol for e in errors), "per_host_error": errors,
        "retransmitted_packets": retx, "link_rate_mbps": link_mbps,
        "busbw_over_link": figures["busbw_mbps"] / link_mbps,
        "cpu_bound_hosts": cpu_bound,
        **figures,
    }
