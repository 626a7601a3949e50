"""The EV controller's decision (lab/fabric/evs.py) on a fabric description: which EV
events lead to denials, for whom. Pure: no namespaces."""
from lab.fabric.evs import decide, explicit_path, links_down
from topologies.registry import build_topo
from traffic.constants import EXPLICIT_EV_BASE

FABRIC = build_topo("leaf-spine", spines=4, leaves=2, hosts_per_leaf=2).fabric
HOSTS = [h.name for h in FABRIC.hosts]                  # g0, g1 on fl-lf0; g2, g3 on fl-lf1
IP = {h.name: h.interface().ip for h in FABRIC.hosts}


def event(ev, state="assumed_bad", peer="g2"):
    return {"ev": ev, "state": state, "peer": IP[peer], "qp": "0x10102", "why": "losses",
            "t": 0.0}


def test_an_explicit_ev_takes_its_leafs_ith_uplink_then_the_spines_port_to_the_peer():
    ev = EXPLICIT_EV_BASE + 1
    (leaf, up), (spine, down) = explicit_path(FABRIC, "fl-lf0", ev, "fl-lf1")
    assert leaf == "fl-lf0" and FABRIC.switch_ports("fl-lf0")[up][0] == spine
    assert FABRIC.switch(spine).role == "spine" and FABRIC.switch_ports(spine)[down][0] == "fl-lf1"
    # the four explicit EVs take the four spines
    assert len({explicit_path(FABRIC, "fl-lf0", EXPLICIT_EV_BASE + i, "fl-lf1")[0][1]
                for i in range(4)}) == 4
    assert explicit_path(FABRIC, "fl-lf0", 0xF000, "fl-lf1") == []        # a hashed EV
    assert explicit_path(FABRIC, "fl-lf0", EXPLICIT_EV_BASE + 4, "fl-lf1") == []   # no 5th


def test_an_ev_assumed_bad_on_a_failed_link_is_denied_once_on_every_host_of_the_leaf():
    ev = EXPLICIT_EV_BASE + 2
    hops = explicit_path(FABRIC, "fl-lf0", ev, "fl-lf1")
    for dead in hops:                       # the leaf's uplink, or the spine's downlink
        denied: set = set()
        out = decide(FABRIC, HOSTS, {dead}, "g0", event(ev), denied)
        assert [(h, e) for h, e, _ in out] == [("g0", ev), ("g1", ev)]
        assert f"{dead[0]} port {dead[1]} down" in out[0][2]
        assert decide(FABRIC, HOSTS, {dead}, "g1", event(ev), denied) == []   # once a leaf


def test_nothing_is_denied_without_a_known_failed_link_on_the_evs_path():
    ev = EXPLICIT_EV_BASE + 2
    other = explicit_path(FABRIC, "fl-lf0", EXPLICIT_EV_BASE + 3, "fl-lf1")[0]
    leaf_hop = explicit_path(FABRIC, "fl-lf0", ev, "fl-lf1")[0]
    assert decide(FABRIC, HOSTS, set(), "g0", event(ev), set()) == []          # no link down
    assert decide(FABRIC, HOSTS, {other}, "g0", event(ev), set()) == []        # another one
    assert decide(FABRIC, HOSTS, {leaf_hop}, "g0", event(ev, "good"), set()) == []
    assert decide(FABRIC, HOSTS, {leaf_hop}, "g0", event(0xF001), set()) == []  # hashed
    assert decide(FABRIC, HOSTS, {leaf_hop}, "g0", event(ev, peer="g1"), set()) == []  # same leaf


def test_links_down_follows_the_routing_controllers_events():
    log = [{"event": "link_down", "switch": "fl-lf0", "port": 1},
           {"event": "link_down", "switch": "fl-sp0", "port": 1},
           {"event": "rerouted", "switch": "", "port": 0},
           {"event": "link_up", "switch": "fl-lf0", "port": 1}]
    assert links_down(log) == {("fl-sp0", 1)}
