"""Emulation fidelity: the lab's ring all-reduce against the alpha-beta model.

On one leaf-spine (4 GPU hosts, two per leaf, every link at --rate-mbps):
  alpha   the per-step latency, measured: a 4-byte all-reduce takes 2(n-1) steps
  model   T(S) = 2(n-1) alpha + 2(n-1)/n S / B     (B: the GPU link's rate)
  busbw   S / T * 2(n-1)/n, as nccl-tests reports it; / the link rate: goal >= 0.9
          (healthy clusters reach it). The RoCE headers alone cap it at the MTU's
          payload share of a frame, printed alongside.
and, with --tour, the tour's total time (goal < 10 min on 2 cores).

    sudo .venv/bin/python bench/fidelity.py [--rate-mbps 100] [--sizes-kb 64,256,1024,4096] [--tour]
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lab.api import Lab
from traffic.constants import DEFAULT_MTU_BYTES
from traffic.roce import WRITE_OVERHEAD_BYTES

BUSBW_GOAL = 0.9
TOUR_GOAL_S = 600
REPEATS = 3


def ring_times(lab: Lab, transport: str, nbytes: int) -> float:
    """The median of REPEATS ring all-reduces of `nbytes` per GPU (every result checked)."""
    rng = np.random.default_rng(nbytes)
    times = []
    for _ in range(REPEATS):
        tensors = [rng.standard_normal(max(1, nbytes // 4)).astype(np.float32)
                   for _ in lab.hosts]
        m = lab.allreduce(tensors, transport)
        if not m["agree"]:
            sys.exit(f"{transport} all-reduce of {nbytes} bytes: hosts disagree with numpy")
        times.append(m["time_s"])
    return statistics.median(times)


def tour_time() -> float:
    with tempfile.TemporaryDirectory(prefix="fabriclab-tour-") as tmp:
        subprocess.run([sys.executable, "-m", "lab", "tour", "--out", tmp], check=True,
                       stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "tour.json").read_text())["total_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-mbps", type=float, default=100)
    ap.add_argument("--sizes-kb", default="64,256,1024,4096")
    ap.add_argument("--tour", action="store_true", help="also time `fabriclab tour`")
    a = ap.parse_args()
    sizes = [int(float(s) * 1024) for s in a.sizes_kb.split(",")]
    link_bps = a.rate_mbps * 1e6
    ceiling = DEFAULT_MTU_BYTES / (DEFAULT_MTU_BYTES + WRITE_OVERHEAD_BYTES)
    rows = []
    with Lab("leaf-spine", spines=2, leaves=2, hosts_per_leaf=2, host_rate_mbps=a.rate_mbps,
             fabric_rate_mbps=a.rate_mbps) as lab:
        n = len(lab.hosts)
        for transport in ("rc", "mrc"):
            alpha = ring_times(lab, transport, 4) / (2 * (n - 1))
            for size in sizes:
                t = ring_times(lab, transport, size)
                model = 2 * (n - 1) * alpha + 2 * (n - 1) / n * size * 8 / link_bps
                busbw = size * 8 / t * 2 * (n - 1) / n
                rows.append((transport, alpha, size, t, model, busbw / link_bps))
                print(f"  {transport} {size // 1024} KB: {t * 1000:.1f} ms", flush=True)
    print(f"\nring all-reduce, {n} GPU hosts, {a.rate_mbps:.0f} Mb/s links; median of {REPEATS}")
    print(f"{'transport':>9} {'alpha ms':>9} {'size KB':>8} {'measured ms':>12} {'model ms':>9} "
          f"{'measured/model':>15} {'busbw/link':>11}")
    for transport, alpha, size, t, model, ratio in rows:
        print(f"{transport:>9} {alpha * 1000:>9.2f} {size // 1024:>8} {t * 1000:>12.1f} "
              f"{model * 1000:>9.1f} {t / model:>15.2f} {ratio:>11.2f}")
    best = max(r[5] for r in rows)
    print(f"\nbest busbw / link rate {best:.2f} (goal >= {BUSBW_GOAL}; RoCE's headers cap it at "
          f"{ceiling:.3f} with a {DEFAULT_MTU_BYTES} B MTU): "
          f"{'met' if best >= BUSBW_GOAL else 'MISSED'}")
    if a.tour:
        t0 = time.monotonic()
        total = tour_time()
        print(f"tour: {total:.0f} s of experiments, {time.monotonic() - t0:.0f} s in all "
              f"(goal < {TOUR_GOAL_S} s): {'met' if total < TOUR_GOAL_S else 'MISSED'}")


if __name__ == "__main__":
    main()
