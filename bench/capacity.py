"""The biggest traffic one machine carries: how many GPU hosts can run a ring all-reduce
at once before one is CPU-bound, and how many frames the switches forward then.

For each link rate (default: this machine's calibrated rate, from `fabriclab
calibrate`, and the experiments' 10 Mb/s) and each size N (--sizes): a non-blocking
leaf-spine of N GPU hosts on two leaves, a ring all-reduce of --size-kb per GPU over
all of them, three times. Per row: the slowest all-reduce over its bandwidth term
(2(n-1)/n S/B), the GPU hosts whose agent was CPU-bound (GpuAgents.cpu_bound: busy
over 90% of a collective, or the whole machine was), the whole machine's CPU, and the
frames the switches forwarded per second (every switch port's tx_packets, summed: one
per frame per hop; OVS's userspace datapath here, the kernel datapath in the lab VM).
The largest N that keeps up (no host CPU-bound, and the all-reduce within
KEEPS_UP_OVER_MODEL of its model: with more agents than cores, each agent's share of
a core can stay under the CPU-bound threshold while all of them fall behind) is the
answer for that rate.

    sudo .venv/bin/python bench/capacity.py [--rates calibrated,10] [--sizes 2,4,8,12,16]
"""
import argparse
import time
from pathlib import Path

import numpy as np

from lab.fabric import calibrate
from lab.fabric.gpus import GpuAgents, cpu_times
from lab.session import Session
from topologies.fabric import interface_name
from topologies.registry import build_topo

ROUNDS = 3
KEEPS_UP_OVER_MODEL = 1.25


def switch_tx_packets(fabric) -> int:
    switches = {s.name for s in fabric.switches}
    ports = [interface_name(node, port) for ln in fabric.links
             for node, port in ((ln.a, ln.a_port), (ln.b, ln.b_port)) if node in switches]
    return sum(int(Path(f"/sys/class/net/{p}/statistics/tx_packets").read_text())
               for p in ports)


def measure(n: int, rate_mbps: float, size_kb: int) -> dict:
    per_leaf = n // 2
    # non-blocking, and no uplink slower than a host's link (a flow is pinned to one)
    topo = build_topo("leaf-spine", spines=2, leaves=2, hosts_per_leaf=per_leaf,
                      host_rate_mbps=rate_mbps,
                      fabric_rate_mbps=rate_mbps * max(1.0, per_leaf / 2))
    rng = np.random.default_rng(1)
    with Session(topo, "bench/capacity.py") as s:
        with GpuAgents(s.net) as gpus:
            data = [rng.standard_normal(size_kb * 256).astype(np.float32) for _ in range(n)]
            gpus.allreduce(data, "rc")                      # warm: flows set up, agents hot
            tx0, (busy0, total0), t0 = switch_tx_packets(topo.fabric), cpu_times(), \
                time.monotonic()
            times = [gpus.allreduce(data, "rc").time_s for _ in range(ROUNDS)]
            elapsed = time.monotonic() - t0
            tx1, (busy1, total1) = switch_tx_packets(topo.fabric), cpu_times()
            bound = gpus.cpu_bound()
    model_s = 2 * (n - 1) / n * size_kb * 1024 * 8 / (rate_mbps * 1e6)
    return {"n": n, "rate": rate_mbps, "over_model": max(times) / model_s,
            "cpu_bound": bound, "machine_cpu": (busy1 - busy0) / max(1, total1 - total0),
            "frames_per_s": (tx1 - tx0) / elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="calibrated,10",
                    help="link rates in Mb/s; 'calibrated': this machine's keep-up rate")
    ap.add_argument("--sizes", default="2,4,8,12,16")
    ap.add_argument("--size-kb", type=int, default=256, help="per GPU, per all-reduce")
    a = ap.parse_args()
    rates = []
    for r in a.rates.split(","):
        if r == "calibrated":
            c = calibrate.load()
            if c is None:
                raise SystemExit("no calibration on this machine: run `fabriclab calibrate` "
                                 "(or give --rates in Mb/s)")
            rates.append(c.keep_up_mbps)
        else:
            rates.append(float(r))
    rows = []
    for rate in rates:
        for n in (int(x) for x in a.sizes.split(",")):
            row = measure(n, rate, a.size_kb)
            rows.append(row)
            print(f"  {rate:g} Mb/s, {n} hosts: {row['over_model']:.2f} x the model, "
                  f"{len(row['cpu_bound'])} CPU-bound, {row['frames_per_s']:.0f} frames/s "
                  f"forwarded", flush=True)
    print(f"\n{'Mb/s':>6} {'hosts':>5} {'time/model':>10} {'CPU-bound hosts':>15} "
          f"{'machine CPU':>11} {'switch frames/s':>15}")
    for r in rows:
        print(f"{r['rate']:>6g} {r['n']:>5} {r['over_model']:>10.2f} {len(r['cpu_bound']):>15} "
              f"{r['machine_cpu']:>11.0%} {r['frames_per_s']:>15.0f}")
    for rate in rates:
        ok = [r for r in rows if r["rate"] == rate and not r["cpu_bound"]
              and r["over_model"] <= KEEPS_UP_OVER_MODEL]
        best = max(ok, key=lambda r: r["n"], default=None)
        print(f"at {rate:g} Mb/s: " + (
            f"up to {best['n']} GPU hosts keep up (none CPU-bound, within "
            f"{KEEPS_UP_OVER_MODEL}x the model), the switches forwarding "
            f"{best['frames_per_s']:.0f} frames/s" if best else
            "no size kept up (a host CPU-bound, or the all-reduce over "
            f"{KEEPS_UP_OVER_MODEL}x its model)"))


if __name__ == "__main__":
    main()
