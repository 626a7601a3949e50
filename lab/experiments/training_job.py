"""A training job with 3D parallelism: where its groups sit decides how long the GPUs wait.

A model too large for one GPU is split three ways (Megatron-LM's terms):
  tensor parallel (TP)    each layer's matrices over `tp` GPUs, which all-reduce their
                          partial activations several times per layer, forward and
                          backward: the chattiest traffic of the job
  pipeline parallel (PP)  the layers in `pp` stages: each stage sends its micro-batches'
                          activations to the next, and their gradients come back
  data parallel (DP)      `dp` replicas of the whole, each on its own data, all-reduce
                          their gradients once per step
and optionally a mixture of experts (MoE): the experts spread over each DP group's
GPUs, the tokens sent to them and back by all-to-all with unequal sizes (the gate
sends more to some experts than to others).

Every step, in lockstep over the whole job (compute and communication do not overlap
here, which real frameworks partly do):
  compute (`compute_ms`); `tp_allreduces` TP all-reduces, every TP group at once; the
  PP activations forward, then their gradients back (all micro-batches in one
  message per pair of stages); the MoE dispatch and combine; the DP all-reduce.
A group talks over its rack's scale-up links when all its GPUs sit in that rack, else
over the scale-out network (lab/fabric/gpus.innermost), as NCCL picks NVLink where it
can. The fabric runs ECN with DCQCN, as a RoCE fabric does. Variants:
  tp-in-rack   the GPUs numbered TP fastest, then DP, then PP (Megatron's order), rack
               by rack: every TP group inside a rack, on scale-up; PP and DP cross racks
  tp-across    the same job numbered DP fastest, then PP, then TP: every TP group
               across racks, on scale-out (a DP group in each rack instead)
  checkpoint   tp-in-rack, and in the middle step data-parallel replica 0's GPUs (which
               hold the whole model between them) write `checkpoint_kb` each to the
               storage hosts (the GPUs of the rack after the job's) as the DP
               all-reduce starts: the checkpoint competes with it on the same NICs
A job file (`--set job=FILE`, JSON or YAML: any of JOB_FIELDS) describes your own model;
docs/training-job.md maps a real model's sizes onto them.
"""
from __future__ import annotations

import json
import logging
import statistics
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import yaml

from lab.core.errors import UsageError
from lab.experiments import waits
from lab.experiments.base import Claim, RunContext
from lab.experiments.common import rc_params, traffic_timeout_s
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents, innermost

log = logging.getLogger(__name__)
NAME = "training-job"
DESCRIPTION = "a 3D-parallel training job: TP placed inside the rack vs across it, a checkpoint burst"
# 2 Mb/s scale-out NICs stand for 100 Gb/s, scale-up 9x (NVLink), as in rack-vs-scaleout;
# four racks of two GPUs hold the job (tp=2 x pp=2 x dp=2), a fifth the storage hosts
TOPOLOGY_DEFAULTS = {"rack": {"racks": 5, "gpus_per_rack": 2, "scaleout_rate_mbps": 2.0,
                              "fabric_rate_mbps": 8.0, "rate_scale": 50000}}
VARIANTS = ("tp-in-rack", "tp-across", "checkpoint")
# the GPUs' numbering, fastest-varying parallelism first (Megatron's rank order)
ORDERS = {"tp-in-rack": ("tp", "dp", "pp"), "tp-across": ("dp", "pp", "tp"),
          "checkpoint": ("tp", "dp", "pp")}
JOB_FIELDS = ("tp", "pp", "dp", "steps", "compute_ms", "tp_allreduce_kb", "tp_allreduces",
              "pp_activation_kb", "microbatches", "dp_grad_kb", "moe_alltoall_kb",
              "checkpoint_kb")
CHECKPOINT_IDS = 200          # the checkpoint's agents number their QPs apart (agent.qpn_for)
VARIANT_IDS = 60              # collective ids per variant (fresh agents: late frames miss)
CHECKPOINT_SLOWDOWN = 1.2     # claim: the DP all-reduce beside a checkpoint, over without
SCALED_SIZES = ("tp_allreduce_kb", "pp_activation_kb", "dp_grad_kb", "moe_alltoall_kb",
                "checkpoint_kb")
# flow ends busy at once at the defaults (8 GPUs' TP rings) (calibrate.py)
BUSY_ENDS = 16


