"""A fabric across two machines, for real: two lab VMs on one host joined by a
virtual network (lab/vm/pair.py), each running half of a leaf-spine; OVS VXLAN
tunnels carry the links between the halves (lab/cluster.py).

    sudo .venv/bin/python bench/cluster.py [--set spines=4 --set leaves=4 ...]

Machine 1 runs an ssh server; machine 0 `fabriclab verify --machines
10.99.0.1,root@10.99.0.2`: its half with the controller, the worker it starts over ssh
builds the other half, every host pair is probed (each machine from its own hosts). Prints both consoles, then
the verify's lines and the time; exit 0 when every pair was reachable.
"""
import argparse
import shlex
import sys
import time

from lab.vm import pair


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="the fabric (as for fabriclab verify); default a 2x2 leaf-spine")
    ap.add_argument("--timeout", type=float, default=30, metavar="MIN")
    args = ap.parse_args()
    sets = " ".join(f"--set {shlex.quote(s)}" for s in args.set)
    t0 = time.monotonic()
    head, worker = pair.run_cluster(
        f"fabriclab verify --machines {pair.address(0)},{pair.target(1)} {sets}",
        args.timeout, echo=lambda line: print(line, flush=True))
    print("\n".join(["", "== cluster bench =="]
                    + [ln for ln in head.lines if ln.startswith(("reachable:", "fabric ready",
                                                                 "torn down", "warning"))]
                    + [f"head exit {head.exit_code}, worker exit {worker.exit_code}, "
                       f"{time.monotonic() - t0:.0f} s in all"]))
    return 0 if head.exit_code == 0 and worker.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
