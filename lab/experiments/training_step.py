"""Training steps: compute, then an all-reduce of the gradients; the GPUs wait on the network.

Four GPU hosts, two on each of two leaves, all-reduce in a ring. Every step, each
GPU computes for `compute_ms` (modelled as time the network is not used), then
all-reduces `grad_kb` of float32 gradients; the step ends when every GPU has the
mean (each result is checked). The GPU idle fraction is the time spent waiting on
the all-reduce over the step time. Variants, one after another:
  clean        RC, the ring in leaf order (g0 -> g1 -> g4 -> g5 -> g0 on the default
               fabric): one ring flow leaves each leaf, so no two share an uplink
  incast       the same, while the other hosts send to one of the GPUs, together at
               80% of its link (background incast: with the ring's traffic into that
               GPU its port's queue fills and drops; go-back-N resends. At 100% and
               more the ring flow into it lost so much that go-back-N never finished)
  incast+ecn   the same, with ECN marking and DCQCN senders: the queue stays short
               and nothing is lost (but DCQCN slows the ring's flow into that GPU too)
  collision    RC, the ring crossing the leaves at every hop (g0 -> g4 -> g1 -> g5):
               two flows leave each leaf, each pinned to a spine by its UDP source
               port; in about half the steps (new QPs every step) they hash onto the
               same spine and share its uplink: an ECMP collision
  spray        MRC on the crossing ring: every packet on its own entropy value, so
               the two flows leaving a leaf use both spines
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from lab.core.errors import LabError, UsageError
from lab.experiments import waits
from lab.experiments.base import DROPS, RESENDS, Claim, Excuse, RunContext, excuses
from lab.experiments.common import SwitchDrops, rc_params, traffic_timeout_s
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents

log = logging.getLogger(__name__)
NAME = "training-step"
DESCRIPTION = "compute + all-reduce steps: GPU idle fraction clean, under incast, with ECN, colliding, sprayed"
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 2, "leaves": 2, "hosts_per_leaf": 4,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 10.0,
                                    "rate_scale": 10000}}
VARIANTS = ("clean", "incast", "incast+ecn", "collision", "spray")
BACKGROUND_FLOW_KB = 200     # each background sender's message, sent again and again
BACKGROUND_LOAD = 0.8        # the background senders' rates, together, over the GPU's link
BACKGROUND_COLLECTIVE_IDS = 128

SCALED_SIZES = ("grad_kb",)   # shrink with the link rates on a slow machine (calibrate.py)
# flow ends busy at once at the defaults (a ring over 4; an incast of 4 into 1)
BUSY_ENDS = 12

@dataclass
class Params:
    topology: str = "leaf-spine"
    steps: int = 6
    compute_ms: float = 200.0
    grad_kb: int = 128           # per GPU, all-reduced every step
    variants: str = ",".join(VARIANTS)
    ecn: str = "auto"            # the incast+ecn variant's marking: auto | red | bpf | controller
    seed: int = 1

    def validate(self) -> None:
        bad = set(self.variant_list) - set(VARIANTS)
        if bad:
            raise UsageError(f"unknown training-step variant(s) {sorted(bad)}; choose from "
                             f"{', '.join(VARIANTS)}")
        if self.topology != "leaf-spine":
            raise UsageError("training-step needs topology=leaf-spine (two leaves)")
        if self.steps < 1 or self.compute_ms < 0 or self.grad_kb <= 0:
            raise UsageError("need steps >= 1, compute_ms >= 0 and grad_kb > 0")

    @property
    def variant_list(self) -> list[str]:
        return [v.strip() for v in self.variants.split(",") if v.strip()]


def roles(ctx: RunContext) -> tuple[list[str], list[str], list[str], str]:
    """(the ring in leaf order; the ring crossing the leaves at every hop; the
    background senders; the GPU they blast)."""
    by_leaf: dict[str, list[str]] = {}
    for h in ctx.fabric.hosts:
        by_leaf.setdefault(h.interface().switch, []).append(h.name)
    left, right = (by_leaf[k] for k in sorted(by_leaf)[:2])
    if len(left) < 3 or len(right) < 3:
        raise UsageError("training-step needs two leaves with at least 3 hosts each "
                         "(hosts_per_leaf >= 3)")
    in_order = [left[0], left[1], right[0], right[1]]     # crosses each way once
    crossing = [left[0], right[0], left[1], right[1]]     # crosses at every hop
    background = [*left[2:], *right[2:]]
    return in_order, crossing, background, right[1]


class BackgroundIncast:
    """Other hosts send to one GPU, message after message, until stopped."""

    def __init__(self, ctx: RunContext, senders: list[str], target: str, rc: dict):
        # the target also runs a ring agent: these agents' QPs are numbered apart
        self.gpus = GpuAgents(ctx.net, hosts=[target, *senders],
                              first_collective_id=BACKGROUND_COLLECTIVE_IDS)
        self.target, self.senders, self.rc = target, senders, rc
        self.time_limit_s = traffic_timeout_s(len(senders) * BACKGROUND_FLOW_KB * 1024,
                                              ctx.fabric.host(target).interface().rate_mbps)
        self.stop = threading.Event()
        self.rounds, self.delivered_bytes, self.error = 0, 0, None
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while not self.stop.is_set():
                flows = self.gpus.transfers([(s, self.target, BACKGROUND_FLOW_KB * 1024)
                                             for s in self.senders], "rc", params=self.rc,
                                            timeout_s=self.time_limit_s, allow_timeout=True)
                self.delivered_bytes += sum(f["receiver_counters"]["bytes_delivered"]
                                            for f in flows)
                if any(f["completion_s"] is None for f in flows):
                    if not self.stop.is_set():
                        raise LabError(f"a round of the background incast outlasted its "
                                       f"{self.time_limit_s:.0f} s limit")
                else:
                    self.rounds += 1
        except Exception as e:   # reported in the metrics; the training loop goes on
            self.error = str(e)

    def __enter__(self) -> "BackgroundIncast":
        self.t0 = time.monotonic()
        self.thread.start()
        time.sleep(0.3)          # the queue is full before the first step
        return self

    def __exit__(self, *exc) -> None:
        # the round under way is stopped, not waited for (a round took 9 s of a slow
        # machine's links); a stop that comes as a round starts is missed: sent again
        self.stop.set()
        deadline = time.monotonic() + self.time_limit_s + 30   # its own limit ends it first
        while self.thread.is_alive() and time.monotonic() < deadline:
            self.gpus.stop()
            self.thread.join(timeout=1.0)
        self.elapsed_s = time.monotonic() - self.t0
        self.gpus.close()

    def load(self, rate_mbps: float) -> float:
        """What the senders delivered together, over the target's link rate."""
        return self.delivered_bytes * 8 / self.elapsed_s / (rate_mbps * 1e6)


