"""A fabric across machines, for real: two lab VMs on one host joined by a virtual
network (lab/vm/pair.py), a leaf-spine split between them, its crossing links in OVS
VXLAN tunnels (lab/cluster.py). Run by `make test` after the kernel tier (`-m cluster`);
it boots the VMs from the host, so it runs natively, never inside a VM."""
import re

import pytest

from lab.vm import pair

pytestmark = pytest.mark.cluster
MACHINES = f"{pair.address(0)},{pair.address(1)}"


def test_every_pair_reachable_and_an_allreduce_ring_across_two_lab_vms():
    """Two heads in turn, one worker serving each (--once, twice):
    1. verify: 4 leaves of 2 GPUs and 2 spines, each machine a spine and two leaves with
       their GPUs, so every path between the halves crosses the tunnel: every one of
       the 56 pairs answers, over a shortest path (the verify warns of any longer one).
    2. all-reduce of 0.7, 0.9, 0.6, 0.8 over 4 GPUs (2 per leaf, a leaf per machine):
       the ring g0 g1 g2 g3 crosses between the machines twice; the GPU agents of
       machine 1 run there, driven by the head through the worker; every host holds
       0.75, the numpy mean.
    Both machines take their parts down and exit 0."""
    head, worker = pair.run(
        f"fabriclab verify --machines {MACHINES} --set spines=2 --set leaves=4 "
        f"--set hosts_per_leaf=2 && fabriclab allreduce --machines {MACHINES} "
        f"--values 0.7,0.9,0.6,0.8",
        "fabriclab cluster worker --once && fabriclab cluster worker --once",
        timeout_min=20, echo=None)
    out = "\n".join(head.lines)
    assert head.exit_code == 0, out
    assert "reachable: 56/56 host pairs" in out, out
    assert re.search(r"\b4 links cross\b", out), out
    assert "longer path" not in out, out
    for host, value in (("g0", "0.7"), ("g1", "0.9"), ("g2", "0.6"), ("g3", "0.8")):
        assert re.search(rf"^\s*{host}: {value} -> 0\.75$", out, re.M), out
    assert "every host agrees with the numpy mean" in out, out
    assert worker.exit_code == 0, "\n".join(worker.lines)
    assert sum("the part is down" in ln for ln in worker.lines) == 2, "\n".join(worker.lines)
