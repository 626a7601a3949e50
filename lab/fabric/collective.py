"""A collective (all-reduce) on the fabric's GPU agents, checked against numpy and
measured: shared by `fabriclab allreduce`, the API and the `allreduce` and
`rack-vs-scaleout` experiments."""
from __future__ import annotations

import math

import numpy as np

from lab.fabric.gpus import GpuAgents
from lab.fabric.network import FabricNetwork
from topologies.leafspine import LeafSpine, LeafSpineParams
from topologies.rack import Rack, RackParams

ALGORITHMS = ("ring", "tree", "hier")
TRANSPORTS = ("rc", "mrc")


def fabric_for(n_gpus: int, algorithm: str = "ring") -> LeafSpine | Rack:
    """A small fabric with one GPU host per rank: a leaf-spine with two per leaf, or
    for the hierarchical algorithm GPU racks (two when the count is even)."""
    if algorithm == "hier":
        racks = 2 if n_gpus % 2 == 0 else 1
        return Rack(RackParams(racks=racks, gpus_per_rack=n_gpus // racks))
    return LeafSpine(LeafSpineParams(spines=2, leaves=math.ceil(n_gpus / 2), hosts_per_leaf=2))


def nccl_figures(size_bytes: int, n: int, time_s: float) -> dict:
    """nccl-tests' yardsticks: algbw = S/t, busbw = algbw * 2(n-1)/n (all-reduce)."""
    algbw = size_bytes / time_s if time_s > 0 else float("inf")
    return {"time_s": time_s, "size_bytes": size_bytes, "algbw_mbps": algbw * 8 / 1e6,
            "busbw_mbps": algbw * 2 * (n - 1) / n * 8 / 1e6}


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
