"""Flat ring over scale-out vs hierarchical all-reduce using the racks' scale-up links.

The same all-reduce over every GPU of two racks, twice: a ring over the scale-out
NICs only, then hierarchically: reduce-scatter inside each rack over the scale-up
links (9x faster by default), a ring across the racks over scale-out on 1/g of
the data, all-gather inside the rack. Each time is compared with the bandwidth
term of the alpha-beta model (2(n-1)/n S/B per level); their ratio with the model's
both terms: the latency term measured, each algorithm's time for a tiny all-reduce
(its steps' fixed costs: messages, GPU agents' turns), which on a slow machine is
no longer small against the bandwidth term and favours the algorithm of fewer steps
less than the bandwidth term favours the hierarchical one.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from lab.core.errors import UsageError
from lab.experiments.base import Claim, RunContext
from lab.experiments.common import floor_time_s, model_time_s
from lab.fabric import collective, gpus

log = logging.getLogger(__name__)
NAME = "rack-vs-scaleout"
DESCRIPTION = "ring over scale-out vs hierarchical over scale-up + scale-out: time vs the model"
# 2 Mb/s scale-out NICs stand for 100 Gb/s (scale-up 18 Mb/s for NVLink's 900 GB/s):
# the eight GPUs' scale-up phases then fit this machine's CPU (at 10 Mb/s, 90 Mb/s
# scale-up, the hosts were CPU-bound and the hierarchical phases took 4x their model).
# Uplinks carry a rack's four cross-rack rings even when ECMP hashes them all onto one
# spine: this experiment is about scale-up vs scale-out, not about collisions.
TOPOLOGY_DEFAULTS = {"rack": {"racks": 2, "gpus_per_rack": 4, "scaleout_rate_mbps": 2.0,
                              "fabric_rate_mbps": 8.0, "rate_scale": 50000}}
MODEL_SPEEDUP_SHARE = 0.6   # measured at the defaults: 3.7x of the model's 4.2x (0.88)
TINY_FLOATS = 64            # per GPU: the latency term's all-reduce (a packet per step)

SCALED_SIZES = ("size_kb",)   # shrink with the link rates on a slow machine (calibrate.py)
# flow ends busy at once at the defaults (a ring over 8) (calibrate.py)
BUSY_ENDS = 16

@dataclass
class Params:
    topology: str = "rack"
    size_kb: int = 128           # per GPU
    transport: str = "rc"
    seed: int = 1

    def validate(self) -> None:
        if self.topology != "rack":
            raise UsageError("rack-vs-scaleout needs topology=rack")
        if self.size_kb <= 0:
            raise UsageError("size_kb must be positive")
        if self.transport not in collective.TRANSPORTS:
            raise UsageError(f"transport must be one of {', '.join(collective.TRANSPORTS)}")


def run(ctx: RunContext) -> dict:
    p = ctx.params
    hosts = ctx.fabric.hosts
    n = len(hosts)
    racks = len({h.rack for h in hosts})
    # a GPU's scale-out bandwidth: on a multi-plane fabric MRC sprays over every plane's
    # port, RC keeps to plane 0's
    out_mbps = hosts[0].interface().rate_mbps * (
        1 + len(gpus.planes(hosts[0])) if p.transport == "mrc" else 1)
    up_mbps = hosts[0].interface("scale-up").rate_mbps
    rng = np.random.default_rng(p.seed)
    tensors = [rng.standard_normal(p.size_kb * 256).astype(np.float32) for _ in range(n)]
    tiny = [rng.standard_normal(TINY_FLOATS).astype(np.float32) for _ in range(n)]
    out = {"gpus": n, "racks": racks, "scaleout_mbps": out_mbps, "scaleup_mbps": up_mbps}
    for i, algorithm in enumerate(("ring", "hier")):
        log.info(f"{algorithm} all-reduce of {p.size_kb} KB per GPU over {n} GPUs "
                 f"in {racks} racks ({p.transport}), after one of {TINY_FLOATS * 4} bytes "
                 f"(its latency term)")
        lat = collective.run(ctx.net, tiny, p.transport, algorithm=algorithm,
                             first_collective_id=1 + 16 * i)
        m = collective.run(ctx.net, tensors, p.transport, algorithm=algorithm,
                           first_collective_id=9 + 16 * i)
        model = model_time_s(algorithm, n, m["size_bytes"], out_mbps, racks, up_mbps)
        out[algorithm] = {"time_s": round(m["time_s"], 4), "model_time_s": round(model, 4),
                          "latency_s": round(lat["time_s"], 4),
                          "over_model": round(m["time_s"] / model, 3),
                          # what the links allow at least, the same way (floor_time_s)
                          "floor_over_model": round(floor_time_s(
                              algorithm, n, m["size_bytes"], out_mbps, racks, up_mbps)
                              / model, 3),
                          "busbw_mbps": round(m["busbw_mbps"], 2), "agree": m["agree"],
                          "retransmitted_packets": m["retransmitted_packets"],
                          **{f"{phase} s": t for phase, t in m["phase_s"].items()}}
        out.setdefault("cpu_bound_hosts", []).extend(m["cpu_bound_hosts"] + lat["cpu_bound_hosts"])
        log.info(f"  {m['time_s'] * 1e3:.0f} ms (bandwidth term {model * 1e3:.0f} ms, "
                 f"latency term {lat['time_s'] * 1e3:.0f} ms)")
    r, h = out["ring"], out["hier"]
    out["speedup"] = round(r["time_s"] / h["time_s"], 3)
    out["model_speedup"] = round(r["model_time_s"] / h["model_time_s"], 3)
    out["model_speedup_with_latency"] = round((r["latency_s"] + r["model_time_s"])
                                              / (h["latency_s"] + h["model_time_s"]), 3)
    out["cpu_bound_hosts"] = sorted(set(out["cpu_bound_hosts"]))
    return out


def claims(params: Params, m: dict) -> list[Claim]:
    return [
        Claim("every GPU holds the mean, both algorithms",
              m["ring"]["agree"] and m["hier"]["agree"],
              {"ring": m["ring"]["agree"], "hier": m["hier"]["agree"]}, "both True"),
        Claim("hierarchical (scale-up + scale-out) beats the flat scale-out ring",
              m["speedup"] > 1.0, f"speedup {m['speedup']}",
              f"> 1 (the model says {m['model_speedup']})", timing=True),
        Claim("the measured speedup reaches most of the alpha-beta model's (latency term "
              "measured)",
              m["speedup"] >= MODEL_SPEEDUP_SHARE * m["model_speedup_with_latency"],
              f"speedup {m['speedup']}",
              f">= {MODEL_SPEEDUP_SHARE} x the model's {m['model_speedup_with_latency']} "
              f"(bandwidth term alone: {m['model_speedup']})", timing=True),
        Claim("neither beats its model's bandwidth term (less a token bucket's burst "
              "per phase)",
              all(m[a]["over_model"] >= m[a]["floor_over_model"] for a in ("ring", "hier")),
              {a: m[a]["over_model"] for a in ("ring", "hier")},
              "time / model >= " + ", ".join(f"{m[a]['floor_over_model']} ({a})"
                                             for a in ("ring", "hier"))),
    ]
