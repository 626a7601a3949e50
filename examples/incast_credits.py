"""Incast, RC vs MRC: the receiver's credits tame it (the lab's Python API).

    sudo .venv/bin/python examples/incast_credits.py [--out results/example-incast]

Four GPU hosts send 300 KB each to a fifth over one switch, once with RC (no
congestion control: DCQCN needs ECN marks, and none are set here) and once with
MRC, whose receiver grants its senders credits that together fit its link's
buffer. The switch queue's own counters say who dropped what.
"""
import argparse
import time

from lab.api import Lab
from lab.core import console

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="results/example-incast")
out = ap.parse_args().out
console.attach()     # the lab's progress lines, as the CLI prints them

with Lab("leaf-spine", spines=1, leaves=1, hosts_per_leaf=5, host_rate_mbps=10,
         fabric_rate_mbps=10, out=out, name="example: incast credits") as lab:
    drops = {}
    for transport in ("rc", "mrc"):
        since = time.time()
        flows = lab.incast("g0", 300_000, transport=transport)
        time.sleep(0.2)                          # the last telemetry samples
        drops[transport] = lab.drops(since)
        done_s = max(f["completion_s"] for f in flows)
        resent = sum(f["counters"]["retransmitted"] for f in flows)
        lab.record(transport, {"switch_drops_packets": drops[transport],
                               "retransmitted_packets": resent, "completion_s": done_s})
        print(f"{transport}: {drops[transport]} packets dropped at the switch, {resent} "
              f"resent, last flow done after {done_s:.2f} s")
        lab.check(f"{transport}: every byte arrives intact", all(f["intact"] for f in flows),
                  [f["intact"] for f in flows], "all True")
    lab.check("MRC's credits drop far less than RC", drops["mrc"] <= drops["rc"] / 4,
              drops, "mrc <= rc / 4")
print(f"report: {out}/report.html")
