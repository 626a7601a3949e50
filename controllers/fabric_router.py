"""FabricRouter: routes a fabric proactively from its description (os-ken app).

The lab hands the app the fabric description (JSON) at start, so nothing is
learnt by flooding: each switch gets, as soon as it connects,
  * a /32 rule per host of the subnets it owns (MACs rewritten like a router),
  * a rule per other subnet towards its owner: one port, or an ECMP select
    group over every equal-cost port,
  * an ARP answer on each switch with host ports for every address its hosts may
    ask for (their gateway, their subnet's hosts), from the description: the
    switch turns the request into the reply itself, as a fabric's ARP suppression
    does. Sent to the controller as packet-ins instead, a 1024-host fabric's first
    contacts overflowed OVS's queue of packet-ins (100 per switch connection) and a
    third of its hosts' pings went unanswered,
  * MAC Control frames (PFC, PAUSE) to the controller, whose congestion app
    honours them (controllers/congestion.py; where the BPF data path takes them
    instead, that app drops them in the switch, above this rule).
When a link goes down (or up) the app recomputes every route without it, after
a configurable delay (the convergence time of the routing protocol it stands
for), and changes on each switch the routes that changed, make before break
(routes.route_update): the rest of the fabric forwards on undisturbed.
Nothing else matches, and the switches run in fail-mode secure: no flooding,
no spanning tree, no loops.

ECMP groups hash on the 5-tuple, UDP source port included. OVS's default
select-group hash leaves UDP ports out (measured: every UDP flow on one
bucket), and OpenFlow 1.3 cannot choose another, so the app speaks OpenFlow
1.5 and attaches OVS's selection-method group property ("dp_hash": the
datapath's 5-tuple hash).

Every route ends in an egress table (table 1) instead of an output: it loads
the chosen port into reg0 and resubmits, and table 1 outputs by reg0. OpenFlow
has no egress match, and a group's bucket cannot say "mark if congested"; one
table keyed by the egress port is where the congestion app marks CE on a port,
whatever route or ECMP bucket led there.
"""
from __future__ import annotations

import functools
import itertools
import ipaddress
import json
import struct
import threading
import time
from pathlib import Path

from os_ken import cfg
from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import CONFIG_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
from os_ken.lib import hub
from os_ken.ofproto import ether, ofproto_v1_5
from os_ken.ofproto.ofproto_v1_5_parser import NXActionResubmitTable

from controllers.routes import (Deliver, Forward, RerouteSchedule, RouteUpdate, arp_answers,
                                forward_paths, route_update, routes_for,
                                without_links)
from topologies.fabric import Fabric, interface_name
from traffic.constants import (EV_FIELD_BITS, EV_TIER_OF_ROLE, EXPLICIT_EV_BASE,
                               EXPLICIT_EV_MAX_PATHS, MAC_CONTROL_ETHERTYPE,
                               ROCE_V2_UDP_PORT)

cfg.CONF.register_cli_opts([
    cfg.StrOpt("fabric-file", help="fabric description (JSON) written by the lab"),
    cfg.StrOpt("status-file", help="the app appends the dpid of each programmed switch"),
], group="fabriclab")

# OVS's group property that selects the hash (an ONF-registered extension of
# Netronome's, "NTR"); its payload is: pad(4) method name(16) method param(8).
NTR_EXPERIMENTER_ID = 0x0000154D
NTR_SELECTION_METHOD = 1
ECMP_SELECTION_METHOD = b"dp_hash"

PRIORITY_HOST = 300
PRIORITY_EXPLICIT_EV = 250     # a RoCE packet whose source port names its path
# the bits that put a source port in the explicit/generated EV range (0xE000-0xEFFF)
EXPLICIT_EV_RANGE_MASK = 0xF000
PRIORITY_SUBNET = 200
PRIORITY_ARP = 100
ARP_REQUEST, ARP_REPLY = 1, 2
PRIORITY_MAC_CONTROL = 100
PRIORITY_PAUSE_DROP = 110      # the congestion app's, where the data path takes the frames

