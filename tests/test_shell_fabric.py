"""The shell of `fabriclab up` on a running fabric (needs root and a lab: the suite's
conftest sweeps lab objects around it): the README's lines give the switch's answers."""
import os

import pytest
from mininet.log import setLogLevel

from lab.fabric.network import FabricNetwork
from topologies.fabric import interface_name
from lab.shell import FabricCLI
from topologies.registry import build_topo

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI is root)")


def test_the_readme_lines_on_a_running_fabric(tmp_path, capfd, caplog):
    topo = build_topo("leaf-spine", spines=1, leaves=2, hosts_per_leaf=1)
    g0, g1 = topo.fabric.hosts
    port = g0.interface()
    script = tmp_path / "commands"
    script.write_text("\n".join([
        f"{port.switch} ovs-ofctl -O OpenFlow15 dump-flows {port.switch}",
        f"{port.switch} tc -s qdisc show dev {interface_name(port.switch, port.port)}",
        f"flows {port.switch}",
        "g0 ping -c1 -W2 g1",
        "g0 ping -c30 -i0.1 g1 >/dev/null &",     # traffic for the capture
        "capture g0 3",
        "queues g0",
    ]) + "\n")
    with FabricNetwork(topo, tmp_path / "run") as net:
        setLogLevel("output")                   # what the shell prints, as `up` sets it
        with open(os.devnull) as stdin:
            FabricCLI(net.mininet, net.fabric, stdin=stdin, script=str(script))
    # Mininet prints a node's answer through its logger (level 25), which pytest's
    # logging capture may take before the terminal does: read both
    out = "".join(capfd.readouterr()) + caplog.text
    assert "Unknown command" not in out
    assert out.count("cookie=") >= 2                        # dump-flows, twice
    assert "qdisc htb" in out                               # the port's own qdiscs
    assert "group_id=" in out or "OFPST_GROUP" in out       # dump-groups ran
    assert "1 received" in out
    assert "3 packets captured" in out and "ICMP echo" in out
    assert f"{port.switch}:{port.port}:" in out and "tc -s class show dev" in out
