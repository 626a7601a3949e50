"""The OVS kernel datapath runs a fabric: the bridges are in the kernel's datapath,
and every host pair is reachable over shortest paths; and the native suite's fabric,
queue and PFC tests pass on it as they do on the userspace datapath."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_lab import host_pids, leaf_spine
from lab.fabric import verify
from lab.kernel import ovs
from topologies.fabric import interface_name

pytestmark = pytest.mark.kernel


def _out(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


def test_kernel_datapath_forwards_a_leaf_spine(tmp_path):
    with leaf_spine(tmp_path, spines=2, leaves=2, hosts_per_leaf=2) as net:
        assert net.datapath == "kernel", (
            "OVS runs its userspace datapath: this kernel has no openvswitch module. "
            "Run the kernel tests in the lab VM: fabriclab vm test")
        fabric = net.fabric
        types = {s.name: _out("ovs-vsctl", "get", "bridge", s.name, "datapath_type").strip()
                 for s in fabric.switches}
        dpif = _out("ovs-appctl", "dpif/show")
        kernel_view = _out("ovs-dpctl", "show")    # asks the kernel's datapath itself
        report = verify.measure(fabric, host_pids(net))
    # "" is OVS's default type, which is "system", the kernel datapath
    assert all(t.strip('"') in ("", "system") for t in types.values()), types
    assert "system@ovs-system" in dpif and "netdev@" not in dpif, dpif
    switch_ports = [interface_name(node, port) for ln in fabric.links
                    for node, port in ((ln.a, ln.a_port), (ln.b, ln.b_port))
                    if node not in {h.name for h in fabric.hosts}]
    missing = [p for p in switch_ports if p not in kernel_view]
    assert not missing, f"ports not in the kernel datapath: {missing}"
    assert report.reachable == len(report.pairs), report.lines()
    assert not report.wrong_hops


# The native tests that exercise the datapath itself: every topology built and verified,
# ECMP spreading, link rates, the per-priority classes, PFC gates and thresholds.
NATIVE_ON_KERNEL_DATAPATH = ["tests/test_fabric.py", "tests/test_congestion.py", "-k",
                             "not congestion.py or dscp_picks or pfc_frame_stops "
                             "or per_priority"]


def test_the_native_fabric_and_pfc_tests_pass_on_the_kernel_datapath():
    assert ovs.kernel_datapath_available(), (
        "this kernel has no openvswitch module. Run the kernel tests in the lab VM: "
        "fabriclab vm test")
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        *NATIVE_ON_KERNEL_DATAPATH], cwd=root, capture_output=True, text=True,
                       timeout=1800)
    print(r.stdout[-2000:])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 10 and not re.search(r"skipped|xfail", r.stdout)
