"""Topology descriptions and routes, checked without building a network."""
import ipaddress

import pytest

from controllers.routes import Deliver, Forward, arp_answers, routes_for
from topologies.fabric import interface_name, interface_port
from topologies.params import ParamError
from topologies.registry import build_topo, make_params


@pytest.mark.parametrize("kind,kw,hosts,switches", [
    ("leaf-spine", dict(spines=2, leaves=3, hosts_per_leaf=4), 12, 5),
    ("rack", dict(racks=3, gpus_per_rack=4, spines=2), 12, 2 + 3 + 3),
    ("fat-tree", dict(k=4), 16, 20),
    ("fat-tree", dict(k=6), 54, 45),
])
def test_sizes_and_unique_addresses(kind, kw, hosts, switches):
    f = build_topo(kind, **kw).fabric
    assert len(f.hosts) == hosts and len(f.switches) == switches
    ips = [i.ip for h in f.hosts for i in h.interfaces]
    macs = [i.mac for h in f.hosts for i in h.interfaces]
    assert len(set(ips)) == len(ips) and len(set(macs)) == len(macs)
    assert len({s.dpid for s in f.switches}) == len(f.switches)
    for h in f.hosts:          # every interface sits in the subnet of its own switch
        for i in h.interfaces:
            assert f.subnet_of(i.ip).switch == i.switch
    for ln in f.links:         # Linux interface names have at most 15 characters
        assert len(interface_name(ln.a, ln.a_port)) <= 15
        assert len(interface_name(ln.b, ln.b_port)) <= 15
        # and each name leads back to its node and port (telemetry, a cluster's captures)
        assert interface_port(interface_name(ln.a, ln.a_port)) == (ln.a, ln.a_port)
        assert interface_port(interface_name(ln.b, ln.b_port)) == (ln.b, ln.b_port)


def test_rack_has_fast_scaleup_links():
    f = build_topo("rack", racks=2, gpus_per_rack=4).fabric
    for h in f.hosts:
        out, up = h.interface("scale-out"), h.interface("scale-up")
        assert up.rate_mbps == pytest.approx(9 * out.rate_mbps)
        assert f.switch(up.switch).role == "nvswitch"
        assert ipaddress.ip_address(up.ip) in ipaddress.ip_network(f"10.2.{h.rack}.0/24")


def test_leaf_uplinks_form_one_ecmp_set_per_remote_leaf():
    f = build_topo("leaf-spine", spines=4, leaves=3, hosts_per_leaf=2).fabric
    routes = routes_for(f)["fl-lf0"]
    forwards = [r for r in routes if isinstance(r, Forward)]
    delivers = [r for r in routes if isinstance(r, Deliver)]
    assert len(forwards) == 2 and all(len(r.ports) == 4 for r in forwards)
    assert len(delivers) == 2
    spine = routes_for(f)["fl-sp0"]
    assert all(isinstance(r, Forward) and len(r.ports) == 1 for r in spine)


def test_a_switch_answers_arp_for_its_hosts_subnets_only():
    f = build_topo("rack", racks=2, gpus_per_rack=4, spines=2).fabric
    answers = arp_answers(f)
    assert set(answers) == {i.switch for h in f.hosts for i in h.interfaces}
    assert not any(f.switch(sw).role == "spine" for sw in answers)
    for sw, entries in answers.items():
        cidrs = {f.subnet_of(i.ip).cidr for h in f.hosts for i in h.interfaces
                 if i.switch == sw}
        assert {c for c, _, _ in entries} == cidrs
        for cidr, ip, mac in entries:     # a neighbour's or the gateway's address
            sn = next(s for s in f.subnets if s.cidr == cidr)
            owners = {i.mac for h in f.hosts for i in h.interfaces if i.ip == ip}
            assert ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)
            assert mac in owners or (ip, mac) == (sn.gateway_ip, sn.gateway_mac)
    # a rack's scale-up domain (no gateway): its hosts only, each by its own MAC
    up = {ip: mac for c, ip, mac in answers[f.hosts[0].interface("scale-up").switch]}
    assert up == {i.ip: i.mac for h in f.hosts[:4] for i in h.interfaces
                  if i.network == "scale-up"}


