"""Every GPU host reaches every other, by the shortest paths, with RTTs measured."""
from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass

from lab.experiments.base import Claim, RunContext
from lab.fabric import verify

log = logging.getLogger(__name__)
NAME = "reachability"
DESCRIPTION = "all-pairs ping over the fabric: reachability, RTT per pair, hop counts"


@dataclass
class Params:
    topology: str = "leaf-spine"
    tries: int = 3            # echo requests per pair before it counts as unreachable


def run(ctx: RunContext) -> dict:
    pids = {h.name: ctx.net.host_pid(h.name) for h in ctx.fabric.hosts}
    report = verify.measure(ctx.fabric, pids, tries=ctx.params.tries)
    for line in report.lines():
        log.info(line)
    rtts = sorted(r.rtt_ms for r in report.results if r.rtt_ms is not None)
    return {
        "pairs_total": len(report.pairs),
        "pairs_reachable": report.reachable,
        "pairs_wrong_hops": len(report.wrong_hops),
        "rtt_ms_p50": statistics.median(rtts) if rtts else None,
        "rtt_ms_p99": rtts[int(0.99 * (len(rtts) - 1))] if rtts else None,
        "rtt_ms_max": rtts[-1] if rtts else None,
        "pairs": [{"src": p.src, "dst": p.dst, "network": p.network,
                   "rtt_ms": r.rtt_ms, "hops": r.hops, "expected_hops": p.expected_hops}
                  for p, r in zip(report.pairs, report.results)],
    }


def claims(params: Params, m: dict) -> list[Claim]:
    return [
        Claim("every host pair reachable", m["pairs_reachable"] == m["pairs_total"],
              m["pairs_reachable"], f"== {m['pairs_total']}", "pairs"),
        Claim("every reply crossed a shortest path (hop count from TTL)",
              m["pairs_wrong_hops"] == 0, m["pairs_wrong_hops"], "== 0 pairs off",
              "pairs off"),
    ]