def train(ctx: RunContext, gpus: GpuAgents, transport: str, rng, params: dict | None) -> dict:
    p = ctx.params
    n = len(gpus.hosts)
    elems = p.grad_kb * 1024 // 4
    rate_mbps = gpus.hosts[0].interface().rate_mbps
    steps = []
    drops = SwitchDrops(ctx.net, ctx.telemetry)
    # the all-reduce's bandwidth term: a ring sends each GPU's vector out twice, nearly
    # (reduce-scatter, all-gather)
    wire_s = 2 * (n - 1) / n * p.grad_kb * 1024 * 8 / (rate_mbps * 1e6)
    for s in range(p.steps):
        t0_unix = time.time()
        time.sleep(p.compute_ms / 1000)        # every GPU computes: the network is idle
        grads = [rng.standard_normal(elems).astype(np.float32) for _ in range(n)]
        comm_unix = time.time()
        res = gpus.allreduce(grads, transport, op="mean", params=params,
                             timeout_s=traffic_timeout_s(2 * p.grad_kb * 1024, rate_mbps))
        expected = np.mean(np.stack(grads), axis=0)
        ok = all(np.allclose(r, expected, atol=1e-5 * n) for r in res.results)
        comm_s = res.time_s
        step_s = p.compute_ms / 1000 + comm_s
        # the wait is the all-reduce's own time here (the lab's cost of a call is left out)
        ev = waits.evidence(res.counters, res.nic, res.evs, rate_mbps)
        why = waits.total([{"causes": waits.split(comm_s, comm_s, wire_s, ev), "evidence": ev}])
        steps.append({"step": s, "t0_unix": round(t0_unix, 4),
                      "phases": [{"phase": "compute", "t0_unix": round(t0_unix, 4),
                                  "s": p.compute_ms / 1000},
                                 {"phase": "allreduce", "t0_unix": round(comm_unix, 4),
                                  "s": round(comm_s, 4), "evidence": ev}],
                      "wait_causes": why["causes"], "wait_evidence": why["evidence"],
                      "waited_most_on": why["main"],
                      "allreduce_s": round(comm_s, 4), "step_s": round(step_s, 4),
                      "idle_fraction": round(comm_s / step_s, 4), "correct": ok,
                      "retransmitted": sum(c.get("retransmitted", 0) for per in res.counters
                                           for c in per.values()),
                      "timeouts": sum(c.get("timeouts", 0) for per in res.counters
                                      for c in per.values()),
                      "naks": sum(c.get("naks_sent", 0) for per in res.counters
                                  for c in per.values())})
        log.info(f"  step {s}: all-reduce {comm_s * 1e3:.0f} ms, GPU idle "
                 f"{comm_s / step_s:.0%}, beyond the wire: mostly {why['main']}")
    return {"steps": steps,
            "step_s_mean": round(statistics.mean(x["step_s"] for x in steps), 4),
            "allreduce_s_mean": round(statistics.mean(x["allreduce_s"] for x in steps), 4),
            "allreduce_s_max": max(x["allreduce_s"] for x in steps),
            "idle_fraction_mean": round(statistics.mean(x["idle_fraction"] for x in steps), 4),
            "wait_causes_mean": waits.mean_causes(steps),
            "retransmitted_packets": sum(x["retransmitted"] for x in steps),
            "timeouts": sum(x["timeouts"] for x in steps),
            "naks": sum(x["naks"] for x in steps),
            "switch_drops": drops.count(),     # RoCE data frames, every switch queue
            "lost_inside_switches": drops.inside(),   # ...and inside OVS (+-1 at the edges)
            "all_correct": all(x["correct"] for x in steps)}


