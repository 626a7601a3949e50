"""ECMP collisions vs spraying: long flows between two leaves, RC then MRC.

RC keeps each QP on one UDP source port, so the fabric's 5-tuple ECMP pins
each flow to one spine: flows collide on some uplinks while others idle. MRC
sprays every packet on its own entropy value, spreading each flow over every
spine. Measured from the source leaf's uplink byte counters.

Four variants: `rc` (lossy: a collision's drops also set off go-back-N, so its slowest
flow mixes the collision with the collapse; stopped after `rc_limit_ideals` ideal times
of its slowest flow, as the incast stops its lossy variant), `rc+pfc` (RC as RoCE is deployed:
lossless, so its slowest flow shows the collision alone; what htsim's RoCE+PFC is set
beside in bench/htsim_compare.py), `mrc_hash` (the default EV set, hashed) and
`mrc_explicit` (one EV per spine, mapped).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lab.core.errors import UsageError
from lab.experiments.base import Claim, RunContext
from lab.experiments.common import (SETTLE_S, SwitchDrops, drain_quiet_s, once_quiet,
                                    rc_params, traffic_timeout_s, tx_bytes)
from lab.fabric.capture import CapturePlan
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents, explicit_evs
from topologies.fabric import interface_name
from traffic.constants import DEFAULT_MTU_BYTES
from traffic.mrc import DATA_OVERHEAD_BYTES
from traffic.roce import WRITE_OVERHEAD_BYTES

log = logging.getLogger(__name__)
NAME = "ecmp-vs-spray"
DESCRIPTION = "long flows leaf to leaf: bytes per spine uplink, RC (ECMP-pinned) vs MRC (sprayed)"
# 10 Mb/s links stand for 100 Gb/s: eight flows at 100 Mb/s left this 2-core machine's
# GPU hosts CPU-bound (the run warned)
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 4, "leaves": 2, "hosts_per_leaf": 4,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 10.0,
                                    "rate_scale": 10000}}
BALANCE_TOLERANCE = 0.10      # sprayed uplinks within 10% of their mean
VARIANTS = ("rc", "rc+pfc", "mrc_hash", "mrc_explicit")

SCALED_SIZES = ("flow_mb",)   # shrink with the link rates on a slow machine (calibrate.py)
# flow ends busy at once at the defaults (4 flows, leaf 0 to leaf 1) (calibrate.py)
BUSY_ENDS = 8

@dataclass
class Params:
    topology: str = "leaf-spine"
    flow_mb: float = 1.0
    flows_per_host: int = 2
    # the lossy rc variant stops after this many ideal times of its slowest flow:
    # go-back-N's collapse grows with the round trip in packets, so a slow machine's
    # hosts stretch it (natively 7.9 ideals; a software CPU 32, 92 s of a 10.4-min
    # tour), while every claim on it holds once spraying has finished sooner
    rc_limit_ideals: float = 10.0

    def validate(self) -> None:
        if self.topology != "leaf-spine":
            raise UsageError("ecmp-vs-spray needs topology=leaf-spine")
        if self.flow_mb <= 0 or self.flows_per_host <= 0 or self.rc_limit_ideals <= 1:
            raise UsageError("flow_mb and flows_per_host must be positive, rc_limit_ideals "
                             "above 1")


def uplink_bytes(leaf: str, spines: int) -> list[int]:
    return [tx_bytes(interface_name(leaf, p)) for p in range(1, spines + 1)]


def capture_plan(fabric, params: Params) -> CapturePlan:
    """fl-lf0's spine uplinks: which entropy values (UDP source ports) each carries;
    RC's flows first (one port each, pinned), then MRC's sprayed ones."""
    return CapturePlan([f"fl-lf0:{p}" for p in range(1, fabric.params["spines"] + 1)],
                       "udp dst port 4791", "RoCE frames only")


def flows(ctx: RunContext) -> list[tuple[str, str, int]]:
    fabric, p = ctx.fabric, ctx.params
    src = [h.name for h in fabric.hosts if h.interface().switch == "fl-lf0"]
    dst = [h.name for h in fabric.hosts if h.interface().switch == "fl-lf1"]
    if p.flows_per_host > len(dst):
        raise UsageError(f"flows_per_host={p.flows_per_host} exceeds the {len(dst)} hosts per leaf")
    nbytes = int(p.flow_mb * 1e6)
    return [(s, dst[(i + k) % len(dst)], nbytes)
            for i, s in enumerate(src) for k in range(p.flows_per_host)]


def time_limit_s(fabric, plan) -> float:
    """How long the flows may take: as if the worst collision put every one on one uplink
    of the source leaf (at x0.05, a software CPU, RC's colliding flows outlasted a fixed
    120 s)."""
    return traffic_timeout_s(sum(n for *_, n in plan), uplink_mbps(fabric))


def uplink_mbps(fabric) -> float:
    """The slowest of fl-lf0's spine uplinks."""
    return min(ln.rate_mbps for ln in fabric.links
               if ln.kind == "fabric" and "fl-lf0" in (ln.a, ln.b))


