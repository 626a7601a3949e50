"""The lab's fabric and traffic handed to htsim at a size no emulation here reaches.

A 1024-GPU leaf-spine (32 leaves of 32 GPUs, 32 spines: no oversubscription), described
by the lab's own topology builder (topologies/registry.py, the same one `fabriclab run`
uses) with the lab's rates (10 Mb/s standing for 100 Gb/s), exported to htsim's files by
topologies/htsim.py (as `fabriclab htsim-export` does), and run by htsim's drivers with
the mechanisms bench/htsim_compare.py checks against the lab at small size:
  incast       `--senders` GPUs x `--size-kb` into one (the lab's incast, scaled up)
  permutation  every GPU sends `--size-kb` to one other, every GPU receives once
               (a random cycle through all: topologies/htsim.permutation_flows)
for RoCE with PFC and ECMP (the lab's RC+PFC), NDP sprayed (MRC with trimming) and
EQDS sprayed (MRC with receiver credit, UET's). Per run: the last completion over the
ideal (bench/htsim_compare.ideal_s: the most loaded link's frames at its rate), the
median flow's, and htsim's own run time. The small-size check of the same export is
bench/htsim_compare.py (docs/htsim.md).

    .venv/bin/python bench/htsim_scale.py --htsim-src /var/tmp/htsim/src [--keep DIR]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from htsim_compare import (DEFAULT_MTU_BYTES, EQDS_MTU_BYTES, HEADER_BYTES,  # noqa: E402
                           CaseInput, find_htsim, ideal_s, ndp_window_args, roce_pfc_args,
                           run_htsim)
from lab.kernel.queues import QueueParams  # noqa: E402
from topologies import htsim  # noqa: E402
from topologies.registry import build_topo  # noqa: E402

SHAPE = {"spines": 32, "leaves": 32, "hosts_per_leaf": 32, "host_rate_mbps": 10.0,
         "fabric_rate_mbps": 10.0, "rate_scale": 10000}
SPRAY_PATHS = 256           # sprayed flows: path values per flow (htsim_compare's explicit)
# htsim's NDP driver leaves an incast's flows unfinished above this many senders (measured
# on this build, 1 KB packets, 64-packet queues: 40 senders all done in 4.2 ms, 48: 1 of
# 48 done in 400 ms, 63: none): the bench says so instead of running it
NDP_INCAST_MAX_SENDERS = 40


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--htsim-src", type=Path, help="a built checkout of csg-htsim")
    ap.add_argument("--senders", type=int, default=32)
    ap.add_argument("--size-kb", type=int, default=1200, help="per flow (the lab's incast's)")
    ap.add_argument("--traffic", default=",".join(htsim.TRAFFIC))
    ap.add_argument("--keep", type=Path, help="keep each run's files and output here")
    a = ap.parse_args()
    src = find_htsim(a.htsim_src)
    fabric = build_topo("leaf-spine", **SHAPE).fabric
    buffer_bytes = QueueParams().buffer_kb * 1024
    size = a.size_kb * 1024
    flows = {"incast": htsim.incast_flows(fabric, a.senders, size),
             "permutation": htsim.permutation_flows(fabric, size)}
    print(f"{len(fabric.hosts)} GPUs: {htsim.leaf_spine_shape(fabric)}", flush=True)
    rows = []
    for traffic in a.traffic.split(","):
        case = CaseInput(traffic, fabric, flows[traffic], buffer_bytes, "bench/htsim_scale.py")
        spray = ["-strat", "ecmp_host", "-paths", str(SPRAY_PATHS)]
        for driver, mechanism, extra, mtu in (
                ("htsim_roce", "RoCE+PFC, ECMP (the lab's RC+PFC)", roce_pfc_args(),
                 DEFAULT_MTU_BYTES),
                ("htsim_ndp", "NDP sprayed (MRC, trimming)",
                 spray + ndp_window_args(case, htsim.LINK_LATENCY_NS), DEFAULT_MTU_BYTES),
                ("htsim_eqds", "EQDS sprayed (MRC, receiver credit)", spray, EQDS_MTU_BYTES)):
            if driver == "htsim_ndp" and traffic == "incast" and \
                    a.senders > NDP_INCAST_MAX_SENDERS:
                print(f"  {traffic} {driver}: not run: htsim's NDP leaves an incast of more "
                      f"than {NDP_INCAST_MAX_SENDERS} senders unfinished", flush=True)
                continue
            t0 = time.monotonic()
            r = run_htsim(src, driver, case, extra, mtu, buffer_bytes // mtu, 1,
                          htsim.LINK_LATENCY_NS, a.keep)
            wall = time.monotonic() - t0
            payload = mtu - HEADER_BYTES if driver == "htsim_eqds" else mtu
            ideal_us = ideal_s(fabric, case.flows, payload, HEADER_BYTES, real=True) * 1e6
            done = sorted(t for v in r.completions_us.values() for t in v)
            rows.append((traffic, len(case.flows), mechanism, done[-1] / ideal_us,
                         statistics.median(done) / ideal_us, done[-1], wall))
            print(f"  {traffic} {driver}: last {done[-1]:.0f} us ({done[-1] / ideal_us:.2f} "
                  f"of the ideal), htsim ran {wall:.1f} s", flush=True)
    print(f"\n{'traffic':<12} {'flows':>5}  {'mechanism':<38} {'last/ideal':>10} "
          f"{'median/ideal':>12} {'last us':>9} {'htsim s':>8}")
    for traffic, n, mech, last, median, last_us, wall in rows:
        print(f"{traffic:<12} {n:>5}  {mech:<38} {last:>10.2f} {median:>12.2f} "
              f"{last_us:>9.0f} {wall:>8.1f}")


if __name__ == "__main__":
    main()