def run(ctx: RunContext) -> dict:
    p = ctx.params
    in_order, crossing, background, victim = roles(ctx)
    rate = ctx.fabric.host(victim).interface().rate_mbps
    cc = CongestionParams()
    rc = rc_params(ctx.net, rate, cc.kmax_kb)
    out = {"ring": in_order, "crossing_ring": crossing, "background_senders": background,
           "incast_target": victim,
           "model_allreduce_s": round(2 * (len(in_order) - 1) / len(in_order) * p.grad_kb
                                      * 1024 * 8 / (rate * 1e6), 4)}
    rng = np.random.default_rng(p.seed)
    cpu_bound: set[str] = set()
    for i, variant in enumerate(p.variant_list):
        ring = crossing if variant in ("collision", "spray") else in_order
        log.info(f"{variant}: {p.steps} steps of {p.compute_ms:.0f} ms compute + "
                 f"all-reduce of {p.grad_kb} KB over the ring {' -> '.join(ring)}")
        ctx.net.set_congestion(CongestionParams(ecn=p.ecn if "ecn" in variant else "off"))
        transport = "mrc" if variant == "spray" else "rc"
        params = rc if transport == "rc" else None
        # fresh QP numbers per variant: a late packet of one never lands in the next
        with GpuAgents(ctx.net, hosts=ring, first_collective_id=1 + i * p.steps) as gpus:
            if variant.startswith("incast"):
                share = rate * BACKGROUND_LOAD / len(background)
                with BackgroundIncast(ctx, background, victim,
                                      {**rc, "line_rate_mbps": share}) as bg:
                    m = train(ctx, gpus, transport, rng, params)
                m["background_rounds"], m["background_error"] = bg.rounds, bg.error
                m["background_load"] = round(bg.load(rate), 3)   # asked: BACKGROUND_LOAD
            else:
                m = train(ctx, gpus, transport, rng, params)
            cpu_bound.update(gpus.cpu_bound())
        out[variant] = m
        log.info(f"  mean step {m['step_s_mean'] * 1e3:.0f} ms, all-reduce "
                 f"{m['allreduce_s_mean'] * 1e3:.0f} ms, GPU idle "
                 f"{m['idle_fraction_mean']:.0%}")
    out["cpu_bound_hosts"] = sorted(cpu_bound)
    out["starved"] = excuses(starved(out))
    ctx.net.set_congestion(CongestionParams())
    return out