def measure(ctx: RunContext, gpus: GpuAgents, transport: str, plan, params=None,
            limit_ideals: float | None = None) -> dict:
    """limit_ideals: stop the flows after that many ideal times of the slowest (those
    unfinished then are reported so: completion None, intact None)."""
    spines = ctx.fabric.params["spines"]
    # the slowest flow's best: each host's flows share its link (the uplinks together
    # carry what the hosts do), every frame on the wire counted
    rate_mbps = ctx.fabric.host(plan[0][0]).interface().rate_mbps
    per_host = max(sum(1 for s, *_ in plan if s == h) for h, *_ in plan)
    packets = -(-plan[0][2] // DEFAULT_MTU_BYTES)
    overhead = DATA_OVERHEAD_BYTES if transport == "mrc" else WRITE_OVERHEAD_BYTES
    ideal_s = per_host * packets * (DEFAULT_MTU_BYTES + overhead) * 8 / (rate_mbps * 1e6)
    limit_s = time_limit_s(ctx.fabric, plan) if limit_ideals is None else limit_ideals * ideal_s
    t0 = time.time()
    before = uplink_bytes("fl-lf0", spines)
    res = gpus.transfers(plan, transport, params=params, timeout_s=limit_s,
                         allow_timeout=limit_ideals is not None)
    finished = [f["completion_s"] for f in res if f["completion_s"] is not None]
    stopped = len(finished) < len(res)
    # stopped: the queues the flows left drain first
    after = once_quiet(lambda: uplink_bytes("fl-lf0", spines),
                       drain_quiet_s(uplink_mbps(ctx.fabric)), what="fl-lf0's uplinks") \
        if stopped else uplink_bytes("fl-lf0", spines)
    per_spine = [a - b for a, b in zip(after, before)]
    t1 = time.time()
    mean = sum(per_spine) / len(per_spine)
    retx = sum(f["counters"]["retransmitted"] for f in res)
    return {"bytes_per_spine_uplink": per_spine,
            "imbalance_max_over_mean": max(per_spine) / mean if mean else None,
            "max_deviation_from_mean": max(abs(b - mean) for b in per_spine) / mean if mean else None,
            "completion_s_max": None if stopped else max(finished),
            "slowest_vs_ideal": None if stopped else round(max(finished) / ideal_s, 3),
            # unfinished flows, stopped after this long: the slowest took longer still
            "stopped_after_s": round(limit_s, 3) if stopped else None,
            "flows_finished": len(finished),
            "completion_s_mean": sum(finished) / len(finished) if finished else None,
            "all_intact": all(f["intact"] is not False for f in res) and bool(finished),
            "retransmitted_packets": retx,
            "counted_unix_s": [round(t0, 4), round(t1, 4)],
            "flows": [{k: f[k] for k in ("src", "dst", "bytes", "completion_s", "intact")}
                      for f in res]}


def run(ctx: RunContext) -> dict:
    plan = flows(ctx)
    out = {"flows": len(plan), "flow_bytes": plan[0][2]}
    evs = explicit_evs(ctx.fabric, ctx.fabric.host(plan[0][0]))
    rate_mbps = ctx.fabric.host(plan[0][0]).interface().rate_mbps
    # (a retransmit timer above what pauses may hold a frame on its three queues)
    lossless = rc_params(ctx.net, rate_mbps, CongestionParams.kmax_kb, path_queues=3)
    variants = [("rc", "rc", None, False),                   # one source port per QP: hashed
                ("rc+pfc", "rc", lossless, True),            # ...with PFC: no drops
                ("mrc_hash", "mrc", None, False),            # the default EV set, hashed
                ("mrc_explicit", "mrc", {"evs": evs}, False)]   # one EV per spine, mapped
    with GpuAgents(ctx.net) as gpus:
        rc_collective = gpus.next_id
        for name, transport, params, pfc in variants:
            log.info(f"{len(plan)} flows of {plan[0][2] / 1e6:.1f} MB from fl-lf0 to fl-lf1 "
                     f"over {name}")
            ctx.net.set_congestion(CongestionParams(pfc=pfc))
            drops = SwitchDrops(ctx.net, ctx.telemetry)
            later = gpus.next_id
            if name == "rc+pfc":
                # rc's QP numbers again, so the same source ports hash onto the same spines:
                # the same collision, with and without PFC (its late frames gone first)
                time.sleep(SETTLE_S)
                gpus.next_id = rc_collective
            m = measure(ctx, gpus, transport, plan, params,
                        ctx.params.rc_limit_ideals if name == "rc" else None)
            gpus.next_id = max(gpus.next_id, later)
            m["drops_packets"] = drops.count()
            m["lost_inside_switches"] = drops.inside()
            log.info(f"  bytes per spine uplink: {m['bytes_per_spine_uplink']} "
                     f"(max/mean {m['imbalance_max_over_mean']:.2f}), slowest flow "
                     + (f"{m['completion_s_max']:.2f} s" if m["stopped_after_s"] is None else
                        f"unfinished: {m['flows_finished']}/{len(plan)} flows done when "
                        f"stopped at {m['stopped_after_s']:.1f} s ({ctx.params.rc_limit_ideals:g}"
                        f" ideal times; go-back-N's collapse)"))
            out[name] = m
        out["cpu_bound_hosts"] = gpus.cpu_bound()
    ctx.net.set_congestion(CongestionParams())
    return out


def slowest_s(v: dict) -> float:
    """A variant's slowest flow: its completion, or (stopped) the time it had not
    finished by."""
    return v["completion_s_max"] if v["stopped_after_s"] is None else v["stopped_after_s"]


def claims(params: Params, m: dict) -> list[Claim]:
    rc, lossless, mrc = m["rc"], m["rc+pfc"], m["mrc_explicit"]
    rc_slowest = (f"rc {rc['completion_s_max']:.2f} s" if rc["stopped_after_s"] is None
                  else f"rc unfinished at {rc['stopped_after_s']:.2f} s")
    return [
        Claim("every flow arrived intact (CRC-32 end to end), every variant (lossy RC's "
              "that finished before it was stopped)",
              all(m[v]["all_intact"] for v in VARIANTS),
              [m[v]["all_intact"] for v in VARIANTS], "all True"),
        Claim("spraying (explicit EVs) keeps every spine uplink within 10% of the mean",
              mrc["max_deviation_from_mean"] <= BALANCE_TOLERANCE,
              round(mrc["max_deviation_from_mean"], 3), f"<= {BALANCE_TOLERANCE}"),
        Claim("RC's pinned flows collide (uplink max/mean above 1.1)",
              rc["imbalance_max_over_mean"] > 1 + BALANCE_TOLERANCE,
              round(rc["imbalance_max_over_mean"], 3), f"> {1 + BALANCE_TOLERANCE}",
              timing=True),
        Claim("spraying finishes the slowest flow sooner",
              mrc["completion_s_max"] < slowest_s(rc),
              f"mrc {mrc['completion_s_max']:.2f} s", f"< {rc_slowest}",
              timing=True),
        Claim("rc+pfc: no drops, and spraying still finishes the slowest flow sooner (the "
              "collision alone, without go-back-N's collapse)",
              lossless["drops_packets"] == 0
              and mrc["completion_s_max"] < lossless["completion_s_max"],
              {"drops": lossless["drops_packets"],
               "slowest_s": {"mrc_explicit": round(mrc["completion_s_max"], 2),
                             "rc+pfc": round(lossless["completion_s_max"], 2)}},
              "drops == 0, mrc_explicit < rc+pfc", timing=True),
    ]
