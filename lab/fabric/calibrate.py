"""How fast this machine can emulate: the highest link rate at which its GPU hosts keep
up, and the scale the lab's experiments run at because of it.

A GPU host is a Python agent; above some link rate it cannot send and receive fast
enough and an experiment's timings stop being faithful. `measure()` finds that rate
twice: for one MRC flow between two hosts (a host keeps up while its goodput is at
least KEEPS_UP_FRACTION of the line and its CPU below CPU_BOUND_FRACTION), and for
BUSY_PAIRS flows at once between 2 x BUSY_PAIRS hosts (every flow keeps up and the
machine's CPUs stay below MACHINE_BUSY_LIMIT). `fabriclab calibrate` stores both per
machine.

Two measurements because an agent's cost is not only per packet: on a software CPU
(the lab VM under TCG) an agent costs ~0.15 of a CPU at 0.5 Mb/s, and 8 busy agents
filled both CPUs at 2 Mb/s each while one pair kept up with 14 Mb/s. Scaled by the pair
alone, the experiments that keep 8 hosts busy ran CPU-starved there.

The experiments' default rates and sizes were chosen on a machine whose pair keeps up
with 2 x REFERENCE_KEEP_UP_MBPS and whose 4 pairs keep up with REFERENCE_BUSY_KEEP_UP_MBPS
(they put up to nine agents at 10 Mb/s on two cores). On a slower machine the runner
scales those defaults down by the factor for the flow ends an experiment keeps busy at
once (its BUSY_ENDS, `factor_for`): link rates (rate_scale up, so a link still stands for the
same real rate) and message sizes (so a run takes as long), never what the user sets.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.core import paths
from traffic.constants import DEFAULT_MTU_BYTES, MRC_MAX_PACKETS_PER_MESSAGE

log = logging.getLogger(__name__)

# (the fabric and the agents are imported where a measurement needs them: `doctor` reads
# a calibration on machines where Mininet is still missing)

KEEPS_UP_FRACTION = 0.8
REFERENCE_KEEP_UP_MBPS = 50.0      # this machine keeps up with 100 (bench/transport.py)
SWEEP_MBPS = (5.0, 10.0, 20.0, 50.0, 100.0, 200.0)
# 4 pairs: 8 busy hosts, the most a default experiment keeps sending at once. Here, at
# the defaults' 10 Mb/s, they keep the machine 72% busy (at 20: 87%; at 40 they fall
# behind): a machine keeps up with a rate while they keep it under 80% busy, as here
# at the defaults, and the reference is what this machine keeps up with.
BUSY_PAIRS = 4
REFERENCE_BUSY_KEEP_UP_MBPS = 10.0
BUSY_SWEEP_MBPS = (1.25, 2.5, 5.0, 10.0)     # no further: the reference is reached
MACHINE_BUSY_LIMIT = 0.8
FLOW_SECONDS = 1.0
SIZE_FACTOR_FLOOR = 0.25           # messages shrink no further: a few packets say little
REFINE_STEPS = 2                   # between the sweep's last rate kept and first missed
MIN_FACTOR = 0.05                  # a machine that keeps up with nothing tried: rates / 20
# A step whose load (the sender's CPU share, or the machine's busy share) lands this near
# its limit is measured REPEATS times and the median decides: one reading of the 8-pair
# sweep at 10 Mb/s gave 80.2% against the 80% limit, and three calibrations in a row of
# one quiet machine gave x1.0, x0.84, x1.0.
NEAR_LIMIT = 0.05
REPEATS = 3
# A rate this machine's last calibration kept up with keeps that verdict until the load
# passes the limit by this much: a machine at its limit does not flip from run to run.
HYSTERESIS = 0.05


@dataclass
class Calibration:
    keep_up_mbps: float            # one pair (0: not even the lowest rate tried)
    busy_keep_up_mbps: float       # BUSY_PAIRS pairs at once
    machine: dict                  # what it was measured on
    sweep: list[dict]              # per rate: goodput, CPU, verdict
    busy_sweep: list[dict]
    measured: str

    @property
    def factor(self) -> float:
        """The link-rate factor for an experiment that keeps two hosts or fewer busy."""
        return max(MIN_FACTOR, min(1.0, self.keep_up_mbps / REFERENCE_KEEP_UP_MBPS))

    @property
    def busy_factor(self) -> float:
        """...and for one that keeps 2 x BUSY_PAIRS hosts or more busy (never above the
        pair's: more hosts never make a machine faster)."""
        return min(self.factor, max(MIN_FACTOR, min(
            1.0, self.busy_keep_up_mbps / REFERENCE_BUSY_KEEP_UP_MBPS)))

    def factor_for(self, busy_ends: int) -> float:
        """The factor for an experiment keeping `busy_ends` flow ends busy at once (a
        host sending at line rate is one end, receiving one more: base.busy_ends):
        geometric between the two measurements, the busy one's past its ends (the
        factor is this machine against the reference at the same load, which ran every
        default; it was measured no further)."""
        w = min(1.0, max(0.0, (busy_ends - 2) / (2 * BUSY_PAIRS - 2)))
        return round(self.factor * (self.busy_factor / self.factor) ** w, 4)


def machine() -> dict:
    """What a calibration holds for: the same CPU model, count and kernel."""
    model = ""
    try:
        model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                      if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "kernel": platform.release(),
            "host": platform.node()}


