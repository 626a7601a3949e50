"""A fabric spread over machines (topologies/partition.py), and the tunnel bridge's
flows for its crossing links (lab/kernel/tunnel.py): pure logic, no kernel."""
import pytest

from lab.kernel import tunnel
from topologies.params import ParamError
from topologies.partition import split
from topologies.registry import build_topo


def machine_of(part, node):
    return part.placement[node]


@pytest.mark.parametrize("kind,params,machines", [
    ("leaf-spine", {}, 2),
    ("leaf-spine", {"spines": 4, "leaves": 4, "hosts_per_leaf": 2}, 2),
    ("leaf-spine", {"spines": 4, "leaves": 4, "hosts_per_leaf": 2}, 3),
    ("leaf-spine", {"planes": 2}, 2),
    ("fat-tree", {}, 2),
    ("fat-tree", {}, 3),
    ("rack", {}, 2),
])
def test_every_node_placed_and_only_switch_links_cross(kind, params, machines):
    fabric = build_topo(kind, **params).fabric
    part = split(fabric, machines)
    nodes = {s.name for s in fabric.switches} | {h.name for h in fabric.hosts}
    assert set(part.placement) == nodes
    assert set(part.placement.values()) == set(range(machines))   # every machine has a share
    for h in fabric.hosts:                 # a GPU and every switch it plugs into: one machine
        for intf in h.interfaces:
            assert machine_of(part, intf.switch) == machine_of(part, h.name)
    crossing = part.crossings
    assert crossing, "a split fabric has links between its parts"
    assert all(c.link.kind == "fabric" for c in crossing)
    assert len({c.key for c in crossing}) == len(crossing)
    # the parts' views together hold every link; a crossing link in exactly two of them
    for c in crossing:
        holders = [m for m in range(machines) if c.link in part.local(m).links]
        assert holders == sorted(c.machines)
    hosts = [len([h for h in fabric.hosts if machine_of(part, h.name) == m])
             for m in range(machines)]
    assert max(hosts) - min(hosts) <= max(len(g) for g in _groups(fabric))


def _groups(fabric):
    by = {}
    for h in fabric.hosts:
        by.setdefault(h.interfaces[0].switch, []).append(h.name)
    return by.values()


def test_leaf_spine_halves():
    """2x2 leaf-spine over two machines: a leaf, its GPUs and a spine on each; the two
    links from a leaf to the other machine's spine cross."""
    part = split(build_topo("leaf-spine").fabric, 2)
    assert part.nodes(0) == {"g0", "g1", "fl-lf0", "fl-sp0"}
    assert part.nodes(1) == {"g2", "g3", "fl-lf1", "fl-sp1"}
    assert sorted((c.link.a, c.link.b) for c in part.crossings) == \
        [("fl-lf0", "fl-sp1"), ("fl-lf1", "fl-sp0")]
    c = next(c for c in part.crossings if c.link.a == "fl-lf0")
    assert c.local_end(0) == ("fl-lf0", c.link.a_port)
    assert c.local_end(1) == ("fl-sp1", c.link.b_port)
    assert c.peer(0) == 1 and c.peer(1) == 0


def test_fat_tree_pods_stay_whole():
    """k=4 over two machines: each pod's edge and aggregation switches on one machine,
    so only aggregation-to-core links cross."""
    fabric = build_topo("fat-tree").fabric
    part = split(fabric, 2)
    roles = {s.name: s.role for s in fabric.switches}
    for c in part.crossings:
        assert {roles[c.link.a], roles[c.link.b]} == {"agg", "core"}


def test_too_many_machines_is_a_clear_error():
    with pytest.raises(ParamError, match="at most 2 machines"):
        split(build_topo("leaf-spine").fabric, 3)
    with pytest.raises(ParamError, match="at least 1"):
        split(build_topo("leaf-spine").fabric, 0)


