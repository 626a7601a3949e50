"""Four GPUs agree on 0.75, then ring vs tree on bigger tensors (the lab's Python API).

    sudo .venv/bin/python examples/allreduce_values.py [--out results/example-allreduce]

Builds a leaf-spine with four GPU hosts, all-reduces one value per host over RoCE
v2 packets, then 256 KB tensors with the ring and the tree algorithm, and checks
two claims from what it measured. The report (metrics.json, report.html) lands in
--out.
"""
import argparse

import numpy as np

from lab.api import Lab
from lab.core import console

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="results/example-allreduce")
out = ap.parse_args().out
console.attach()     # the lab's progress lines, as the CLI prints them

with Lab("leaf-spine", spines=2, leaves=2, hosts_per_leaf=2, out=out,
         name="example: all-reduce") as lab:
    r = lab.allreduce([0.7, 0.9, 0.6, 0.8])
    for host, v in r["per_host"].items():
        print(f"{host}: gave {v['gave']:g}, holds {v['holds']:g}")
    lab.check("every GPU host holds the mean", r["agree"],
              {h: v["holds"] for h, v in r["per_host"].items()}, "0.75 on every host")

    rng = np.random.default_rng(1)
    tensors = [rng.standard_normal(64 * 1024).astype(np.float32) for _ in lab.hosts]
    times = {}
    for algorithm in ("ring", "tree"):
        m = lab.allreduce(tensors, algorithm=algorithm)
        times[algorithm] = m["time_s"]
        lab.record(algorithm, {k: m[k] for k in ("time_s", "busbw_mbps", "busbw_over_link",
                                                 "retransmitted_packets", "max_abs_error")})
        print(f"{algorithm}: {m['time_s'] * 1000:.0f} ms, busbw {m['busbw_mbps']:.1f} Mb/s, "
              f"results agree: {m['agree']}")
        lab.check(f"{algorithm}: every host holds the numpy mean", m["agree"],
                  m["max_abs_error"], f"<= {m['tolerance']:.1e}")
print(f"report: {out}/report.html")
