"""How fast this machine can emulate: the highest link rate at which a GPU host keeps up,
and the scale the lab's experiments run at because of it.

A GPU host is a Python agent; above some link rate it cannot send and receive fast
enough and an experiment's timings stop being faithful. `measure()` finds that rate
(one MRC flow between two hosts, rate after rate: a host keeps up while its goodput
is at least KEEPS_UP_FRACTION of the line and its CPU below CPU_BOUND_FRACTION), and
`fabriclab calibrate` stores it per machine.

The experiments' default rates and sizes were chosen on a machine whose hosts keep up
with REFERENCE_KEEP_UP_MBPS (they put up to nine agents at 10 Mb/s on two cores). On a
slower machine (a software-emulated CPU, a busy laptop) a calibration's `factor` is
below 1 and the runner scales those defaults down by it: link rates (rate_scale up, so a link
still stands for the same real rate) and message sizes (so a run takes as long), never
what the user sets.
"""
from __future__ import annotations

import json
import logging
import os
import platform
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
FLOW_SECONDS = 1.0
SIZE_FACTOR_FLOOR = 0.25           # messages shrink no further: a few packets say little
REFINE_STEPS = 2                   # between the sweep's last rate kept and first missed
MIN_FACTOR = 0.05                  # a machine that keeps up with nothing tried: rates / 20


@dataclass
class Calibration:
    keep_up_mbps: float            # 0: not even the lowest rate tried
    machine: dict                  # what it was measured on
    sweep: list[dict]              # per rate: goodput, CPU, verdict
    measured: str

    @property
    def factor(self) -> float:
        return max(MIN_FACTOR, min(1.0, self.keep_up_mbps / REFERENCE_KEEP_UP_MBPS))


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


def two_hosts(rate_mbps: float):
    from topologies.registry import build_topo
    return build_topo("leaf-spine", spines=1, leaves=2, hosts_per_leaf=1,
                      host_rate_mbps=rate_mbps, fabric_rate_mbps=rate_mbps)


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


def flow(net, transport: str, nbytes: int) -> dict:
    """One flow g0 -> g1 on a running FabricNetwork: goodput and the sender's CPU."""
    from lab.fabric.gpus import GpuAgents
    with GpuAgents(net, hosts=["g0", "g1"]) as gpus:
        [f] = gpus.transfers([("g0", "g1", nbytes)], transport)
        _, cpu_s, elapsed_s = next(c for c in reversed(gpus.cpu) if c[0] == "g0")
    goodput = steady_goodput_mbps(f["receiver_samples"], nbytes, f["completion_s"])
    return {"goodput_mbps": goodput, "intact": f["intact"],
            "packets": f["counters"]["sent"], "cpu_s": cpu_s,
            "cpu_fraction": cpu_s / elapsed_s if elapsed_s else 1.0}


def keeps_up(rate_mbps: float, r: dict) -> bool:
    from lab.fabric.gpus import CPU_BOUND_FRACTION
    return (r["goodput_mbps"] >= KEEPS_UP_FRACTION * rate_mbps
            and r["cpu_fraction"] < CPU_BOUND_FRACTION and r["intact"] is not False)


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


def measure(rates: tuple[float, ...] = SWEEP_MBPS) -> Calibration:
    """Rate after rate until a host falls behind (search)."""
    from lab.fabric.network import FabricNetwork
    sweep = []
    with tempfile.TemporaryDirectory(prefix="fabriclab-calibrate-") as tmp:
        def keeps_up_at(rate: float) -> bool:
            with FabricNetwork(two_hosts(rate), Path(tmp) / f"r{rate:g}") as net:
                # one MRC message, so no more packets than its header can count
                r = flow(net, "mrc", min(int(rate * 1e6 / 8 * FLOW_SECONDS),
                                         MRC_MAX_PACKETS_PER_MESSAGE * DEFAULT_MTU_BYTES))
            ok = keeps_up(rate, r)
            sweep.append({"rate_mbps": rate, **{k: round(v, 3) if isinstance(v, float) else v
                                                for k, v in r.items()}, "keeps_up": ok})
            log.info(f"{rate:6g} Mb/s: goodput {r['goodput_mbps']:.1f} Mb/s, sender CPU "
                     f"{r['cpu_fraction']:.0%}: {'keeps up' if ok else 'falls behind'}")
            return ok
        best = search(rates, keeps_up_at)
    return Calibration(best, machine(), sweep, time.strftime("%Y-%m-%d %H:%M:%S"))


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
