"""Build + verify + tear down fabrics of growing size; print a table and where the time
went.

Goals: 256 hosts fully verified (every ordered pair) in under 60 s on 2 cores (issue
2); 1024 hosts (leaf-spine 32 x 32, and fat-tree k=16) built, verified and torn down in
under 3 minutes (issue 17). At 1024 hosts all pairs (1,047,552) would take longer than
the build, so each host pings SAMPLE_PER_HOST random others (lab/fabric/verify.sample:
65,536 pairs, every host sending, every leaf pair covered), and the table says so.
The build splits into: namespaces_links (from the start: the controller's launch, then
Mininet's host namespaces and veths), switches (the OVS bridges and their ports),
queues (tc on every port), dataplane (BPF programs attached), programming (the
controller's flows on every switch, until each answered a barrier, once the rest is
done), session (what the session adds: telemetry). "OVS MB": ovs-vswitchd's resident
memory with the fabric up (it keeps what it once held, so after a larger fabric the
column shows that one's).

    sudo .venv/bin/python bench/scale.py [--sizes 16,64,256,1024] [--fat-tree]

Measured (12-06, session 26, 2 cores, OVS userspace): 256 hosts 19.0 s (build 5.1,
verify 13.2, teardown 0.8), every pair; 1024 leaf-spine 45.0 s (build 24.1, verify 14.5,
teardown 6.5), every sampled pair; 1024 fat-tree k=16 160.7 s (build 85.9: switches 39.1;
verify 22.8; teardown 52.0: bridges 44.9), every sampled pair. See the README.
"""
import argparse
import time

from lab.fabric import verify
from lab.kernel import ovs
from lab.session import Session
from topologies.registry import build_topo

SHAPES = {16: ("leaf-spine", dict(spines=2, leaves=4, hosts_per_leaf=4)),
          64: ("leaf-spine", dict(spines=4, leaves=8, hosts_per_leaf=8)),
          256: ("leaf-spine", dict(spines=4, leaves=16, hosts_per_leaf=16)),
          1024: ("leaf-spine", dict(spines=16, leaves=32, hosts_per_leaf=32))}
FAT_TREE_1024 = ("fat-tree", dict(k=16))
GOAL_S = {256: 60.0, 1024: 180.0}
SAMPLE_FROM = 1024           # hosts from which verify samples pairs
SAMPLE_PER_HOST = verify.SAMPLE_PER_HOST
STAGES = ("namespaces_links_s", "switches_s", "queues_s", "dataplane_s", "programming_s",
          "session_s")
TEARDOWN = ("teardown_controller_s", "teardown_bridges_s", "teardown_links_s",
            "teardown_nodes_s", "teardown_sweep_s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256")
    ap.add_argument("--fat-tree", action="store_true", help="also fat-tree k=16 (1024 hosts)")
    a = ap.parse_args()
    shapes = [(n, *SHAPES[n]) for n in (int(s) for s in a.sizes.split(","))]
    if a.fat_tree:
        shapes.append((1024, *FAT_TREE_1024))
    rows = []
    for n, kind, shape in shapes:
        topo = build_topo(kind, **shape)
        t0 = time.monotonic()
        per_host = SAMPLE_PER_HOST if n >= SAMPLE_FROM else None
        with Session(topo, "bench/scale.py") as s:
            net = s.net
            t_ready = time.monotonic() - t0
            pids = {h.name: net.host_pid(h.name) for h in net.fabric.hosts}
            t1 = time.monotonic()
            rep = verify.measure(net.fabric, pids, per_host=per_host)
            t_verify = time.monotonic() - t1
            ovs_mb = ovs.memory_mb() or 0.0
        total = time.monotonic() - t0
        rows.append((n, kind, t_ready, t_verify, net.timings["teardown_s"], total, ovs_mb,
                     f"{rep.reachable}/{len(rep.pairs)}" + (" (sampled)" if per_host else ""),
                     {**{k: net.timings.get(k, 0.0) for k in STAGES + TEARDOWN},
                      "session_s": t_ready - net.timings.get("ready_s", t_ready)}))
        print(f"  {n} hosts ({kind}) done in {total:.1f} s", flush=True)
    print(f"\n{'hosts':>6} {'topology':>10} {'build s':>8} {'verify s':>9} {'teardown s':>11} "
          f"{'total s':>8} {'OVS MB':>7} {'pairs reachable':>26} {'goal':>10}")
    for n, kind, b, v, t, total, mb, reach, _ in rows:
        goal = f"<{GOAL_S[n]:.0f} s " + ("met" if total < GOAL_S[n] else "MISSED") \
            if n in GOAL_S else ""
        print(f"{n:>6} {kind:>10} {b:>8.1f} {v:>9.1f} {t:>11.1f} {total:>8.1f} {mb:>7.0f} "
              f"{reach:>26} {goal:>10}")
    print("\nthe build, by stage (s): " + ", ".join(s.removesuffix("_s") for s in STAGES))
    for n, kind, *_, stages in rows:
        print(f"{n:>6} {kind:>10} " + " ".join(f"{stages[s]:>8.1f}" for s in STAGES))
    print("\nthe teardown, by stage (s): " + ", ".join(
        s.removeprefix("teardown_").removesuffix("_s") for s in TEARDOWN))
    for n, kind, *_, stages in rows:
        print(f"{n:>6} {kind:>10} " + " ".join(f"{stages[s]:>8.1f}" for s in TEARDOWN))


if __name__ == "__main__":
    main()