def starved(m: dict) -> list[Excuse]:
    """What the machine's load did to the variants, where it shows: packets resent
    though no switch dropped one (a host stalled past its retransmit timer, or its
    receiver saw a gap it then filled), and a background incast too weak to drop."""
    out = []
    for v in VARIANTS:
        x = m.get(v)
        if x and x["retransmitted_packets"] and not x["switch_drops"]:
            out.append(Excuse(v, (RESENDS,),
                              f"{x['retransmitted_packets']} packets resent though no switch "
                              f"queue dropped one ({x['timeouts']} timeouts, {x['naks']} "
                              f"NAKs): frames lost or late outside the switches' queues (a "
                              f"stalled host, a kernel backlog under load), not the fabric's "
                              f"congestion"))
    x = m.get("incast")
    if x and not x["switch_drops"]:
        # named for the claim it defeats (incast+ecn's: ECN had no losses to remove)
        out.append(Excuse("incast+ecn", (DROPS,),
                          f"the background incast made no switch drop a frame: its senders "
                          f"delivered {x['background_load']:.0%} of the GPU's link (asked: "
                          f"{BACKGROUND_LOAD:.0%} beside the ring's flow), too little to "
                          f"overflow its port on this machine, so ECN had no losses to "
                          f"remove"))
    return out


def claims(params: Params, m: dict) -> list[Claim]:
    ran = [v for v in params.variant_list if v in m]
    idle = {v: m[v]["idle_fraction_mean"] for v in ran}
    out = [Claim("every GPU holds the mean after every step, every variant",
                 all(m[v]["all_correct"] for v in ran), {v: m[v]["all_correct"] for v in ran},
                 "all True")]
    if "clean" in idle and "incast" in idle:
        out.append(Claim("a background incast raises the GPU idle fraction",
                         idle["incast"] > idle["clean"],
                         f"incast {idle['incast']:.3f}", f"> clean {idle['clean']:.3f}",
                         timing=True))
    if "incast" in idle and "incast+ecn" in idle:
        # (the idle fraction under ECN is reported, not claimed: DCQCN slows the ring's
        # own flow into the congested GPU too; measured, it stayed at the incast's level)
        # (losses are the switches' drops; retransmissions, reported beside them, also
        # count resends a stalled host made of what had arrived)
        drops = {v: m[v]["switch_drops"] for v in ("incast", "incast+ecn")}
        retx = {v: m[v]["retransmitted_packets"] for v in ("incast", "incast+ecn")}
        out.append(Claim("incast+ecn: ECN (DCQCN) removes the losses the incast caused",
                         drops["incast"] > 0 and drops["incast+ecn"] == 0,
                         f"switch drops: incast+ecn {drops['incast+ecn']} (retransmitted "
                         f"{retx['incast+ecn']})",
                         f"== 0, where incast dropped {drops['incast']} > 0 (retransmitted "
                         f"{retx['incast']})", rests_on=(DROPS,)))
    if "collision" in idle and "spray" in idle:
        out.append(Claim("on the crossing ring, spraying (MRC) idles the GPUs less than RC's "
                         "pinned flows (which collide on a spine in some steps)",
                         idle["spray"] < idle["collision"],
                         f"spray {idle['spray']:.3f}", f"< collision (RC) "
                         f"{idle['collision']:.3f}", timing=True))
    return out