@dataclass
class Params:
    topology: str = "rack"
    job: str = ""               # a JSON or YAML file of JOB_FIELDS: its values replace these
    tp: int = 2
    pp: int = 2
    dp: int = 2
    steps: int = 3
    compute_ms: float = 400.0   # per step, every GPU (no communication meanwhile)
    tp_allreduce_kb: int = 48   # per GPU, per TP all-reduce
    tp_allreduces: int = 4      # per step (per layer: 2 forward, 2 backward)
    pp_activation_kb: int = 8   # per micro-batch, each way between neighbouring stages
    microbatches: int = 2
    dp_grad_kb: int = 32        # per GPU: its share of the gradients, all-reduced per step
    moe_alltoall_kb: int = 0    # per GPU, each way (dispatch, combine); 0: no MoE
    checkpoint_kb: int = 96     # per writing GPU, in the checkpoint variant's middle step
    variants: str = ",".join(VARIANTS)
    transport: str = "rc"
    ecn: str = "auto"
    seed: int = 1

    def validate(self) -> None:
        if self.job:
            self._load(Path(self.job))
        bad = set(self.variant_list) - set(VARIANTS)
        if bad:
            raise UsageError(f"unknown training-job variant(s) {sorted(bad)}; choose from "
                             f"{', '.join(VARIANTS)}")
        if self.topology != "rack":
            raise UsageError("training-job needs topology=rack (scale-up domains)")
        if min(self.tp, self.pp, self.dp, self.steps, self.tp_allreduces,
               self.microbatches) < 1:
            raise UsageError("tp, pp, dp, steps, tp_allreduces and microbatches must be >= 1")
        if min(self.tp_allreduce_kb, self.pp_activation_kb, self.dp_grad_kb) <= 0 or \
                self.moe_alltoall_kb < 0 or self.checkpoint_kb <= 0 or self.compute_ms < 0:
            raise UsageError("sizes must be positive (moe_alltoall_kb 0: no MoE) and "
                             "compute_ms >= 0")
        if self.transport not in ("rc", "mrc"):
            raise UsageError("transport must be rc or mrc")

    def _load(self, path: Path) -> None:
        if not path.is_file():
            raise UsageError(f"job file {path} not found")
        text = path.read_text()
        try:
            spec = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") \
                else json.loads(text)
        except (ValueError, yaml.YAMLError) as e:
            raise UsageError(f"{path}: not a job description: {e}") from None
        if not isinstance(spec, dict):
            raise UsageError(f"{path}: a job is a mapping of {', '.join(JOB_FIELDS)}")
        unknown = set(spec) - set(JOB_FIELDS) - {"name", "about"}
        if unknown:
            raise UsageError(f"{path}: unknown job field(s) {sorted(unknown)}; a job has "
                             f"{', '.join(JOB_FIELDS)} (and a name, about)")
        types = {f.name: f.type for f in fields(self)}
        for key in JOB_FIELDS:
            if key in spec:
                cast = float if types[key] in (float, "float") else int
                setattr(self, key, cast(spec[key]))

    @property
    def variant_list(self) -> list[str]:
        return [v.strip() for v in self.variants.split(",") if v.strip()]

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass
class Layout:
    """Where the job's ranks sit: each group as a list of hosts, and its network."""
    tp: list[list[str]]
    pp: list[list[str]]          # each pipeline's stages in order
    dp: list[list[str]]

    def networks(self, fabric, kind: str) -> list[str]:
        return [innermost([fabric.host(h) for h in g]) for g in getattr(self, kind)]


def place(hosts: list[str], p: Params, order: tuple[str, str, str]) -> Layout:
    """Number the job's ranks over `hosts` (rack by rack) with the first of `order`
    varying fastest; group the hosts that differ only in one coordinate."""
    size = {"tp": p.tp, "pp": p.pp, "dp": p.dp}
    coord = {}
    for i, h in enumerate(hosts[:p.gpus]):
        c, rest = {}, i
        for dim in order:
            c[dim], rest = rest % size[dim], rest // size[dim]
        coord[h] = c

    def groups(dim: str) -> list[list[str]]:
        out: dict[tuple, list[str]] = {}
        for h, c in coord.items():
            key = tuple(c[d] for d in ("tp", "pp", "dp") if d != dim)
            out.setdefault(key, []).append(h)
        return [sorted(g, key=lambda h: coord[h][dim]) for _, g in sorted(out.items())]

    return Layout(groups("tp"), groups("pp"), groups("dp"))


