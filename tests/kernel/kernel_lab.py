"""Helpers for the kernel-feature tests: a small fabric, ICMP echo samples.

These tests need what module-less kernels lack (netem, the OVS kernel datapath).
They are never skipped for that: where a feature is missing they fail and say
to run them in the lab VM (`fabriclab vm test`), which `make test` does.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from lab.fabric.network import FabricNetwork
from lab.kernel.probe import probe
from topologies.registry import build_topo


@contextmanager
def leaf_spine(workdir: Path, **params):
    topo = build_topo("leaf-spine", **params)
    with FabricNetwork(topo, workdir) as net:
        yield net


def host_pids(net: FabricNetwork) -> dict[str, int]:
    return {h.name: net.host_pid(h.name) for h in net.fabric.hosts}


def echo_rtts_ms(net: FabricNetwork, src: str, dst: str, count: int,
                 rate_pps: float) -> list[float | None]:
    """`count` ICMP echoes src -> dst through the lab's prober, sent once each (no
    retries, so a lost one stays lost): the RTT of each, None when no reply came."""
    ip = net.fabric.host(dst).interface().ip
    results = probe([(src, dst, ip)] * count, host_pids(net), tries=1, timeout_s=2.0,
                    rate_pps=rate_pps)
    return [r.rtt_ms for r in results]
