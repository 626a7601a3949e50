"""Inference beside training: KV-cache transfers cross a fabric a training job loads.

Disaggregated inference computes a prompt's KV cache on a prefill server and moves it
to a decode server by RDMA WRITE, a few MB at a time, and a user waits for it: its
latency matters, not its throughput. Here a prefill host on leaf 0 sends `kv_kb` to a
decode host on leaf 1, `transfers` times, `gap_ms` apart, over the same spine uplink
as a training job's ring all-reduce (six GPUs crossing the leaves at every hop: three
of its flows on that uplink each way, looping `grad_kb` all-reduces). Variants:
  alone     the KV transfers with no training: their latency on an idle fabric
  shared    beside the training, in the RoCE class: one more flow in its queue, and
            DCQCN slows it with the others
  express   beside the training, in the fabric's express class (DSCP 34, its own
            queue served ahead of RoCE data: lab/kernel/queues.py), as an operator
            gives latency-bound traffic a traffic class of its own
The fabric runs ECN with DCQCN for the RoCE class, as a RoCE fabric does.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from lab.core.errors import UsageError
from lab.experiments.base import Claim, RunContext
from lab.experiments.common import rc_params, traffic_timeout_s
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents
from traffic.constants import DSCP_EXPRESS, DSCP_ROCE_DATA

log = logging.getLogger(__name__)
NAME = "kv-cache"
DESCRIPTION = "KV-cache transfers beside a training job: their latency alone, sharing the RoCE class, in an express class"
# one spine: every cross-leaf flow shares its uplinks (10 Mb/s stands for 100 Gb/s)
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 1, "leaves": 2, "hosts_per_leaf": 4,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 10.0,
                                    "rate_scale": 10000}}
QUEUE_DEFAULTS = {"express_class": 1}
VARIANTS = ("alone", "shared", "express")
SHARED_SLOWDOWN = 1.5        # claim: sharing the RoCE class, p50 latency at least this x alone
EXPRESS_WITHIN = 1.3         # claim: in the express class, p50 latency within this x alone
TRAINING_IDS = 128           # the training's agents number their QPs apart (agent.qpn_for)
VARIANT_IDS = 16             # each variant's KV QPs numbered apart too: a capture tells them
# apart (one collective id per transfer: transfers <= VARIANT_IDS)
SCALED_SIZES = ("kv_kb", "grad_kb")
# flow ends busy at once at the defaults (a 6-GPU ring, the KV pair) (calibrate.py)
BUSY_ENDS = 14


@dataclass
class Params:
    topology: str = "leaf-spine"
    kv_kb: int = 256            # per transfer: one request's KV cache, at the lab's scale
    transfers: int = 5          # per variant
    gap_ms: float = 200.0       # between transfers (one request after another)
    grad_kb: int = 512          # per GPU, each all-reduce of the training load
    variants: str = ",".join(VARIANTS)
    ecn: str = "auto"
    seed: int = 1

    def validate(self) -> None:
        bad = set(self.variant_list) - set(VARIANTS)
        if bad:
            raise UsageError(f"unknown kv-cache variant(s) {sorted(bad)}; choose from "
                             f"{', '.join(VARIANTS)}")
        if self.topology != "leaf-spine":
            raise UsageError("kv-cache needs topology=leaf-spine (two leaves)")
        if self.kv_kb <= 0 or self.grad_kb <= 0 or not 1 <= self.transfers <= VARIANT_IDS \
                or self.gap_ms < 0:
            raise UsageError(f"need kv_kb, grad_kb > 0, 1 <= transfers <= {VARIANT_IDS}, "
                             f"gap_ms >= 0")

    @property
    def variant_list(self) -> list[str]:
        return [v.strip() for v in self.variants.split(",") if v.strip()]


def roles(ctx: RunContext) -> tuple[list[str], str, str]:
    """(the training ring, crossing the leaves at every hop; the prefill host on leaf
    0; the decode host on leaf 1)."""
    by_leaf: dict[str, list[str]] = {}
    for h in ctx.fabric.hosts:
        by_leaf.setdefault(h.interface().switch, []).append(h.name)
    left, right = (by_leaf[k] for k in sorted(by_leaf)[:2])
    if len(left) < 4 or len(right) < 4:
        raise UsageError("kv-cache needs two leaves of 4 hosts or more (hosts_per_leaf >= 4)")
    ring = [h for pair in zip(left[:3], right[:3]) for h in pair]
    return ring, left[3], right[3]


class TrainingLoad:
    """The training job's traffic: ring all-reduces of `grad_kb`, one after another,
    until stopped; each result checked."""

    def __init__(self, ctx: RunContext, ring: list[str], rc: dict):
        self.ctx, self.rc = ctx, rc
        self.gpus = GpuAgents(ctx.net, hosts=ring, first_collective_id=TRAINING_IDS)
        rate = ctx.fabric.host(ring[0]).interface().rate_mbps
        self.timeout_s = traffic_timeout_s(2 * ctx.params.grad_kb * 1024 * 4, rate)
        self.rng = np.random.default_rng(ctx.params.seed)
        self.stop = threading.Event()
        self.times_s: list[float] = []
        self.correct, self.error = True, None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        n = len(self.gpus.hosts)
        try:
            while not self.stop.is_set():
                data = [self.rng.standard_normal(self.ctx.params.grad_kb * 256)
                        .astype(np.float32) for _ in range(n)]
                res = self.gpus.allreduce(data, "rc", op="mean", params=self.rc,
                                          timeout_s=self.timeout_s)
                mean = np.mean(np.stack(data), axis=0)
                self.correct &= all(np.allclose(r, mean, atol=1e-5 * n) for r in res.results)
                self.times_s.append(res.time_s)
        except Exception as e:   # reported in the metrics
            self.error = str(e)

    def __enter__(self) -> "TrainingLoad":
        self.thread.start()
        time.sleep(0.5)          # the all-reduce's flows are under way
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=self.timeout_s + 30)
        self.gpus.close()


def kv_transfers(ctx: RunContext, gpus: GpuAgents, prefill: str, decode: str,
                 params: dict) -> list[dict]:
    p = ctx.params
    rate = ctx.fabric.host(prefill).interface().rate_mbps
    out = []
    for _ in range(p.transfers):
        [f] = gpus.transfers([(prefill, decode, p.kv_kb * 1024)], "rc", params=params,
                             timeout_s=traffic_timeout_s(4 * p.kv_kb * 1024, rate))
        out.append({"latency_s": round(f["completion_s"], 4), "intact": f["intact"],
                    "retransmitted": f["counters"]["retransmitted"],
                    "cnps": f["counters"]["cnps_received"]})
        time.sleep(p.gap_ms / 1000)
    return out


def run(ctx: RunContext) -> dict:
    p = ctx.params
    if "express" in p.variant_list and not ctx.net.queue_params.express_class:
        raise UsageError("kv-cache needs the express class (--set express_class=1, its "
                         "default here)")
    ring, prefill, decode = roles(ctx)
    rate = ctx.fabric.host(prefill).interface().rate_mbps
    cc = CongestionParams()
    ctx.net.set_congestion(CongestionParams(ecn=p.ecn))
    rc = rc_params(ctx.net, rate, cc.kmax_kb)
    ideal_s = p.kv_kb * 1024 * 8 / (rate * 1e6)
    out = {"ring": ring, "prefill": prefill, "decode": decode, "kv_ideal_s": round(ideal_s, 4)}
    for i, variant in enumerate(p.variant_list):
        dscp = DSCP_EXPRESS if variant == "express" else DSCP_ROCE_DATA
        log.info(f"{variant}: {p.transfers} KV caches of {p.kv_kb} KB {prefill} -> {decode} "
                 f"(DSCP {dscp})" + ("" if variant == "alone" else
                                    f" beside ring all-reduces over {', '.join(ring)}"))
        with GpuAgents(ctx.net, hosts=[prefill, decode],
                       first_collective_id=1 + i * VARIANT_IDS) as kv:
            params = {**rc, "dscp": dscp}
            if variant == "alone":
                xfers, load = kv_transfers(ctx, kv, prefill, decode, params), None
            else:
                with TrainingLoad(ctx, ring, rc) as load:
                    xfers = kv_transfers(ctx, kv, prefill, decode, params)
        lat = [x["latency_s"] for x in xfers]
        m = {"dscp": dscp, "transfers": xfers, "latency_s_p50": round(statistics.median(lat), 4),
             "latency_s_max": max(lat), "latency_over_ideal_p50":
                 round(statistics.median(lat) / ideal_s, 3),
             "intact": all(x["intact"] for x in xfers),
             "retransmitted_packets": sum(x["retransmitted"] for x in xfers)}
        if load is not None:
            m.update({"training_allreduces": len(load.times_s), "training_correct":
                      load.correct and load.error is None, "training_error": load.error,
                      "training_allreduce_s_mean": round(statistics.mean(load.times_s), 4)
                      if load.times_s else None})
        out[variant] = m
        log.info(f"  KV latency p50 {m['latency_s_p50'] * 1e3:.0f} ms ({m['latency_over_ideal_p50']}"
                 f" x its time on an idle link), max {m['latency_s_max'] * 1e3:.0f} ms")
    ctx.net.set_congestion(CongestionParams())
    return out


def training_held(m: dict) -> bool:
    """A variant beside the training: at least one of its all-reduces finished, and
    every one held the mean (none ran: the load the KV caches shared never was)."""
    return m.get("training_allreduces", 0) > 0 and m.get("training_correct") is True


def claims(params: Params, m: dict) -> list[Claim]:
    ran = [v for v in params.variant_list if v in m]
    held = {v: m[v]["intact"] and (v == "alone" or training_held(m[v])) for v in ran}
    # what decided it, not only True/False: a training that never ran shows 0 all-reduces
    seen = {v: {"intact": m[v]["intact"]} if v == "alone" else
            {"intact": m[v]["intact"], "training_allreduces": m[v].get("training_allreduces"),
             "training_correct": m[v].get("training_correct")} for v in ran}
    out = [Claim("every KV cache arrived intact and, beside them, the training ran "
                 "all-reduces that held the mean",
                 all(held.values()), seen, "intact True every variant; beside the training, "
                 "training allreduces > 0 and training correct True")]
    p50 = {v: m[v]["latency_s_p50"] for v in ran}
    if "alone" in p50 and "shared" in p50:
        out.append(Claim(f"sharing the RoCE class with the training slows the KV caches (p50 "
                         f">= {SHARED_SLOWDOWN}x alone)",
                         p50["shared"] >= SHARED_SLOWDOWN * p50["alone"],
                         f"shared {p50['shared']:.3f} s",
                         f">= {SHARED_SLOWDOWN} x alone {p50['alone']:.3f} s"))
    if "alone" in p50 and "express" in p50:
        out.append(Claim(f"in the express class they move nearly as on an idle fabric (p50 "
                         f"<= {EXPRESS_WITHIN}x alone)",
                         p50["express"] <= EXPRESS_WITHIN * p50["alone"],
                         f"express {p50['express']:.3f} s",
                         f"<= {EXPRESS_WITHIN} x alone {p50['alone']:.3f} s"))
    return out
