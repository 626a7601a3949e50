"""htsim's input files from the lab's fabrics (topologies/htsim.py): the numbers in them
match the fabric, the connection matrix lists each flow, a fabric htsim's file cannot
describe is refused. Pure: no root, no network, no htsim."""
import dataclasses

import pytest

from topologies import htsim
from topologies.registry import build_topo

INCAST = dict(spines=1, leaves=1, hosts_per_leaf=9, host_rate_mbps=10.0,
              fabric_rate_mbps=10.0, rate_scale=10000)          # incast's TOPOLOGY_DEFAULTS
FOUR_SPINES = dict(spines=4, leaves=2, hosts_per_leaf=4, host_rate_mbps=10.0,
                   fabric_rate_mbps=10.0, rate_scale=10000)     # ecmp-vs-spray's


@pytest.fixture(autouse=True)
def no_lab_objects_left():
    """Overrides conftest's sweep of lab objects: this module creates none, and must not
    tear down a fabric that another run on this machine is using."""
    yield


def parse_topology(text: str) -> tuple[dict, dict[int, dict]]:
    """The file as htsim reads it: a header of `key value` lines, then one block per
    tier; '#' starts a comment line. Values as text."""
    header, tiers, tier = {}, {}, None
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        key, value = line.split(" ")          # htsim splits on single spaces
        if key == "Tier":
            tier = tiers.setdefault(int(value), {})
        elif tier is None:
            header[key] = value
        else:
            assert key not in tier, f"tier {key} twice (htsim refuses a duplicate)"
            tier[key] = value
    return header, tiers


def fabric(**kw):
    return build_topo("leaf-spine", **kw).fabric


def test_incast_fabric_is_one_tor_under_one_spine_at_100_gbps():
    header, tiers = parse_topology(htsim.topology_text(fabric(**INCAST)))
    assert header == {"Nodes": "9", "Tiers": "2", "Podsize": "9"}
    assert tiers[0] == {"Downlink_speed_Gbps": "100", "Radix_Down": "9", "Radix_Up": "1",
                        "Downlink_Latency_ns": "1000", "Switch_Latency_ns": "0",
                        "Oversubscribed": "9"}
    assert tiers[1] == {"Downlink_speed_Gbps": "100", "Radix_Down": "1",
                        "Downlink_Latency_ns": "1000", "Switch_Latency_ns": "0"}


def test_four_spines_two_leaves_is_non_blocking():
    f = fabric(**FOUR_SPINES)
    header, tiers = parse_topology(htsim.topology_text(f, link_latency_ns=250))
    assert header == {"Nodes": "8", "Tiers": "2", "Podsize": "8"}
    t0, t1 = tiers[0], tiers[1]
    assert (t0["Radix_Down"], t0["Radix_Up"], t0["Oversubscribed"]) == ("4", "4", "1")
    assert t1["Radix_Down"] == "2"
    assert t0["Downlink_Latency_ns"] == t1["Downlink_Latency_ns"] == "250"
    shape = htsim.leaf_spine_shape(f)
    assert (shape.spines, shape.leaves, shape.hosts_per_leaf, shape.nodes) == (4, 2, 4, 8)
    # htsim's own consistency rules for a 2-tier custom topology (fat_tree_topology.cpp)
    tor_uplinks = shape.nodes * shape.host_link_gbps // (shape.fabric_link_gbps
                                                         * shape.oversubscription)
    assert tor_uplinks == shape.leaves * shape.spines
    assert shape.hosts_per_leaf // shape.spines == shape.oversubscription


def test_no_queue_sizes_in_the_file():
    """The drivers take the queue size from -q and refuse a file that sets it too."""
    _, tiers = parse_topology(htsim.topology_text(fabric(**FOUR_SPINES)))
    assert not {k for t in tiers.values() for k in t} & {"Queue_Up", "Queue_Down"}