def two_leaves(rate_mbps: float, hosts_per_leaf: int = 1):
    from topologies.registry import build_topo
    # the spine's links carry every pair's flow: wide enough not to be the bottleneck
    return build_topo("leaf-spine", spines=1, leaves=2, hosts_per_leaf=hosts_per_leaf,
                      host_rate_mbps=rate_mbps, fabric_rate_mbps=rate_mbps * hosts_per_leaf)


def steady_goodput_mbps(samples: dict, nbytes: int, completion_s: float) -> float:
    """What the receiver took in per second between a tenth and nine tenths of the
    flow's bytes: its steady rate, without the start (agents and QPs getting ready) and
    the last answers, a fixed cost that a slow machine makes a fifth of a 1 s flow. The
    whole flow's rate where the samples are too few."""
    t, got = samples["t"], samples["delivered"]
    lo = next((i for i, n in enumerate(got) if n >= 0.1 * nbytes), None)
    hi = next((i for i, n in enumerate(got) if n >= 0.9 * nbytes), None)
    if lo is None or hi is None or t[hi] <= t[lo]:
        return nbytes * 8 / completion_s / 1e6
    return (got[hi] - got[lo]) * 8 / (t[hi] - t[lo]) / 1e6


def flow(net, transport: str, nbytes: int, pairs: int = 1) -> dict:
    """`pairs` flows at once on a running FabricNetwork of two leaves (`two_leaves`),
    the first `pairs` hosts of the first leaf each to its peer on the second (the other
    hosts run no agent): the slowest flow's goodput, the first sender's CPU, and how busy
    the machine's CPUs were."""
    from lab.fabric.gpus import GpuAgents
    leaves: dict[str, list[str]] = {}
    for h in net.fabric.hosts:
        leaves.setdefault(h.interface().switch, []).append(h.name)
    senders, receivers = (hosts[:pairs] for hosts in leaves.values())
    with GpuAgents(net, hosts=[*senders, *receivers]) as gpus:
        flows = gpus.transfers([(a, b, nbytes) for a, b in zip(senders, receivers)],
                               transport)
        _, cpu_s, elapsed_s = next(c for c in reversed(gpus.cpu) if c[0] == senders[0])
        busy = max(gpus.machine_busy, default=1.0)
    goodputs = [steady_goodput_mbps(f["receiver_samples"], nbytes, f["completion_s"])
                for f in flows]
    return {"goodput_mbps": min(goodputs), "intact": all(f["intact"] is not False
                                                         for f in flows),
            "packets": sum(f["counters"]["sent"] for f in flows), "cpu_s": cpu_s,
            "cpu_fraction": cpu_s / elapsed_s if elapsed_s else 1.0, "machine_busy": busy}


