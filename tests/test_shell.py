"""The shell of `fabriclab up` (lab/shell.py) on a fake network: the README's commands
parse and reach the right node, and the lab's commands (flows, queues, capture) run the
right programs on the right ports. No namespaces, no switches (pure: runs with
--noconftest)."""
import os

import pytest
from mininet.cli import CLI

from lab import shell
from topologies.fabric import interface_name
from lab.fabric.telemetry import QueueSample
from topologies.registry import build_topo

FABRIC = build_topo("leaf-spine", spines=2, leaves=2, hosts_per_leaf=2).fabric


class FakeNode:
    """What the CLI uses of a Mininet node: its default interface's IP, sendCmd."""

    def __init__(self, name: str, ip: str | None):
        self.name, self.ip, self.sent, self.waiting = name, ip, [], False

    def defaultIntf(self):
        return self

    def updateIP(self):
        return self.ip

    def sendCmd(self, command: str):
        self.sent.append(command)


@pytest.fixture
def net():
    """Mininet's network as the CLI sees it: nodes by name."""
    nodes = {s.name: FakeNode(s.name, None) for s in FABRIC.switches}
    nodes.update({h.name: FakeNode(h.name, h.ip) for h in FABRIC.hosts})
    return nodes


@pytest.fixture
def said(monkeypatch):
    """What the shell printed and reported as errors, and the programs it ran."""
    out = {"output": [], "error": [], "ran": []}
    monkeypatch.setattr(shell, "error", lambda m: out["error"].append(m))
    monkeypatch.setattr("mininet.cli.error", lambda m: out["error"].append(m))   # Mininet's own
    monkeypatch.setattr(shell, "output", lambda m: out["output"].append(m))
    monkeypatch.setattr(CLI, "waitForNode", lambda self, node: None)
    monkeypatch.setattr(shell.FabricCLI, "run_command",
                        lambda self, argv: out["ran"].append(argv) or 0)
    return out


def run(cli_class, net, tmp_path, *lines):
    """The CLI over `net`, given `lines` as a script (its batch mode: no terminal)."""
    script = tmp_path / "commands"
    script.write_text("\n".join(lines) + "\n")
    with open(os.devnull) as stdin:
        args = (net, FABRIC) if cli_class is shell.FabricCLI else (net,)
        cli_class(*args, stdin=stdin, script=str(script))


README_EXAMPLES = [
    ("fl-lf0 ovs-ofctl -O OpenFlow15 dump-flows fl-lf0", "fl-lf0",
     "ovs-ofctl -O OpenFlow15 dump-flows fl-lf0"),
    ("fl-lf0 tc -s qdisc show dev fl-lf0-eth1", "fl-lf0", "tc -s qdisc show dev fl-lf0-eth1"),
    ("fl-sp1 ovs-ofctl -O OpenFlow15 dump-ports fl-sp1", "fl-sp1",
     "ovs-ofctl -O OpenFlow15 dump-ports fl-sp1"),
]


@pytest.mark.parametrize("line, node, command", README_EXAMPLES)
def test_a_switch_runs_the_readme_commands(net, said, tmp_path, line, node, command):
    run(shell.FabricCLI, net, tmp_path, line)
    assert net[node].sent == [command] and not said["error"]


@pytest.mark.parametrize("line, node, command", README_EXAMPLES)
def test_mininet_alone_cannot_parse_those_names(net, said, tmp_path, line, node, command):
    run(CLI, net, tmp_path, line)      # why the lab has its own shell
    assert not net[node].sent and "Unknown command" in said["error"][0]


def test_hosts_still_get_addresses_for_node_names(net, said, tmp_path):
    run(shell.FabricCLI, net, tmp_path, "g0 ping -c1 g3")
    assert net["g0"].sent == [f"ping -c1 {FABRIC.host('g3').ip}"]


def test_flows_of_a_switch(net, said, tmp_path):
    run(shell.FabricCLI, net, tmp_path, "flows fl-lf1", "flows fl-nope")
    assert said["ran"] == [["ovs-ofctl", "-O", "OpenFlow15", "dump-flows", "fl-lf1"],
                           ["ovs-ofctl", "-O", "OpenFlow15", "dump-groups", "fl-lf1"]]
    assert "no switch 'fl-nope'" in said["error"][0] and "fl-sp0" in said["error"][0]


def test_queues_of_a_port(net, said, tmp_path, monkeypatch):
    g0 = FABRIC.host("g0").interface()
    other = next(p for p in range(1, 5) if p != g0.port)
    samples = {f"{g0.switch}:{g0.port}:{prio}": QueueSample(0.0, 2048 * prio, 2, 10, 1, 0,
                                                             prio == 3)
               for prio in (0, 3)}
    samples[f"{g0.switch}:{other}:3"] = QueueSample(0.0, 999, 1, 1, 0, 0, False)
    monkeypatch.setattr(shell.FabricCLI, "queue_samples", lambda self: samples)
    run(shell.FabricCLI, net, tmp_path, "queues g0", f"queues {g0.switch}:{g0.port}")
    by_host, by_port = said["output"][0], said["output"][2]
    assert by_host == by_port
    assert f"{g0.switch}:{g0.port}:3" in by_host and "PAUSED" in by_host
    assert f"{g0.switch}:{other}:" not in by_host
    assert f"tc -s class show dev {interface_name(g0.switch, g0.port)}" in said["output"][1]


def test_capture_of_a_port(net, said, tmp_path):
    g1 = FABRIC.host("g1").interface()
    intf = interface_name(g1.switch, g1.port)
    run(shell.FabricCLI, net, tmp_path, "capture g1", f"capture {intf} 5 {tmp_path}/g1.pcap")
    assert said["ran"] == [["tcpdump", "-i", intf, "-n", "-e", "-c", "20"],
                           ["tcpdump", "-i", intf, "-n", "-e", "-c", "5",
                            "-w", f"{tmp_path}/g1.pcap"]]
    assert "lua_script" in said["output"][-1]


@pytest.mark.parametrize("line, words", [
    ("capture fl-lf0", "name one"),                 # a switch: many ports
    ("capture g99", "capture: no switch port 'g99'"),
    ("capture", "usage: capture PORT"),
    ("capture g0 a.pcap 5", "usage: capture PORT"),
    ("queues", "usage: queues PORT"),
])
def test_capture_and_queues_say_what_is_wrong(net, said, tmp_path, line, words):
    run(shell.FabricCLI, net, tmp_path, line)
    assert not said["ran"] and words in said["error"][0]