@pytest.mark.parametrize("host_mbps,fabric_mbps,scale,host_gbps,fabric_gbps", [
    (10.0, 10.0, 10000, 100, 100),     # the experiments' 10 Mb/s for 100 Gb/s
    (100.0, 100.0, 1000, 100, 100),    # the default scale
    (10.0, 10.0, 40000, 400, 400),     # 400 Gb/s links
    (0.7, 0.7, 142857, 100, 100),      # a calibrated run: rate_scale rounded (99.99990 Gb/s)
])
def test_speeds_are_the_lab_rates_times_rate_scale(host_mbps, fabric_mbps, scale, host_gbps,
                                                   fabric_gbps):
    f = fabric(spines=4, leaves=2, hosts_per_leaf=4, host_rate_mbps=host_mbps,
               fabric_rate_mbps=fabric_mbps, rate_scale=scale)
    _, tiers = parse_topology(htsim.topology_text(f))
    assert tiers[0]["Downlink_speed_Gbps"] == str(host_gbps)
    assert tiers[1]["Downlink_speed_Gbps"] == str(fabric_gbps)


def test_node_i_is_the_ith_host_under_tor_i_div_hosts_per_leaf():
    f = fabric(**FOUR_SPINES)
    nodes = htsim.node_numbers(f)
    assert nodes == {f"g{i}": i for i in range(8)}
    leaves = [sw.name for sw in f.switches if sw.role == "leaf"]
    for h in f.hosts:     # htsim puts node i under ToR i // Radix_Down: the host's own leaf
        assert h.interface().switch == leaves[nodes[h.name] // 4]


def test_connection_matrix_lists_each_flow_in_order():
    f = fabric(**FOUR_SPINES)
    flows = [htsim.Flow("g0", "g4", 1_000_000), htsim.Flow("g0", "g5", 1_000_000),
             htsim.Flow("g3", "g4", 1_000_000, start_us=2.5), htsim.Flow("g7", "g1", 4096)]
    lines = htsim.connection_matrix_text(f, flows).splitlines()
    assert lines[:2] == ["Nodes 8", "Connections 4"]
    assert lines[2:] == ["0->4 start 0 size 1000000", "0->5 start 0 size 1000000",
                         "3->4 start 2500000 size 1000000",    # this htsim reads picoseconds
                         "7->1 start 0 size 4096"]


def test_incast_matrix_has_every_sender_to_the_receiver():
    f = fabric(**INCAST)
    flows = [htsim.Flow(f"g{i}", "g0", 1200 * 1024) for i in range(1, 9)]
    lines = htsim.connection_matrix_text(f, flows).splitlines()
    assert lines[0] == "Nodes 9" and lines[1] == "Connections 8"
    assert lines[2:] == [f"{i}->0 start 0 size 1228800" for i in range(1, 9)]


@pytest.mark.parametrize("kind,kw,why", [
    ("rack", dict(racks=2, gpus_per_rack=4), "switch roles"),
    ("fat-tree", dict(k=4), "only two-tier leaf-spine"),
    ("leaf-spine", dict(spines=4, leaves=2, hosts_per_leaf=2), "whole multiple"),
    ("leaf-spine", dict(spines=2, leaves=2, hosts_per_leaf=3), "whole multiple"),
    ("leaf-spine", dict(spines=2, leaves=2, hosts_per_leaf=4, fabric_rate_mbps=200.0),
     "whole multiple"),
    ("leaf-spine", dict(host_rate_mbps=10.5, fabric_rate_mbps=10.5), "whole Gb/s"),
])
def test_a_fabric_htsim_cannot_describe_is_refused(kind, kw, why):
    f = build_topo(kind, **kw).fabric
    with pytest.raises(ValueError, match=why):
        htsim.topology_text(f)


def test_hosts_out_of_leaf_order_are_refused():
    """htsim's node i sits under ToR i // hosts per ToR: a fabric whose hosts do not come
    leaf by leaf would be wired differently in the simulator."""
    f = fabric(**FOUR_SPINES)
    f.hosts[3], f.hosts[4] = f.hosts[4], f.hosts[3]
    with pytest.raises(ValueError, match="leaf by leaf"):
        htsim.topology_text(f)


def test_mixed_link_rates_are_refused():
    f = fabric(**FOUR_SPINES)
    i = next(i for i, ln in enumerate(f.links) if ln.kind == "host")
    f.links[i] = dataclasses.replace(f.links[i], rate_mbps=20.0)
    with pytest.raises(ValueError, match="one rate per tier"):
        htsim.topology_text(f)


def test_zero_link_latency_is_refused():
    with pytest.raises(ValueError, match="latency"):
        htsim.topology_text(fabric(**INCAST), link_latency_ns=0)


@pytest.mark.parametrize("flow,why", [
    (htsim.Flow("g1", "g99", 1000), "no host g99"),
    (htsim.Flow("g1", "g1", 1000), "same host"),
    (htsim.Flow("g1", "g0", 0), "sizes"),
    (htsim.Flow("g1", "g0", 2**31), "sizes"),
    (htsim.Flow("g1", "g0", 1000, start_us=-1.0), "negative start"),
])
def test_a_flow_htsim_cannot_take_is_refused(flow, why):
    with pytest.raises(ValueError, match=why):
        htsim.connection_matrix_text(fabric(**INCAST), [flow])


def test_a_permutation_sends_once_from_and_once_to_every_host():
    fabric = build_topo("leaf-spine", **FOUR_SPINES).fabric
    flows = htsim.permutation_flows(fabric, 1000, seed=3)
    hosts = sorted(h.name for h in fabric.hosts)
    assert sorted(f.src for f in flows) == hosts == sorted(f.dst for f in flows)
    assert all(f.src != f.dst and f.size_bytes == 1000 for f in flows)
    # one cycle through every host (no pair of hosts just swaps, no short loops)
    nxt = {f.src: f.dst for f in flows}
    seen, h = set(), hosts[0]
    while h not in seen:
        seen.add(h)
        h = nxt[h]
    assert seen == set(hosts)
    assert htsim.permutation_flows(fabric, 1000, seed=3) == flows     # the seed decides
    assert htsim.permutation_flows(fabric, 1000, seed=4) != flows


def test_an_incast_takes_the_first_host_and_the_next_senders():
    fabric = build_topo("leaf-spine", **FOUR_SPINES).fabric
    flows = htsim.incast_flows(fabric, 3, 500)
    assert [(f.src, f.dst) for f in flows] == [("g1", "g0"), ("g2", "g0"), ("g3", "g0")]
    with pytest.raises(ValueError, match="needs 9 hosts"):
        htsim.incast_flows(fabric, 8, 500)


def test_fabriclab_exports_a_1024_gpu_fabric_and_its_permutation(tmp_path):
    """`fabriclab htsim-export`, the hand-off to simulation (bench/htsim_scale.py runs
    htsim on it): no root, no fabric built."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "lab", "htsim-export", "--set", "spines=32",
                        "--set", "leaves=32", "--set", "hosts_per_leaf=32",
                        "--set", "host_rate_mbps=10", "--set", "fabric_rate_mbps=10",
                        "--set", "rate_scale=10000", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    header, tiers = parse_topology((tmp_path / "fabric.topo").read_text())
    assert header["Nodes"] == "1024" and tiers[0]["Downlink_speed_Gbps"] == "100"
    cm = (tmp_path / "permutation.cm").read_text().splitlines()
    assert cm[:2] == ["Nodes 1024", "Connections 1024"] and len(cm) == 1026
    bad = subprocess.run([sys.executable, "-m", "lab", "htsim-export", "--set",
                          "topology=fat-tree", "--set", "k=4", "--out", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "two-tier leaf-spine" in bad.stderr