ROUTING_TABLE = 0
EGRESS_TABLE = 1            # match reg0 (the egress port) -> output; CE marking lives here
PRIORITY_EGRESS = 0
PRIORITY_EGRESS_MARK = 10   # see controllers/congestion.py


def logged(handler):
    """os-ken's native hub takes any exception escaping a handler as a request
    to stop the app's event loop, and stops it without a word: log it instead."""
    @functools.wraps(handler)
    def wrapper(self, ev):
        try:
            handler(self, ev)
        except Exception:
            self.logger.exception("%s failed", handler.__name__)
    return wrapper


def link_is_up(switch: str, port: int) -> bool:
    """The kernel's view of a switch port's veth (Mininet's naming: SWITCH-ethPORT)."""
    try:
        return Path(f"/sys/class/net/{interface_name(switch, port)}/operstate").read_text().strip() == "up"
    except OSError:
        return False


def egress(parser, port: int) -> list:
    """Leave by `port`, through the egress table."""
    return [parser.OFPActionSetField(reg0=port), NXActionResubmitTable(table_id=EGRESS_TABLE)]


def selection_method_property(parser, method: bytes):
    payload = struct.pack("!I16sQ", 0, method, 0)
    words = list(struct.unpack(f"!{len(payload) // 4}I", payload))
    return parser.OFPGroupPropExperimenter(
        type_=ofproto_v1_5.OFPGPT_EXPERIMENTER, experimenter=NTR_EXPERIMENTER_ID,
        exp_type=NTR_SELECTION_METHOD, data=words)