def load_limit(pairs: int) -> tuple[str, float]:
    """What a step's load is (its result's key) and its limit: the sender's CPU share for
    one pair, the machine's busy share for BUSY_PAIRS."""
    from lab.fabric.gpus import CPU_BOUND_FRACTION
    return ("cpu_fraction", CPU_BOUND_FRACTION) if pairs == 1 else \
        ("machine_busy", MACHINE_BUSY_LIMIT)


def keeps_up(rate_mbps: float, r: dict, pairs: int = 1, slack: float = 0.0) -> bool:
    """Its goodput at KEEPS_UP_FRACTION of the line at least, its load under the limit
    (+ slack: HYSTERESIS), every flow intact."""
    key, limit = load_limit(pairs)
    return (r["goodput_mbps"] >= KEEPS_UP_FRACTION * rate_mbps and r[key] < limit + slack
            and r["intact"] is not False)


def median_result(results: list[dict]) -> dict:
    """Several readings of one step as one: each number's median, intact only if every
    reading was."""
    out = dict(results[0])
    for k, v in out.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = statistics.median(r[k] for r in results)
    out["intact"] = all(r["intact"] is not False for r in results)
    return out


def decide(rate_mbps: float, measure, pairs: int, kept_before_mbps: float = 0.0
           ) -> tuple[bool, dict]:
    """Whether the hosts keep up with `rate_mbps`, from `measure()` (one step's result):
    read once, or REPEATS times where the load lands within NEAR_LIMIT of its limit (the
    median decides); a rate no higher than what this machine's last calibration kept up
    with (`kept_before_mbps`) is allowed HYSTERESIS over the limit. The result says how
    many readings it took ("readings") and the slack it was allowed."""
    key, limit = load_limit(pairs)
    results = [measure()]
    if abs(results[0][key] - limit) <= NEAR_LIMIT:
        results += [measure() for _ in range(REPEATS - 1)]
    r = median_result(results)
    slack = HYSTERESIS if kept_before_mbps and rate_mbps <= kept_before_mbps else 0.0
    return keeps_up(rate_mbps, r, pairs, slack), {**r, "readings": len(results),
                                                  "slack": slack}


def search(rates: tuple[float, ...], keeps_up_at) -> float:
    """The highest rate at which `keeps_up_at(rate)`: up the sweep until a rate falls
    behind (if the first does, halving below it, down to a quarter of it), then
    REFINE_STEPS times between that rate and the last that kept up (their geometric
    mean, to a tenth of a Mb/s). The sweep's steps are 2-2.5x apart: a machine between
    two of them would otherwise run every experiment up to that much slower than it
    can; and one step between them left a software CPU's calibration at 10 or 14.1
    Mb/s from run to run (its sender at 86-91% of a CPU at 14.1), two leave it within
    ~20%."""
    best, failed = 0.0, None
    for rate in rates:
        if not keeps_up_at(rate):
            failed = rate
            break
        best = rate
    if failed is None:
        return best
    while not best and failed / 2 >= rates[0] / 4:
        if keeps_up_at(failed / 2):
            best = failed / 2
        else:
            failed /= 2
    for _ in range(REFINE_STEPS if best else 0):
        mid = round((best * failed) ** 0.5, 1)
        if not best < mid < failed:
            break
        if keeps_up_at(mid):
            best = mid
        else:
            failed = mid
    return best


def retune(net, factor: float) -> None:
    """A running fabric's links at `factor` times their rates, in place: the fabric's
    record (which the GPU agents take their NICs' rates from), every link end's classes,
    gates and RED and the data path's link times. For measure()'s sweeps
    only: the controller keeps the build's view of the rates, which flows without
    congestion control never ask for. A build per rate took most of each step of a
    software CPU's calibration (10-20 s of 16-33)."""
    from lab.kernel import queues
    for ln in net.fabric.links:
        ln.rate_mbps *= factor
    for h in net.fabric.hosts:
        for intf in h.interfaces:
            intf.rate_mbps *= factor
    queues.set_link_rates(net.fabric, {h.name: h.pid for h in net.mininet.hosts},
                          net.queue_params)
    if net.dataplane is not None:
        net.dataplane.set_link_rates(net.fabric)