def job_hosts(ctx: RunContext) -> tuple[list[str], list[str]]:
    """(the job's GPUs, rack by rack; the storage hosts: the rack after them)."""
    p = ctx.params
    by_rack: dict[int, list[str]] = {}
    for h in ctx.fabric.hosts:
        by_rack.setdefault(h.rack, []).append(h.name)
    ordered = [h for r in sorted(by_rack) for h in by_rack[r]]
    if len(ordered) < p.gpus:
        raise UsageError(f"the job needs tp x pp x dp = {p.gpus} GPUs; the fabric has "
                         f"{len(ordered)} (set racks and gpus_per_rack)")
    gpus = ordered[:p.gpus]
    spare = [r for r in sorted(by_rack) if not set(by_rack[r]) & set(gpus)]
    if "checkpoint" in p.variant_list and not spare:
        raise UsageError("the checkpoint variant writes to a rack the job leaves free: "
                         f"add one (racks={len(by_rack) + 1})")
    return gpus, (by_rack[spare[0]] if spare else [])


class Checkpoint:
    """Writers send their shard to the storage hosts (round robin), once, from agents of
    their own beside the job's: the same NICs, as a framework's checkpoint thread."""

    def __init__(self, ctx: RunContext, writers: list[str], storage: list[str], rc: dict):
        self.flows = [(w, storage[i % len(storage)], ctx.params.checkpoint_kb * 1024)
                      for i, w in enumerate(writers)]
        self.gpus = GpuAgents(ctx.net, hosts=[*storage, *writers],
                              first_collective_id=CHECKPOINT_IDS)
        rate = ctx.fabric.host(storage[0]).interface().rate_mbps
        per_storage = -(-len(writers) // len(storage))
        self.timeout_s = traffic_timeout_s(per_storage * ctx.params.checkpoint_kb * 1024, rate)
        self.rc, self.result, self.error = rc, None, None
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        t0 = time.monotonic()
        try:
            flows = self.gpus.transfers(self.flows, "rc", params=self.rc,
                                        timeout_s=self.timeout_s)
            self.result = {"time_s": round(time.monotonic() - t0, 4),
                           "intact": all(f["intact"] for f in flows),
                           # what the storage hosts' QPs placed (RC: in order, once),
                           # not the sizes asked for, which would match whatever arrived
                           "bytes": sum(f["receiver_counters"]["bytes_delivered"]
                                        for f in flows)}
        except Exception as e:   # reported in the metrics; the job goes on
            self.error = str(e)

    def start(self) -> None:
        self.thread.start()

    def close(self) -> None:
        self.thread.join(timeout=self.timeout_s + 30)
        self.gpus.close()


def tensors(rng, groups: list[list[str]], kb: int) -> list[np.ndarray]:
    return [rng.standard_normal(kb * 256).astype(np.float32) for g in groups for _ in g]


def group_means_hold(groups: list[list[str]], data: list[np.ndarray], res) -> bool:
    """Every GPU of every group holds its group's mean."""
    i = 0
    for g in groups:
        mean = np.mean(np.stack(data[i:i + len(g)]), axis=0)
        if not all(np.allclose(r, mean, atol=1e-5 * len(g)) for r in res.results[i:i + len(g)]):
            return False
        i += len(g)
    return True


class Step:
    """One step's phases on the job's agents, each timed on the lab's clock."""

    def __init__(self, ctx: RunContext, gpus: GpuAgents, layout: Layout, rc: dict | None,
                 rng):
        self.ctx, self.gpus, self.layout, self.rc, self.rng = ctx, gpus, layout, rc, rng
        p = ctx.params
        self.timeout_s = traffic_timeout_s(
            2 * max(p.tp_allreduce_kb, p.dp_grad_kb, p.microbatches * p.pp_activation_kb,
                    p.moe_alltoall_kb) * 1024, ctx.fabric.hosts[0].interface().rate_mbps)
        self.phases: list[dict] = []
        self.correct = True

    def _rate_mbps(self, network: str) -> float:
        return self.ctx.fabric.hosts[0].interface(network).rate_mbps

    def _timed(self, name: str, fn) -> None:
        """Run one phase; record its wall time and what fn returns: the agents' elapsed
        time, the wire's (bandwidth term), the evidence (waits.evidence), more."""
        t0, t0_unix = time.monotonic(), time.time()
        elapsed_s, wire_s, ev, more = fn()
        wall_s = time.monotonic() - t0
        self.phases.append({"phase": name, "t0_unix": round(t0_unix, 4), "s": round(wall_s, 4),
                            "wire_s": round(wire_s, 4), "retransmitted": ev["retransmitted"],
                            "causes": waits.split(wall_s, elapsed_s, wire_s, ev),
                            "evidence": ev, **more})

    def allreduce(self, name: str, groups: list[list[str]], networks: list[str],
                  kb: int) -> None:
        def go():
            data = tensors(self.rng, groups, kb)
            res = self.gpus.allreduce(data, self.ctx.params.transport, op="mean",
                                      params=self.rc, timeout_s=self.timeout_s,
                                      groups=groups, networks=networks)
            self.correct &= group_means_hold(groups, data, res)
            wire_s = max(2 * (len(g) - 1) / len(g) * kb * 1024 * 8 / (self._rate_mbps(net) * 1e6)
                         for g, net in zip(groups, networks))
            slowest = min(self._rate_mbps(net) for net in networks)
            return (res.time_s, wire_s,
                    waits.evidence(res.counters, res.nic, res.evs, slowest), {})
        self._timed(name, go)

    def transfers(self, name: str, flows: list[tuple[str, str, int]],
                  groups: list[list[str]], networks: list[str]) -> None:
        def go():
            out = self.gpus.transfers(flows, self.ctx.params.transport, params=self.rc,
                                      timeout_s=self.timeout_s, groups=groups,
                                      networks=networks)
            self.correct &= all(f["intact"] for f in out)
            net = {h: n for g, n in zip(groups, networks) for h in g}
            sent: dict[str, int] = {}
            got: dict[str, int] = {}
            for src, dst, n in flows:
                sent[src] = sent.get(src, 0) + n
                got[dst] = got.get(dst, 0) + n
            # a GPU's NIC sends and receives at its line rate, each way on its own
            wire_s = max((max(sent.get(h, 0), got.get(h, 0)) * 8 / (self._rate_mbps(net[h]) * 1e6)
                          for h in net), default=0.0)
            elapsed_s = max((f["completion_s"] or 0.0 for f in out), default=0.0)
            slowest = min(self._rate_mbps(n) for n in networks)
            return (elapsed_s, wire_s, waits.flows_evidence(out, slowest),
                    {"flow_bytes": [n for _, _, n in flows]})
        self._timed(name, go)

    def run(self, checkpoint: Checkpoint | None = None) -> dict:
        p, lay, fab = self.ctx.params, self.layout, self.ctx.fabric
        t0, t0_unix = time.monotonic(), time.time()
        time.sleep(p.compute_ms / 1000)                 # every GPU computes
        self.phases.append({"phase": "compute", "t0_unix": round(t0_unix, 4),
                            "s": round(time.monotonic() - t0, 4), "retransmitted": 0})
        for k in range(p.tp_allreduces):
            self.allreduce(f"tp{k}", lay.tp, lay.networks(fab, "tp"), p.tp_allreduce_kb)
        if p.pp > 1:
            pp_net = lay.networks(fab, "pp")
            nbytes = p.microbatches * p.pp_activation_kb * 1024
            for name, way in (("pp-forward", 1), ("pp-backward", -1)):
                flows = [(g[s], g[s + way], nbytes) for g in lay.pp
                         for s in range(len(g)) if 0 <= s + way < len(g)]
                self.transfers(name, flows, lay.pp, pp_net)
        if p.moe_alltoall_kb and p.dp > 1:
            sizes = self._moe_sizes(lay.dp)
            dp_net = lay.networks(fab, "dp")
            self.transfers("moe-dispatch", sizes, lay.dp, dp_net)
            self.transfers("moe-combine", [(b, a, n) for a, b, n in sizes], lay.dp, dp_net)
        if p.dp > 1:
            if checkpoint is not None:
                checkpoint.start()
            self.allreduce("dp", lay.dp, lay.networks(fab, "dp"), p.dp_grad_kb)
        step_s = time.monotonic() - t0
        why = waits.total(self.phases)
        return {"step_s": round(step_s, 4), "t0_unix": round(t0_unix, 4),
                "phases": self.phases, "correct": self.correct,
                "idle_fraction": round(1 - p.compute_ms / 1000 / step_s, 4),
                "wait_causes": why["causes"], "wait_evidence": why["evidence"],
                "waited_most_on": why["main"],
                "checkpoint": checkpoint is not None}

    def _moe_sizes(self, groups: list[list[str]]) -> list[tuple[str, str, int]]:
        """Each GPU's tokens to every other expert of its group: a gate's unequal
        shares (Dirichlet) of `moe_alltoall_kb` (what stays local is not sent)."""
        total = self.ctx.params.moe_alltoall_kb * 1024
        flows = []
        for g in groups:
            for a in g:
                shares = self.rng.dirichlet(np.ones(len(g)))
                flows += [(a, b, int(total * s)) for b, s in zip(g, shares)
                          if b != a and int(total * s) > 0]
        return flows


def phase_totals(steps: list[dict]) -> dict[str, float]:
    """Mean seconds per step in each kind of phase (the TP all-reduces summed)."""
    out: dict[str, float] = {}
    for s in steps:
        for ph in s["phases"]:
            kind = "tp" if ph["phase"].startswith("tp") else ph["phase"]
            out[kind] = out.get(kind, 0.0) + ph["s"] / len(steps)
    return {k: round(v, 4) for k, v in out.items()}


def model_s(p: Params, layout: Layout, fabric) -> dict[str, float]:
    """The phases' bandwidth terms (alpha-beta: a ring all-reduce 2(n-1)/n S/B, a
    message S/B) on each group's network: what the placement alone predicts."""
    host = fabric.hosts[0]
    rate = {"scale-out": host.interface().rate_mbps * 1e6}
    up = next((i for i in host.interfaces if i.network == "scale-up"), None)
    if up is not None:
        rate["scale-up"] = up.rate_mbps * 1e6

    def ring(kind: str, kb: int, n: int) -> float:
        net = "scale-out" if "scale-out" in layout.networks(fabric, kind) else "scale-up"
        return 2 * (n - 1) / n * kb * 1024 * 8 / rate[net] if n > 1 else 0.0

    out = {"compute": p.compute_ms / 1000,
           "tp": p.tp_allreduces * ring("tp", p.tp_allreduce_kb, p.tp),
           "dp": ring("dp", p.dp_grad_kb, p.dp)}
    if p.pp > 1:
        net = "scale-out" if "scale-out" in layout.networks(fabric, "pp") else "scale-up"
        out["pp"] = 2 * p.microbatches * p.pp_activation_kb * 1024 * 8 / rate[net]
    if p.moe_alltoall_kb and p.dp > 1:
        net = "scale-out" if "scale-out" in layout.networks(fabric, "dp") else "scale-up"
        out["moe"] = 2 * p.moe_alltoall_kb * 1024 * (p.dp - 1) / p.dp * 8 / rate[net]
    out["step"] = sum(out.values())
    return {k: round(v, 4) for k, v in out.items()}


def run(ctx: RunContext) -> dict:
    p = ctx.params
    hosts, storage = job_hosts(ctx)
    rate = ctx.fabric.host(hosts[0]).interface().rate_mbps
    cc = CongestionParams()
    ctx.net.set_congestion(CongestionParams(ecn=p.ecn))
    rc = rc_params(ctx.net, rate, cc.kmax_kb) if p.transport == "rc" else None
    rng = np.random.default_rng(p.seed)
    out = {"job": {k: getattr(p, k) for k in JOB_FIELDS}, "gpus": hosts, "storage": storage}
    cpu_bound: set[str] = set()
    for i, variant in enumerate(p.variant_list):
        layout = place(hosts, p, ORDERS[variant])
        nets = {k: sorted(set(layout.networks(ctx.fabric, k))) for k in ("tp", "pp", "dp")}
        log.info(f"{variant}: TP groups {layout.tp} over {'/'.join(nets['tp'])}, DP over "
                 f"{'/'.join(nets['dp'])}, PP over {'/'.join(nets['pp'])}; {p.steps} steps")
        mid = p.steps // 2 if variant == "checkpoint" else None
        writers = [h for g in layout.dp for h in g[:1]]     # data-parallel replica 0
        ckpt = Checkpoint(ctx, writers, storage, rc or {}) if mid is not None else None
        steps = []
        try:
            with GpuAgents(ctx.net, hosts=hosts,
                           first_collective_id=1 + i * VARIANT_IDS) as gpus:
                for s in range(p.steps):
                    steps.append(Step(ctx, gpus, layout, rc, rng).run(
                        ckpt if s == mid else None))
                    log.info(f"  step {s}: {steps[-1]['step_s'] * 1e3:.0f} ms, GPU idle "
                             f"{steps[-1]['idle_fraction']:.0%}, beyond the wire: mostly "
                             f"{steps[-1]['waited_most_on']}" +
                             (" (checkpoint written beside the DP all-reduce)"
                              if s == mid else ""))
                cpu_bound.update(gpus.cpu_bound())
        finally:
            if ckpt is not None:
                ckpt.close()
        m = {"layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp},
             "networks": nets, "steps": steps, "model_s": model_s(p, layout, ctx.fabric),
             "step_s_mean": round(statistics.mean(s["step_s"] for s in steps), 4),
             "idle_fraction_mean": round(statistics.mean(s["idle_fraction"] for s in steps), 4),
             "phase_s_mean": phase_totals(steps),
             "wait_causes_mean": waits.mean_causes(steps),
             "retransmitted_packets": sum(ph["retransmitted"] for s in steps
                                          for ph in s["phases"]),
             "all_correct": all(s["correct"] for s in steps)}
        if ckpt is not None:
            m["checkpoint"] = {"step": mid, "writers": writers, "storage": storage,
                               **(ckpt.result or {"error": ckpt.error})}
        out[variant] = m
        log.info(f"  mean step {m['step_s_mean'] * 1e3:.0f} ms (model "
                 f"{m['model_s']['step'] * 1e3:.0f} ms), GPU idle "
                 f"{m['idle_fraction_mean']:.0%}")
    out["cpu_bound_hosts"] = sorted(cpu_bound)
    ctx.net.set_congestion(CongestionParams())
    return out


def dp_seconds(m: dict, checkpoint: bool) -> list[float]:
    """The DP all-reduce's time in each step with (or without) the checkpoint beside it."""
    return [ph["s"] for s in m["steps"] if s["checkpoint"] == checkpoint
            for ph in s["phases"] if ph["phase"] == "dp"]


def claims(params: Params, m: dict) -> list[Claim]:
    ran = [v for v in params.variant_list if v in m]
    out = [Claim("every group's all-reduce holds its mean and every message arrives intact, "
                 "every step, every variant", all(m[v]["all_correct"] for v in ran),
                 {v: m[v]["all_correct"] for v in ran}, "all True")]
    if "tp-in-rack" in ran and "tp-across" in ran:
        a, b = m["tp-in-rack"], m["tp-across"]
        out.append(Claim("TP inside the rack (scale-up) makes shorter steps than TP across "
                         "racks (scale-out): the chattiest traffic belongs on the innermost "
                         "tier", a["step_s_mean"] < b["step_s_mean"],
                         f"in rack {a['step_s_mean']:.3f} s (GPU idle "
                         f"{a['idle_fraction_mean']:.0%})",
                         f"< across {b['step_s_mean']:.3f} s (GPU idle "
                         f"{b['idle_fraction_mean']:.0%})", timing=True))
    if "checkpoint" in ran:
        ckpt = m["checkpoint"]["checkpoint"]
        want = len(ckpt["writers"]) * params.checkpoint_kb * 1024
        written = "error" not in ckpt
        out.append(Claim("checkpoint: every writer's shard reached storage whole and intact "
                         "(CRC-32 end to end)",
                         written and ckpt["intact"] is True and ckpt["bytes"] == want,
                         {"bytes": ckpt.get("bytes"), "intact": ckpt.get("intact")}
                         if written else f"the write failed: {ckpt['error']}",
                         f"{want} bytes, intact", "bytes"))
        with_ckpt = dp_seconds(m["checkpoint"], True) if written else []
        without = dp_seconds(m["checkpoint"], False) + \
            (dp_seconds(m["tp-in-rack"], False) if "tp-in-rack" in m else [])
        base = statistics.median(without) if without else float("nan")
        # (a write that failed slowed nothing it can be credited with: the claim fails)
        out.append(Claim(f"checkpoint: written beside the DP all-reduce, it slows it (by "
                         f"{CHECKPOINT_SLOWDOWN}x at least)",
                         bool(with_ckpt) and min(with_ckpt) >= CHECKPOINT_SLOWDOWN * base,
                         f"{min(with_ckpt, default=float('nan')):.3f} s" if written
                         else "no checkpoint was written",
                         f">= {CHECKPOINT_SLOWDOWN} x {base:.3f} s (the steps without)",
                         timing=True))
    return out
