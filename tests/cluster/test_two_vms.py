"""A fabric across machines, for real: two lab VMs on one host joined by a virtual
network (lab/vm/pair.py), a leaf-spine split between them, its crossing links in OVS
VXLAN tunnels (lab/cluster.py). Run by `make test` after the kernel tier (`-m cluster`);
it boots the VMs from the host, so it runs natively, never inside a VM."""
import re

import pytest

from lab.vm import pair

pytestmark = pytest.mark.cluster


def test_a_leaf_spine_over_two_lab_vms_reaches_every_pair():
    """4 leaves of 2 GPUs, 2 spines: each machine a spine and two leaves with their
    GPUs; every path between the halves crosses the tunnel. Every one of the 56 pairs
    answers, over a shortest path (the verify warns of any longer one), and both
    machines take their parts down and exit 0."""
    machines = f"{pair.address(0)},{pair.address(1)}"
    head, worker = pair.run(
        f"fabriclab cluster verify --machines {machines} --set spines=2 --set leaves=4 "
        f"--set hosts_per_leaf=2", "fabriclab cluster worker --once", timeout_min=20,
        echo=None)
    out = "\n".join(head.lines)
    assert head.exit_code == 0, out
    assert "reachable: 56/56 host pairs" in out, out
    assert "2 links cross" not in out and re.search(r"\b4 links cross\b", out), out
    assert "longer path" not in out, out
    assert worker.exit_code == 0, "\n".join(worker.lines)
    assert any("the part is down" in ln for ln in worker.lines), "\n".join(worker.lines)
