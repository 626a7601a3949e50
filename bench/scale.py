"""Build + verify + tear down leaf-spines of growing size; print a table.

Goal (issue 2): 256 hosts fully verified (every ordered pair) in under 60 s on 2 cores.
    sudo .venv/bin/python bench/scale.py [--sizes 16,64,256]
"""
import argparse
import time

from lab.fabric import verify
from lab.session import Session
from topologies.registry import build_topo

SHAPES = {16: dict(spines=2, leaves=4, hosts_per_leaf=4),
          64: dict(spines=4, leaves=8, hosts_per_leaf=8),
          256: dict(spines=4, leaves=16, hosts_per_leaf=16)}
GOAL_S = {256: 60.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="16,64,256")
    sizes = [int(s) for s in ap.parse_args().sizes.split(",")]
    rows = []
    for n in sizes:
        topo = build_topo("leaf-spine", **SHAPES[n])
        t0 = time.monotonic()
        with Session(topo, "bench/scale.py") as s:
            net = s.net
            t_ready = time.monotonic() - t0
            pids = {h.name: net.host_pid(h.name) for h in net.fabric.hosts}
            t1 = time.monotonic()
            rep = verify.measure(net.fabric, pids)
            t_verify = time.monotonic() - t1
        total = time.monotonic() - t0
        rows.append((n, t_ready, t_verify, net.timings["teardown_s"], total,
                     f"{rep.reachable}/{len(rep.pairs)}"))
        print(f"  {n} hosts done in {total:.1f} s", flush=True)
    print(f"\n{'hosts':>6} {'build s':>8} {'verify s':>9} {'teardown s':>11} {'total s':>8} "
          f"{'pairs reachable':>16} {'goal':>10}")
    for n, b, v, t, total, reach in rows:
        goal = f"<{GOAL_S[n]:.0f} s " + ("met" if total < GOAL_S[n] else "MISSED") \
            if n in GOAL_S else ""
        print(f"{n:>6} {b:>8.1f} {v:>9.1f} {t:>11.1f} {total:>8.1f} {reach:>16} {goal:>10}")


if __name__ == "__main__":
    main()