def test_fat_tree_ecmp_at_edge_and_aggregation():
    f = build_topo("fat-tree", k=4).fabric
    r = routes_for(f)
    edge_fw = [x for x in r["fl-ed0"] if isinstance(x, Forward)]
    assert len(edge_fw) == 7 and all(len(x.ports) == 2 for x in edge_fw)
    agg = {x.cidr: x.ports for x in r["fl-ag0"] if isinstance(x, Forward)}
    assert len(agg["10.1.1.0/24"]) == 1          # same pod: straight down
    assert len(agg["10.1.2.0/24"]) == 2          # other pod: over both cores


def test_oversubscription_follows_from_rates():
    p = make_params("leaf-spine", spines=2, hosts_per_leaf=8, host_rate_mbps=100,
                    fabric_rate_mbps=100)
    assert p.oversubscription == 4.0


@pytest.mark.parametrize("kind,kw,word", [
    ("leaf-spine", dict(spines=0), "spines"),
    ("leaf-spine", dict(host_rate_mbps=-5), "host_rate_mbps"),
    ("fat-tree", dict(k=5), "k"),
    ("leaf-spine", dict(k=4), "k"),
    ("leaf-spine", dict(leaves="many"), "leaves"),
    ("leaf-spine", dict(hosts_per_leaf=300), "hosts per switch"),
    ("torus", {}, "torus"),
])
def test_bad_parameters_name_themselves(kind, kw, word):
    with pytest.raises(ParamError, match=word):
        build_topo(kind, **kw)


def test_parameters_from_text_are_parsed_in_one_place():
    """--set values, CLI options and registry keywords all go through parse_value."""
    from topologies.params import parse_value
    assert parse_value("spines", "2", "int") == 2 and parse_value("rate", "2.5", float) == 2.5
    assert parse_value("ecn", "bpf", "str") == "bpf"
    assert parse_value("live", "yes", "bool") is True and parse_value("live", "0", bool) is False
    assert parse_value("spines", 3, int) == 3 and parse_value("rate", 10, "float") == 10.0
    for key, value, ftype in (("spines", "two", "int"), ("live", "maybe", "bool")):
        with pytest.raises(ParamError, match=f"{key}: expected"):
            parse_value(key, value, ftype)
    with pytest.raises(ParamError, match="spines: expected int"):
        make_params("leaf-spine", spines="2.5")


def test_planes_are_parallel_fabrics_sharing_only_the_gpus():
    """planes=2: every GPU has a NIC into each plane's leaf, with its own addresses and
    MAC; the planes' switches never meet, so each plane's routes stay inside it."""
    f = build_topo("leaf-spine", planes=2, spines=2, leaves=2, hosts_per_leaf=3).fabric
    assert len(f.hosts) == 6 and len(f.switches) == 2 * (2 + 2)
    for h in f.hosts:
        assert [i.network for i in h.interfaces] == ["scale-out", "plane1"]
        out, p1 = h.interfaces
        assert ipaddress.ip_address(out.ip) in ipaddress.ip_network("10.1.0.0/16")
        assert ipaddress.ip_address(p1.ip) in ipaddress.ip_network("10.11.0.0/16")
        assert out.switch != p1.switch and out.mac != p1.mac
    macs = [i.mac for h in f.hosts for i in h.interfaces]
    assert len(set(macs)) == len(macs)
    plane_of_switch = {i.switch: i.network for h in f.hosts for i in h.interfaces}
    for ln in f.links:
        if ln.kind == "fabric":       # a leaf's uplinks go to its own plane's spines
            leaf = ln.a if ln.a in plane_of_switch else ln.b
            spine = ln.b if leaf == ln.a else ln.a
            assert int(spine.removeprefix("fl-sp")) // 2 == int(leaf.removeprefix("fl-lf")) // 2
    routes = routes_for(f)
    for sw, rs in routes.items():
        nets = {r.cidr.split(".")[1] for r in rs if isinstance(r, Forward)}
        assert len(nets) == 1, (sw, nets)        # plane 0 routes 10.1/16, plane 1 10.11/16


def test_rack_planes_split_scale_out_and_keep_one_scale_up_domain_per_rack():
    f = build_topo("rack", racks=2, gpus_per_rack=2, spines=1, planes=3).fabric
    assert sorted(s.role for s in f.switches).count("nvswitch") == 2
    assert len(f.switches) == 2 + 3 * (2 + 1)          # nvswitches, then leaves and spines
    for h in f.hosts:
        assert [i.network for i in h.interfaces] == ["scale-out", "scale-up", "plane1", "plane2"]
        leaves = [i.switch for i in h.interfaces if i.network != "scale-up"]
        assert len(set(leaves)) == 3                    # its rack's leaf in each plane
    racks = {h.rack: {i.switch for i in h.interfaces} for h in f.hosts}
    assert not racks[0] & racks[1]                      # no rack shares a switch with another