def test_tunnel_flows_pair_each_stub_with_its_key():
    part = split(build_topo("leaf-spine", spines=4, leaves=4, hosts_per_leaf=2).fabric, 2)
    mine = [c for c in part.crossings if 0 in c.machines]
    flows = tunnel.flows(mine, 0)
    assert len(flows) == 2 * len(mine)
    vx = tunnel.FIRST_TUNNEL_OFPORT + 1
    for i, c in enumerate(mine, start=1):
        assert f"priority=100,in_port={i},actions=set_field:{c.key}->tun_id,output:{vx}" in flows
        assert f"priority=100,in_port={vx},tun_id={c.key},actions=output:{i}" in flows
    assert len(tunnel.stub_name(tunnel_key := (1 << 24) - 1)) <= 15, tunnel_key


def test_a_machine_configures_and_builds_only_its_own_part():
    """Its queues (tc batches) name only its own ports, the crossing links' included;
    the Mininet topology it builds has only its nodes and the links between them."""
    from lab.fabric.network import MachinePart
    from lab.kernel import queues
    topo = build_topo("leaf-spine", spines=4, leaves=4, hosts_per_leaf=2)
    part = split(topo.fabric, 2)
    for m in (0, 1):
        mine = part.nodes(m)
        lines = [ln for batch in queues.plan(part.local(m), queues.QueueParams()).values()
                 for ln in batch]
        devices = {w for ln in lines for w in ln.split() if "-eth" in w}
        assert devices and all(d.rsplit("-eth", 1)[0] in mine for d in devices)
        crossing_ports = {f"{s}-eth{p}" for s, p in
                          (c.local_end(m) for c in part.crossings if m in c.machines)}
        assert crossing_ports <= devices
        built = MachinePart(part, m, {0: "10.99.0.1", 1: "10.99.0.2"}, None).topo(topo)
        assert set(built.nodes()) == mine
        assert all(a in mine and b in mine for a, b in built.links())
        assert len(built.links()) == len([ln for ln in topo.fabric.links
                                          if ln.a in mine and ln.b in mine])


def test_a_machines_data_path_has_a_stub_for_each_crossing_links_far_end():
    """On a machine of several, the data path's link ends (lab/kernel/dataplane.py): its
    switch ports and hosts as on one machine, and the far end of each link to another
    machine a stub (what its switch port sends into the tunnel leaves the queue there),
    which needs the tunnel's interface named (refused without it, before anything)."""
    from lab.kernel import dataplane
    from lab.core.errors import LabError
    part = split(build_topo("leaf-spine", spines=2, leaves=4, hosts_per_leaf=2).fabric, 2)
    for m in (0, 1):
        local = part.local(m)
        slots = dataplane.slots(local)
        stubs = {(s.node, s.port) for s in slots if s.stub}
        assert stubs == {c.far_end(m) for c in part.crossings if m in c.machines}
        assert all(s.role == dataplane.ROLE_STUB and not s.switch and not s.intf
                   for s in slots if s.stub)
        peer = dataplane.peers(local)
        for i, s in enumerate(slots):
            if s.stub:      # its peer is this machine's switch port, whose queue it drains
                assert slots[peer[i]].role == dataplane.ROLE_SWITCH
                assert slots[peer[i]].node in part.nodes(m)
        with pytest.raises(LabError, match="no interface for the far end"):
            dataplane.Dataplane.attach(local, {}, None, stubs={})


def test_the_tunnel_bridge_and_its_stubs_are_lab_objects_and_nothing_else():
    """`fabriclab clean` and teardown's sweep remove fl-tun and the fl-x<key> veth ends
    (lab/fabric/cleanup.py), and no name merely like them."""
    from lab.fabric import cleanup
    assert cleanup.LAB_BRIDGE.match(tunnel.BRIDGE)
    assert cleanup.LAB_LINK.match(tunnel.stub_name(1)) and cleanup.LAB_LINK.match(
        tunnel.stub_name(MAX_KEY := (1 << 24) - 1)), MAX_KEY
    for other in ("fl-tunnel", "fl-tun0", "fl-x", "fl-xy1", "fl-x1-eth0", "vxlan_sys_4789"):
        assert not cleanup.LAB_BRIDGE.match(other) and not cleanup.LAB_LINK.match(other), other