def measure(rates: tuple[float, ...] = SWEEP_MBPS,
            busy_rates: tuple[float, ...] = BUSY_SWEEP_MBPS) -> Calibration:
    """Rate after rate until a host falls behind (search): one pair, then BUSY_PAIRS,
    on one fabric of 2 x BUSY_PAIRS hosts whose links change rate between steps (retune):
    a fabric's build took 12-15 s of a software CPU's 56 s calibration."""
    from lab.fabric.network import FabricNetwork
    sweeps: dict[int, list[dict]] = {1: [], BUSY_PAIRS: []}
    before = load()         # this machine's last calibration: its verdicts hold (decide)
    kept_before = {1: before.keep_up_mbps if before else 0.0,
                   BUSY_PAIRS: before.busy_keep_up_mbps if before else 0.0}

    def nbytes(rate: float) -> int:
        # one MRC message, so no more packets than its header can count
        return min(int(rate * 1e6 / 8 * FLOW_SECONDS),
                   MRC_MAX_PACKETS_PER_MESSAGE * DEFAULT_MTU_BYTES)

    with tempfile.TemporaryDirectory(prefix="fabriclab-calibrate-") as tmp, \
            contextlib.ExitStack() as stack:
        built: dict = {}                    # the fabric, and its links' rate now

        def sweep(pairs: int, rates: tuple[float, ...]) -> float:
            def keeps_up_at(rate: float) -> bool:
                if not built:
                    built["net"] = stack.enter_context(FabricNetwork(
                        two_leaves(rate, BUSY_PAIRS), Path(tmp) / "fabric"))
                elif built["rate"] != rate:
                    retune(built["net"], rate / built["rate"])
                built["rate"] = rate
                ok, r = decide(rate, lambda: flow(built["net"], "mrc", nbytes(rate), pairs),
                               pairs, kept_before[pairs])
                sweeps[pairs].append({"rate_mbps": rate, **{
                    k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                    "keeps_up": ok})
                cpu = f"sender CPU {r['cpu_fraction']:.0%}" if pairs == 1 else \
                    f"machine {r['machine_busy']:.0%} busy"
                how = "" if r["readings"] == 1 else f" (median of {r['readings']} runs)"
                how += f" (the last calibration's rate: limit +{r['slack']:.0%})" \
                    if r["slack"] else ""
                log.info(f"{rate:6g} Mb/s x {pairs} flow{'s' if pairs > 1 else ''}: "
                         f"goodput {r['goodput_mbps']:.1f} Mb/s"
                         f"{' (slowest)' if pairs > 1 else ''}, {cpu}{how}: "
                         f"{'keeps up' if ok else 'falls behind'}")
                return ok
            return search(rates, keeps_up_at)
        best = sweep(1, rates)
        busy = sweep(BUSY_PAIRS, busy_rates)
    return Calibration(best, busy, machine(), sweeps[1], sweeps[BUSY_PAIRS],
                       time.strftime("%Y-%m-%d %H:%M:%S"))


def save(c: Calibration) -> Path:
    path = paths.calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(asdict(c), indent=1))
    tmp.replace(path)
    return path


def load() -> Calibration | None:
    """This machine's calibration, if one was measured on it."""
    try:
        c = Calibration(**json.loads(paths.calibration_file().read_text()))
    except (FileNotFoundError, json.JSONDecodeError, TypeError):
        return None
    return c if c.machine == machine() else None


def size_factor(factor: float) -> float:
    return max(factor, SIZE_FACTOR_FLOOR)


def time_stretch(factor: float) -> float:
    """How much longer a run's traffic takes at `factor`: sizes by size_factor over links
    slowed by factor (1 down to x0.25; x3.1 at 0.08)."""
    return size_factor(factor) / factor