def test_a_plane_nic_reaches_the_other_leaves_through_its_own_gateway():
    from lab.fabric.network import plane_routes
    f = build_topo("leaf-spine", planes=3, spines=1, leaves=2, hosts_per_leaf=1).fabric
    assert plane_routes(f)["g1"] == ["10.11.0.0/16 via 10.11.1.254 dev g1-eth1",
                                     "10.12.0.0/16 via 10.12.1.254 dev g1-eth2"]


def test_a_sample_of_pairs_keeps_every_source_and_its_count():
    from lab.fabric import verify
    f = build_topo("leaf-spine", spines=2, leaves=4, hosts_per_leaf=4).fabric
    pairs = verify.pairs_to_probe(f)
    s = verify.sample(pairs, 5)
    assert len(s) == 16 * 5 and {p.src for p in s} == {h.name for h in f.hosts}
    assert all(p in pairs for p in s) and verify.sample(pairs, 5) == s   # the seed decides
    assert verify.sample(pairs, 100) == pairs          # fewer than asked: all of them


def test_a_reroute_changes_the_routes_that_changed_and_no_others():
    """routes.route_update, what the controller changes on a switch when links fail:
    a failed plane leaves the other plane's switches untouched (rerouting once
    reprogrammed every switch, and under a software CPU plane 1 dropped what it carried
    for ~1 s); a failed uplink of four changes the ECMP routes over it, keeps the
    explicit paths that remain and removes the one past the end."""
    from controllers.routes import route_update, without_links
    f = build_topo("leaf-spine", planes=2, spines=1, leaves=2, hosts_per_leaf=2).fabric
    before = routes_for(f)
    after = routes_for(without_links(f, {("fl-lf0", 1), ("fl-lf1", 1)}))
    updates = {sw: route_update(before[sw], after[sw]) for sw in before}
    assert sorted(sw for sw, u in updates.items() if u) == ["fl-lf0", "fl-lf1", "fl-sp0"]
    assert updates["fl-lf0"].withdraw == (Forward("10.1.1.0/24", (1,)),)
    assert not updates["fl-lf0"].install and not updates["fl-lf0"].stale_paths
    back = {sw: route_update(after[sw], before[sw]) for sw in before}   # the plane returns
    assert back["fl-lf0"].install == (Forward("10.1.1.0/24", (1,)),)
    assert not back["fl-lf2"] and not back["fl-sp1"]

    f = build_topo("leaf-spine", spines=4, leaves=2, hosts_per_leaf=1).fabric
    before, after = routes_for(f), routes_for(without_links(f, {("fl-lf0", 1)}))
    u = route_update(before["fl-lf0"], after["fl-lf0"])
    assert u.install == (Forward("10.1.1.0/24", (2, 3, 4)),) and not u.withdraw
    assert u.stale_paths == (("10.1.1.0/24", 3),)      # paths 0-2 are installed over
    assert not route_update(before["fl-sp1"], after["fl-sp1"])
    assert route_update(before["fl-lf0"], before["fl-lf0"]) == route_update([], [])


def test_reroutes_are_due_each_change_delay_later_and_merge_only_what_is_due():
    """The controller's reroute schedule (controllers/routes.py): a failed link's two
    ends report 3 ms apart: one reroute, the delay after the first report, covers both.
    A flap (a change every 0.2 s, delay 1.5 s): each change still gets a reroute at its
    own due time, never earlier, so the one after the last change comes 1.5 s after it
    (link-failure's settle_routes waits for that one)."""
    from controllers.routes import RerouteSchedule
    s = RerouteSchedule(merge_s=0.02)
    assert s.wait_s(0.0) is None
    s.changed(10.000, 0.0)
    s.changed(10.003, 0.0)
    assert s.wait_s(10.000) == 0
    s.start(10.000)
    assert s.wait_s(10.004) is None          # both reports in one reroute
    changes = [20.0 + 0.2 * i for i in range(5)]
    starts = []
    now = 20.0
    for t in changes:
        s.changed(t, 1.5)
    while (wait := s.wait_s(now)) is not None:
        now += wait
        starts.append(round(now, 3))
        s.start(now)
        now += 0.1                            # programming every switch takes a while
    assert starts == [21.5, 21.7, 21.9, 22.1, 22.3]
    assert starts[-1] >= changes[-1] + 1.5