class FabricRouter(app_manager.OSKenApp):
    OFP_VERSIONS = [ofproto_v1_5.OFP_VERSION]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        conf = cfg.CONF.fabriclab
        if not conf.fabric_file:
            raise SystemExit("FabricRouter needs --fabriclab-fabric-file")
        self.fabric = Fabric.load(conf.fabric_file)
        self.status_file = conf.status_file
        self.routes = routes_for(self.fabric)
        # per switch, its ECMP groups: a set of ports -> the group's id (ids are not
        # reused: a route moved to a new group never points at an old one's id)
        self.groups: dict[str, dict[tuple[int, ...], int]] = {}
        self.group_ids: dict[str, itertools.count] = {}
        self.arp_answers = arp_answers(self.fabric)
        self.by_dpid = {sw.dpid: sw.name for sw in self.fabric.switches}
        self.by_name = {sw.name: sw for sw in self.fabric.switches}
        self.pending_barrier: set[int] = set()
        self.datapaths: dict[int, object] = {}
        self.down: set[tuple[str, int]] = set()     # (switch, port) of links that are down
        self.routing_file = Path(conf.fabric_file).with_name("routing.json")
        # One reroute at a time, on the links as they are when it starts: two at once
        # (one per port event, as each end of a failed link reports) interleaved their
        # delete-and-add of a switch's flows, and a reroute computed while links were
        # still down could land last: the routes of a link that had come back were
        # gone for good (an all-reduce stalled to its timeout after a plane came back).
        self.reroute_lock = threading.Lock()
        self.reroute_running = False
        self.reroutes = RerouteSchedule()       # on the monotonic clock

    # --- one handler per OpenFlow event ------------------------------------------------
    @set_ev_cls(ofp_event.EventOFPSwitchFeatures, CONFIG_DISPATCHER)
    @logged
    def switch_features(self, ev):
        dp = ev.msg.datapath
        # os-ken's own handler of this reply sets dp.id; ours may run first (seen under
        # the lab VM's software CPU: the switch was ignored and never programmed)
        if dp.id is None:
            dp.id = ev.msg.datapath_id
        name = self.by_dpid.get(dp.id)
        if name is None:
            self.logger.warning("dpid %#x is not in the fabric; ignoring it", dp.id)
            return
        self.datapaths[dp.id] = dp
        self.program(dp, name)

    @set_ev_cls(ofp_event.EventOFPPortStatus, MAIN_DISPATCHER)
    @logged
    def port_status(self, ev):
        """A link went down (or came back): route around it, after the configured
        convergence delay (routing.json next to the fabric file: reroute_delay_ms)."""
        msg = ev.msg
        ofp = msg.datapath.ofproto
        name = self.by_dpid.get(msg.datapath.id)
        key = (name, msg.desc.port_no)
        # While the fabric is built, ports are added down and come up, and host
        # interfaces are reconfigured: the lab writes routing.json once the fabric is
        # up, and only changes after that, of links between switches, count (a host
        # whose link is down has no other way in anyway).
        peer = self.fabric.switch_ports(name).get(msg.desc.port_no) if name else None
        if (peer is None or peer[0] not in self.by_name or msg.reason != ofp.OFPPR_MODIFY
                or not self.routing_file.exists()):
            return
        down = bool(msg.desc.state & ofp.OFPPS_LINK_DOWN)
        if down == (key in self.down):
            return
        if down and link_is_up(name, msg.desc.port_no):
            # seen under heavy load: OVS reported a link down that the kernel says is up
            self.logger.warning("ignoring a link-down report for %s port %d: the kernel "
                                "says the link is up", name, msg.desc.port_no)
            return
        self.routing_event("link_down" if down else "link_up", name, msg.desc.port_no)
        delay_s = self.reroute_delay_s()
        with self.reroute_lock:
            (self.down.add if down else self.down.discard)(key)
            self.reroutes.changed(time.monotonic(), delay_s)
            start, self.reroute_running = not self.reroute_running, True
        if start:
            self.threads.append(hub.spawn(self.reroute))

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    @logged
    def barrier_reply(self, ev):
        dpid = ev.msg.datapath.id
        if dpid in self.pending_barrier:
            self.pending_barrier.discard(dpid)
            self.logger.info("programmed %s (dpid %d)", self.by_dpid[dpid], dpid)
            if self.status_file:
                with open(self.status_file, "a") as f:
                    f.write(f"{dpid}\n")

    # --- rerouting ----------------------------------------------------------------------
    def reroute_delay_s(self) -> float:
        try:
            return json.loads(self.routing_file.read_text())["reroute_delay_ms"] / 1000
        except (FileNotFoundError, ValueError, KeyError):
            return 0.0

    def reroute(self) -> None:
        """Route around the links that are down, whenever a reroute is due
        (RerouteSchedule), until none is; the only reroute running."""
        while True:
            with self.reroute_lock:
                wait = self.reroutes.wait_s(time.monotonic())
                if wait is None:
                    self.reroute_running = False
                    return
                if wait == 0:
                    self.reroutes.start(time.monotonic())
                    down = set(self.down)
            if wait > 0:
                hub.sleep(wait)
                continue
            new = routes_for(without_links(self.fabric, down))
            for dpid, dp in list(self.datapaths.items()):
                name = self.by_dpid[dpid]
                update = route_update(self.routes[name], new[name])
                if update:
                    self.update(dp, name, update, new[name])
            self.routes = new
            self.routing_event("rerouted", "", 0, down=sorted(f"{n}:{p}" for n, p in down))

    def routing_event(self, kind: str, switch: str, port: int, **more) -> None:
        self.logger.info("%s %s %s %s", kind, switch, port or "", more or "")
        with open(self.routing_file.with_name("routing-events.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), "event": kind, "switch": switch,
                                "port": port, **more}) + "\n")

    # --- programming ------------------------------------------------------------------
    def program(self, dp, name: str) -> None:
        """A switch that connected: everything it holds is replaced."""
        ofp, parser = dp.ofproto, dp.ofproto_parser
        dp.send_msg(parser.OFPFlowMod(dp, command=ofp.OFPFC_DELETE, table_id=ofp.OFPTT_ALL,
                                      out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY))
        dp.send_msg(parser.OFPGroupMod(dp, command=ofp.OFPGC_DELETE, group_id=ofp.OFPG_ALL))
        self.groups[name], self.group_ids[name] = {}, itertools.count(1)
        for route in self.routes[name]:
            if isinstance(route, Deliver):
                self.add_host_route(dp, route)
            else:
                self.add_forward(dp, name, route)
        for cidr, ip, mac in self.arp_answers.get(name, []):
            self.add_arp_answer(dp, cidr, ip, mac)
        to_controller = [parser.OFPActionOutput(ofp.OFPP_CONTROLLER, ofp.OFPCML_NO_BUFFER)]
        self.add_flow(dp, PRIORITY_MAC_CONTROL, parser.OFPMatch(eth_type=MAC_CONTROL_ETHERTYPE),
                      to_controller)
        for port in sorted(self.fabric.switch_ports(name)):
            self.add_flow(dp, PRIORITY_EGRESS, parser.OFPMatch(reg0=port),
                          [parser.OFPActionOutput(port)], table_id=EGRESS_TABLE)
        self.pending_barrier.add(dp.id)
        dp.send_msg(parser.OFPBarrierRequest(dp))

    def update(self, dp, name: str, update: RouteUpdate, routes: list) -> None:
        """A reroute on a programmed switch: the changed routes installed over the old
        ones, then what is gone deleted (routes.RouteUpdate)."""
        ofp, parser = dp.ofproto, dp.ofproto_parser
        for route in update.install:
            self.add_forward(dp, name, route)
        role = self.by_name[name].role
        gone = [(self.subnet_match(parser, r.cidr), PRIORITY_SUBNET) for r in update.withdraw]
        gone += [(self.explicit_path_match(parser, cidr, role, i), PRIORITY_EXPLICIT_EV)
                 for cidr, i in update.stale_paths]
        for match, priority in gone:
            dp.send_msg(parser.OFPFlowMod(dp, command=ofp.OFPFC_DELETE_STRICT,
                                          table_id=ROUTING_TABLE, priority=priority,
                                          match=match, out_port=ofp.OFPP_ANY,
                                          out_group=ofp.OFPG_ANY))
        used = {r.ports for r in routes if isinstance(r, Forward)}
        for ports, group_id in list(self.groups[name].items()):
            if ports not in used:
                dp.send_msg(parser.OFPGroupMod(dp, command=ofp.OFPGC_DELETE,
                                               group_id=group_id))
                del self.groups[name][ports]
        self.logger.info("rerouted %s: %d routes installed, %d withdrawn, %d explicit "
                         "paths removed", name, len(update.install), len(update.withdraw),
                         len(update.stale_paths))

    def add_forward(self, dp, name: str, route: Forward) -> None:
        """A route towards a subnet: one port, or an ECMP group (made if the switch has
        none over those ports) and the route's explicit paths."""
        parser = dp.ofproto_parser
        if len(route.ports) == 1:
            self.add_flow(dp, PRIORITY_SUBNET, self.subnet_match(parser, route.cidr),
                          [parser.OFPActionDecNwTtl(), *egress(parser, route.ports[0])])
            return
        groups = self.groups[name]
        if route.ports not in groups:
            groups[route.ports] = next(self.group_ids[name])
            self.add_ecmp_group(dp, groups[route.ports], route.ports)
        self.add_flow(dp, PRIORITY_SUBNET, self.subnet_match(parser, route.cidr),
                      [parser.OFPActionDecNwTtl(), parser.OFPActionGroup(groups[route.ports])])
        role = self.by_name[name].role
        for i in forward_paths(route):
            self.add_flow(dp, PRIORITY_EXPLICIT_EV,
                          self.explicit_path_match(parser, route.cidr, role, i),
                          [parser.OFPActionDecNwTtl(), *egress(parser, route.ports[i])])

    def add_host_route(self, dp, route: Deliver) -> None:
        parser = dp.ofproto_parser
        actions = [parser.OFPActionSetField(eth_dst=route.host_mac)]
        if route.router_mac:   # routed: every switch is a hop, as in a /32 host-routed fabric
            actions += [parser.OFPActionSetField(eth_src=route.router_mac),
                        parser.OFPActionDecNwTtl()]
        actions += egress(parser, route.port)
        self.add_flow(dp, PRIORITY_HOST,
                      parser.OFPMatch(eth_type=ether.ETH_TYPE_IP, ipv4_dst=route.ip), actions)

    def add_ecmp_group(self, dp, group_id: int, ports: tuple[int, ...]) -> None:
        ofp, parser = dp.ofproto, dp.ofproto_parser
        buckets = [parser.OFPBucket(bucket_id=i, actions=egress(parser, p),
                                    properties=[parser.OFPGroupBucketPropWeight(
                                        type_=ofp.OFPGBPT_WEIGHT, weight=1)])
                   for i, p in enumerate(ports)]
        dp.send_msg(parser.OFPGroupMod(
            dp, command=ofp.OFPGC_ADD, type_=ofp.OFPGT_SELECT, group_id=group_id,
            buckets=buckets,
            properties=[selection_method_property(parser, ECMP_SELECTION_METHOD)]))

    @classmethod
    def explicit_path_match(cls, parser, cidr: str, role: str, i: int):
        """Explicit and generated EVs: the field of this switch's tier (EV_TIER_OF_ROLE)
        of a source port in EXPLICIT_EV_BASE's range picks the equal-cost port (field i:
        the i-th); a masked match, so the other tiers' fields pass through."""
        shift = EV_FIELD_BITS * EV_TIER_OF_ROLE.get(role, 0)
        mask = EXPLICIT_EV_RANGE_MASK | (EXPLICIT_EV_MAX_PATHS - 1) << shift
        return cls.subnet_match(parser, cidr, ip_proto=17, udp_dst=ROCE_V2_UDP_PORT,
                                udp_src=(EXPLICIT_EV_BASE | i << shift, mask))

    @staticmethod
    def subnet_match(parser, cidr: str, **more):
        net = ipaddress.ip_network(cidr)
        return parser.OFPMatch(eth_type=ether.ETH_TYPE_IP,
                               ipv4_dst=(str(net.network_address), str(net.netmask)), **more)

    @staticmethod
    def add_flow(dp, priority: int, match, actions, table_id: int = ROUTING_TABLE) -> None:
        parser = dp.ofproto_parser
        inst = [parser.OFPInstructionActions(dp.ofproto.OFPIT_APPLY_ACTIONS, actions)]
        dp.send_msg(parser.OFPFlowMod(dp, table_id=table_id, priority=priority, match=match,
                                      instructions=inst))

    # --- ARP ------------------------------------------------------------------------
    def add_arp_answer(self, dp, cidr: str, ip: str, mac: str) -> None:
        """A request from `cidr` for `ip` goes back out its port as the reply: `mac`
        is at `ip` (the asker's addresses copied into the target fields)."""
        ofp, parser = dp.ofproto, dp.ofproto_parser
        net = ipaddress.ip_network(cidr)
        match = parser.OFPMatch(eth_type=ether.ETH_TYPE_ARP, arp_op=ARP_REQUEST,
                                arp_spa=(str(net.network_address), str(net.netmask)),
                                arp_tpa=ip)
        actions = [parser.OFPActionCopyField(n_bits=48, oxm_ids=["eth_src", "eth_dst"]),
                   parser.OFPActionSetField(eth_src=mac),
                   parser.OFPActionSetField(arp_op=ARP_REPLY),
                   parser.OFPActionCopyField(n_bits=48, oxm_ids=["arp_sha", "arp_tha"]),
                   parser.OFPActionCopyField(n_bits=32, oxm_ids=["arp_spa", "arp_tpa"]),
                   parser.OFPActionSetField(arp_sha=mac),
                   parser.OFPActionSetField(arp_spa=ip),
                   parser.OFPActionOutput(ofp.OFPP_IN_PORT)]
        self.add_flow(dp, PRIORITY_ARP, match, actions)
