"""CongestionControl: ECN marking and PFC for the fabric's switches (os-ken app).

Where the lab runs its per-packet data path (lab/kernel/dataplane.py: tc BPF programs on
every switch port, config["dataplane"] true), the app sets the policy in the
programs' table and reacts to what they signal through a ring buffer:

ECN, mode "bpf". The port's program marks CE per packet with RED's probability
of the average backlog; the app only writes Kmin, Kmax, Pmax and RED's weight.
Counts come from the program (a marked frame is a frame that was sent).

PFC, per ingress port. The program charges each lossless frame queued on a
switch to the port it entered through and signals XOFF for that ingress the
moment its bytes pass its threshold (a dynamic one: alpha x the free buffer of
the queue, above the headroom this app sizes for every port feeding it:
2 x (link delay + response) x rate + 2 MTU, the response being `pfc_response_ms`),
and XON when they fall below the resume threshold. The data path sends the real
802.1Qbb frame out of that ingress port itself (the programs, or for an XON decided
on a host's end of a link lab/kernel/pfc_sender.c); this app logs the decisions in batches,
refreshes long pauses, and sends a frame only where a port's last one disagrees
with its flag for RESYNC_S (follow_xoff). The neighbour's ingress program sees the
frame arrive and signals it at once; the app then closes that port's gate (a switch
port, or a GPU host's NIC), as the neighbour's MAC would. No packet-in path, no
sampling: the reaction is one wake-up of this thread (state["reaction"] holds its
distribution). A GPU host whose agent's transport
runs (lab/fabric/gpus.py marks it in the table) stops the priority in that transport
itself, as a NIC's MAC does: its program signals nothing and no gate closes.

Without the data path (a kernel without BPF), it samples the queues instead:

ECN, mode "controller" (for kernels without sch_red). Per egress port and
sample interval it draws "mark" with RED's probability for the RoCE class's
backlog q: 0 below Kmin, rising linearly to Pmax at Kmax, 1 above. While a port
is marking, its egress-table entry (controllers/fabric_router.py) rewrites ECT
packets to CE. The approximation, against kernel RED: the backlog is sampled
instantaneously, not averaged; and the coin is tossed once per interval for
every packet of that interval, not per packet (OpenFlow has no per-packet
random), so the marked fraction follows p(q) over time, in bursts of
`sample_ms`. Marks are counted exactly from the flow-removed messages.

PFC. Each lossless priority (RoCE data's by default) has its own XOFF and XON
thresholds. When that class's backlog on a port passes its XOFF, the switch sends
a real 802.1Qbb frame for that priority (pause `pause_quanta`, refreshed while
congested) out of every other port: the upstream neighbours whose traffic can
feed that queue. Below its XON it sends resume (pause time 0). A switch that receives a PFC frame
(OVS hands MAC Control frames to the controller) closes the gate of that
priority on the receiving port's egress: its queue holds, other priorities keep
flowing, and if the queue fills it pauses its own upstream in turn. A GPU host
honours the frames in its NIC (traffic/nic.py). A watchdog reports a gate
closed longer than `watchdog_ms` (a pause storm or a deadlock).

The lab drives it through files in the run directory, as controllers/protocol.py
says: the configuration (reloaded when it changes), the state (counters per port
and priority, the applied configuration version) and the events (xoff/xon, gates,
marking, watchdog; with timestamps).
"""
from __future__ import annotations

import collections
import gc
import json
import os
import random
import select
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from os_ken import cfg
from os_ken.base import app_manager
from os_ken.controller import ofp_event
from os_ken.controller.handler import DEAD_DISPATCHER, MAIN_DISPATCHER, set_ev_cls
from os_ken.lib import hub
from os_ken.ofproto import ether, ofproto_v1_5

from controllers.fabric_router import (EGRESS_TABLE, PRIORITY_EGRESS_MARK, PRIORITY_PAUSE_DROP,
                                       logged)
from controllers.protocol import EVENTS_FILE, STATE_EVERY_S, CongestionConfig, write_state
from lab.kernel import dataplane, netns, queues, tcnl
from topologies.fabric import Fabric, interface_name
from traffic import pause
from traffic.constants import MAC_CONTROL_ETHERTYPE, PRIORITY_ROCE_DATA, Ecn

cfg.CONF.register_cli_opts([
    cfg.StrOpt("congestion-file", help="ECN/PFC configuration (JSON) written by the lab"),
    cfg.StrOpt("congestion-fabric-file", help="the switches and hosts this app handles: "
               "one machine's part of a fabric across machines (default: fabric-file's)"),
], group="fabriclab")

MARK_COOKIE = 0xEC   # a marking flow's cookie: MARK_COOKIE << 16 | its port
# Without sampling (the data path, or congestion handling off) the loop and the batches
# of signals wake this often: each wake-up of a thread costs ~0.1-0.3 ms of CPU on a
# busy machine (cold caches), whatever little it then does
IDLE_POLL_S = 0.1
# the data path's backlogs against the kernel's (one dump of every qdisc: most of this
# loop's CPU), this often; the PFC flags are checked every turn
RECONCILE_S = 0.5
RECONCILE_SLACK_BYTES = 1600    # a frame in flight to the peer: not a discrepancy
# a port's last PFC frame disagreeing with its flag this long, with no new decision, is
# sent by this app: the PFC sender (lab/kernel/pfc_sender.c) woke late or not at all (a busy
# machine delays its wake-up by milliseconds; the refresh quanta are seconds)
RESYNC_S = 0.05
REALTIME_PRIORITY = 20      # SCHED_FIFO, below the kernel's own threads (50)
LOCAL_EXPERIMENTAL_ETHERTYPE = 0x88B5   # IEEE 802: for local experiments, never routed
# SO_PRIORITY naming the htb root itself (1:0): htb sends the frame directly, ahead of
# its classes, as a MAC sends control frames ahead of its queues
HTB_DIRECT_PRIORITY = 0x10000
KICK_FRAME = (b"\xff" * 6 + b"\x02\xfc\x00\x00\x00\x00"
              + LOCAL_EXPERIMENTAL_ETHERTYPE.to_bytes(2, "big") + b"\0" * 46)


def queue_params(c: CongestionConfig) -> queues.QueueParams:
    return queues.QueueParams(**c.queue)


def mark_probability(c: CongestionConfig, backlog: int) -> float:
    """RED's marking curve over the (instantaneous) backlog: the sampling mode's."""
    if backlog < c.kmin_bytes:
        return 0.0
    if backlog >= c.kmax_bytes:
        return 1.0
    return c.pmax * (backlog - c.kmin_bytes) / max(1, c.kmax_bytes - c.kmin_bytes)


@dataclass
class PortCounters:
    pause_frames_sent: int = 0         # PFC frames, pausing (XOFF) or resuming (XON)
    pause_frames_received: int = 0
    xoff_frames_sent: int = 0
    xon_frames_sent: int = 0
    xoff_frames_received: int = 0
    xon_frames_received: int = 0
    written_off_bytes: int = 0         # left the queue unseen by the data path (reconcile)

    def count_frame(self, way: str, pausing: bool) -> None:
        """A PFC frame `way` "sent" or "received", pausing (XOFF) or resuming (XON)."""
        for name in (f"pause_frames_{way}", f"{'xoff' if pausing else 'xon'}_frames_{way}"):
            setattr(self, name, getattr(self, name) + 1)
    paused_s: float = 0.0
    ce_marked_packets: int = 0


@dataclass
class Port:
    """An egress port whose queues the engine reads or gates: a switch's, or a GPU
    host's NIC (then `netns_pid` names the host's namespace)."""
    device: str
    dpid: int
    port: int
    intf: str
    rate_mbps: float
    feeders: list[int]
    peer: tuple[str, int] | None = None
    netns_pid: int | None = None
    ifindex: int | None = None
    nl: tcnl.Netlink | None = None
    kick_sock: socket.socket | None = None
    pfc_sock: socket.socket | None = None


class CongestionControl(app_manager.OSKenApp):
    OFP_VERSIONS = [ofproto_v1_5.OFP_VERSION]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        conf = cfg.CONF.fabriclab
        self.fabric = Fabric.load(conf.congestion_fabric_file or conf.fabric_file)
        self.config_file = Path(conf.congestion_file) if conf.congestion_file else None
        self.config = CongestionConfig()
        self.config_mtime = 0
        self.ports = self._ports()
        self.host_names = {h.name for h in self.fabric.hosts}
        self.datapaths: dict[int, object] = {}
        self.marking: set[tuple[str, int]] = set()
        self.xoff_sent: dict[tuple[str, int, int], float] = {}   # port, prio -> last pause
        self.gates: dict[tuple[str, int, int], dict] = {}     # closed gates
        self.host_ports: dict[tuple[str, int], Port] = {}
        self.unacked: list | None = None   # gate changes sent, not yet acknowledged
        self.counters: dict[tuple[str, int, int], PortCounters] = {}
        self.watchdog: list[dict] = []
        self.gaps = GapHistogram()
        self.pending_events: list[str] = []   # written out by the writer thread
        # os-ken's native hub: OpenFlow events and the sampling loop are threads
        self.lock = threading.RLock()
        self.write_lock = threading.Lock()
        self.gate_nl = tcnl.Netlink()
        self.table: dataplane.PortTable | None = None     # the data path's, once attached
        self.ring = None
        self.slots = dataplane.slots(self.fabric)
        self.slot_of = {(s.node, s.port): i for i, s in enumerate(self.slots)}
        self.reaction = {"signal": GapHistogram(), "pause": GapHistogram()}
        # (ingress, priority) -> (its decision count, since when) while its last PFC
        # frame disagrees with its flag (follow_xoff)
        self.disagreed: dict[tuple[str, int, int], tuple[int, float]] = {}
        # XOFF (switch, port, prio) -> when, and the gates still to close
        self.pausing: dict[tuple[str, int, int], tuple[float, set]] = {}
        self.headroom: dict[tuple[str, int], dict] = {}   # egress port -> needed, kept
        # slot, prio -> (excess, bytes seen leaving) at the last clean look
        self.excess: dict[tuple[int, int], tuple[int, int]] = {}
        if self.config_file:
            self.event_log = open(self.config_file.with_name(EVENTS_FILE), "a")
            self.threads.append(hub.spawn(self.loop))
            self.threads.append(hub.spawn(self.writer))

    def _ports(self) -> dict[tuple[str, int], Port]:
        dpid = {s.name: s.dpid for s in self.fabric.switches}
        out = {}
        for sw, port, intf, rate in queues.switch_ports(self.fabric):
            peers = self.fabric.switch_ports(sw)
            feeders = sorted(p for p in peers if p != port)
            out[(sw, port)] = Port(sw, dpid[sw], port, intf, rate, feeders, peers[port])
        return out

    def host_port(self, host: str, port: int, rate_mbps: float) -> Port | None:
        """A GPU host's NIC port, with a netlink socket in its namespace (made once)."""
        key = (host, port)
        if key not in self.host_ports:
            pid = self.config.host_pids.get(host)
            if pid is None:
                return None
            intf = interface_name(host, port)
            p = Port(host, 0, port, intf, rate_mbps, [], netns_pid=pid)
            p.nl = tcnl.Netlink(netns.socket_in_netns(pid, socket.SOCK_RAW, tcnl.NETLINK_ROUTE,
                                                      family=socket.AF_NETLINK))
            p.ifindex = netns.ifindex_in_netns(pid, intf)
            self.host_ports[key] = p
        return self.host_ports[key]

    def port_of(self, device: str, port: int) -> Port:
        return self.ports.get((device, port)) or self.host_ports[(device, port)]

    # --- OpenFlow events ------------------------------------------------------------
    @set_ev_cls(ofp_event.EventOFPStateChange, [MAIN_DISPATCHER, DEAD_DISPATCHER])
    @logged
    def state_change(self, ev):
        dp = ev.datapath
        if ev.state == MAIN_DISPATCHER:
            self.datapaths[dp.id] = dp
        else:
            self.datapaths.pop(dp.id, None)

    @set_ev_cls(ofp_event.EventOFPBarrierReply, MAIN_DISPATCHER)
    @logged
    def programmed(self, ev):
        """The router programmed a switch that connected (its flows were replaced; a
        reroute changes routes in place and leaves this rule): pause frames go where
        the mode wants them again."""
        self.pause_frames_flow(ev.msg.datapath, self.config.dataplane)

    def pause_frames_flow(self, dp, drop: bool) -> None:
        """With the data path, a switch port's ingress program honours pause frames
        and drops them, but OVS's userspace datapath reads the port through an
        AF_PACKET socket, a tap that sees every frame before that program runs: OVS
        would send each one here as a packet-in (measured: 97 a second in the PFC
        incast, a quarter of this app's CPU). So they are dropped in the switch too,
        above the router's rule that sends them here for the sampling mode."""
        ofp, parser = dp.ofproto, dp.ofproto_parser
        match = parser.OFPMatch(eth_type=MAC_CONTROL_ETHERTYPE)
        if drop:
            dp.send_msg(parser.OFPFlowMod(dp, priority=PRIORITY_PAUSE_DROP, match=match,
                                          instructions=[]))
        else:
            dp.send_msg(parser.OFPFlowMod(dp, command=ofp.OFPFC_DELETE_STRICT,
                                          priority=PRIORITY_PAUSE_DROP, match=match,
                                          out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY))

    @set_ev_cls(ofp_event.EventOFPPacketIn, MAIN_DISPATCHER)
    @logged
    def packet_in(self, ev):
        msg = ev.msg
        if self.config.dataplane or not pause.is_mac_control(msg.data):
            return      # with the data path, the port's ingress program signals the frame
        sw = next((s.name for s in self.fabric.switches if s.dpid == msg.datapath.id), None)
        port = self.ports.get((sw, msg.match["in_port"]))
        quanta = pause.parse(msg.data)
        if port is None or quanta is None:
            return
        with self.lock:
            now = time.time()
            for prio, q in quanta.items():
                self.count(port, prio).count_frame("received", bool(q))
                if q:
                    until = now + q * pause.quantum_s(port.rate_mbps * 1e6)
                    self.close_gate(port, prio, until, now)
                else:
                    self.open_gate(port, prio, now)

    @set_ev_cls(ofp_event.EventOFPFlowRemoved, MAIN_DISPATCHER)
    @logged
    def flow_removed(self, ev):
        msg = ev.msg
        if msg.cookie >> 16 != MARK_COOKIE:
            return
        sw = next(s.name for s in self.fabric.switches if s.dpid == msg.datapath.id)
        port = self.ports[(sw, msg.cookie & 0xFFFF)]
        with self.lock:
            self.count(port, PRIORITY_ROCE_DATA).ce_marked_packets += msg.stats["packet_count"]

    # --- the sampling loop ------------------------------------------------------------
    def loop(self):
        dump = tcnl.Netlink()
        last_step = last_reconcile = 0.0
        tick = time.monotonic()
        while True:
            try:
                with self.lock:
                    self.reload()
                    now = time.time()
                    if self.config.sampling:
                        if last_step:
                            self.gaps.add(now - last_step)
                        last_step = now
                        self.step(dump.qdiscs(), now)
                    else:
                        last_step = 0.0
                    if self.table is not None:
                        if now - last_reconcile >= RECONCILE_S:
                            last_reconcile = now
                            self.reconcile(dump)
                        self.follow_flags()
                    self.expire_gates(now)
            except Exception:   # keep the switches' congestion handling alive; say why
                self.logger.exception("congestion loop")
            # A fixed cadence (not a sleep after the work): a sample every sample_ms.
            tick = max(tick + (self.config.sample_ms / 1000 if self.config.sampling
                               else IDLE_POLL_S), time.monotonic())
            hub.sleep(max(0.0, tick - time.monotonic()))

    def step(self, stats: list[tcnl.QdiscStats], now: float) -> None:
        """One sample: every switch port's gated classes (each priority's backlog)."""
        gates = {tcnl.handle(queues.gate_major(prio)): prio for prio in range(8)}
        backlog = {(q.ifindex, gates[q.handle]): q.backlog_bytes for q in stats
                   if q.handle in gates}
        c = self.config
        for port in self.ports.values():
            if port.ifindex is None:
                try:
                    port.ifindex = socket.if_nametoindex(port.intf)
                except OSError:
                    continue
            b = backlog.get((port.ifindex, PRIORITY_ROCE_DATA))
            if c.ecn == "controller" and b is not None:
                self.mark(port, random.random() < mark_probability(c, b), b)
            for prio, (xoff, xon) in c.thresholds.items():
                b = backlog.get((port.ifindex, prio))
                if b is not None:
                    self.pfc(port, prio, xoff, xon, b, now)

    def pfc(self, port: Port, prio: int, xoff: int, xon: int, backlog: int,
            now: float) -> None:
        key = (port.device, port.port, prio)
        c = self.config
        last = self.xoff_sent.get(key)
        refresh_s = c.pause_quanta * pause.quantum_s(port.rate_mbps * 1e6) / 2
        if last is None and backlog >= xoff:
            self.send_pfc(port, prio, c.pause_quanta)
            self.xoff_sent[key] = now
            self.event("xoff", port, prio=prio, backlog=backlog)
        elif last is not None and backlog <= xon:
            self.send_pfc(port, prio, 0)
            del self.xoff_sent[key]
            self.event("xon", port, prio=prio, backlog=backlog)
        elif last is not None and now - last >= refresh_s:
            self.send_pfc(port, prio, c.pause_quanta)
            self.xoff_sent[key] = now

    def send_pfc(self, congested: Port, prio: int, quanta: int) -> None:
        """A PFC frame for `prio` to what fills `congested`'s accounting: with the data
        path, the port's own neighbour (accounting per ingress port); sampled, every
        neighbour that can feed the port's queue."""
        if self.config.dataplane:
            self.send_pfc_on_wire(congested, prio, quanta)
            return
        dp = self.datapaths.get(congested.dpid)
        if dp is None:
            return
        ofp, parser = dp.ofproto, dp.ofproto_parser
        now = time.time()
        self.unacked = []      # the hosts' gates change together, acknowledged after
        for f in congested.feeders:
            frame = pause.pfc_frame(pause.port_mac(congested.dpid, f), {prio: quanta})
            dp.send_msg(parser.OFPPacketOut(dp, buffer_id=ofp.OFP_NO_BUFFER,
                                            match=parser.OFPMatch(in_port=ofp.OFPP_CONTROLLER),
                                            actions=[parser.OFPActionOutput(f)], data=frame))
            out = self.ports[(congested.device, f)]
            self.count(out, prio).count_frame("sent", bool(quanta))
            if out.peer[0] in self.host_names:
                self.host_mac_honours(out, prio, quanta, now)
        unacked, self.unacked = self.unacked, None
        for nl, seq in unacked:
            nl.wait(seq)

    def host_mac_honours(self, out: Port, prio: int, quanta: int, now: float) -> None:
        """A GPU host's NIC stops sending the paused priority in its MAC, at once, as
        hardware does (links have no delay: the frame arrives as it is sent); its
        transport, slower, also stops scheduling that priority when it reads the
        frame (traffic/nic.py), and meanwhile its small FIFO pushes back on it."""
        host = self.host_port(out.peer[0], out.peer[1], out.rate_mbps)
        if host is None:
            return
        if quanta:
            until = now + quanta * pause.quantum_s(out.rate_mbps * 1e6)
            self.close_gate(host, prio, until, now)
        else:
            self.open_gate(host, prio, now)

    # --- the data path: its policy and its signals -------------------------------------
    def open_dataplane(self) -> None:
        if self.table is not None:
            return
        self.table = dataplane.PortTable.open(self.fabric)
        self.ring = dataplane.open_events()
        self.threads.append(hub.spawn(self.signals))

    def apply_dataplane(self, c: CongestionConfig, lossless: dict[int, tuple[int, int]]) -> None:
        """ECN marking and the PFC thresholds of every switch port, into the table."""
        mask = 1 << PRIORITY_ROCE_DATA if c.ecn == "bpf" else 0
        q = queue_params(c)
        self.headroom = {}
        for key, port in self.ports.items():
            slot = self.slot_of[key]
            packet_ns = int(queues.AVERAGE_PACKET_BYTES * 8e3 / port.rate_mbps)
            self.table.set_ecn(slot, mask, c.kmin_bytes, c.kmax_bytes, c.pmax, c.red_wlog,
                               packet_ns)
            for prio in range(8):
                xoff, xon = lossless.get(prio, (0, 0))
                headroom = self.headroom_bytes(port, prio, q.buffer_bytes(prio), c) \
                    if xoff else 0
                self.table.set_pfc(slot, prio, xoff, xon, headroom, c.pfc_alpha)
                if not xoff:
                    self.table.clear_xoff(slot, prio)
            self.table.set_trim(slot, PRIORITY_ROCE_DATA, c.trim_bytes, c.trim_dscp)
            self.table.set_pause_quanta(slot, c.pause_quanta)

    def headroom_bytes(self, port: Port, prio: int, limit: int, c: CongestionConfig) -> int:
        """What `port`'s queue keeps for the frames its feeders send after being told
        to pause: per feeding port, 2 x (link delay + response) x its rate + 2 MTU (the
        links have no delay here). When the buffer cannot hold it all, two frames'
        worth is left shared, and the shortfall is said: PFC may lose frames there."""
        needed = sum(queues.pfc_headroom_bytes(self.ports[(port.device, f)].rate_mbps,
                                               c.pfc_response_ms) for f in port.feeders)
        kept = min(needed, max(0, limit - 2 * queues.MAX_FRAME_BYTES))
        self.headroom[(port.device, port.port)] = {"priority": prio, "needed_bytes": needed,
                                                   "kept_bytes": kept, "limit_bytes": limit}
        if kept < needed:
            self.logger.warning("PFC headroom short on %s port %d priority %d: its %d "
                                "feeding ports need %.1f KB (response %.2f ms), the buffer "
                                "holds %.1f KB: frames may be lost there", port.device,
                                port.port, prio, len(port.feeders), needed / 1024,
                                c.pfc_response_ms, limit / 1024)
        return kept

    def signals(self):
        """What the port programs signal, as it comes when it needs this app (a pause
        frame arrived: a gate to close; a PFC frame nobody could send), else in batches
        (decisions the data path carried out: the log, the pause refreshes); then each
        port a decision touched made to follow its flag once (follow_xoff)."""
        while True:
            try:
                wait_readable(self.ring, IDLE_POLL_S)
                records = self.ring.records()
                with self.lock:
                    now = time.time()
                    mono_ns = time.monotonic_ns()
                    touched: dict[tuple[str, int, int], tuple[Port, float, bool]] = {}
                    for raw in records:
                        e = dataplane.parse_event(raw)
                        seen = now - (mono_ns - e["t_ns"]) / 1e9
                        port = self.on_signal(e, now, seen)
                        if port is not None:
                            key = (port.device, port.port, e["prio"])
                            unsent = not e["sent"] or touched.get(key, (0, 0, False))[2]
                            touched[key] = (port, seen, unsent)
                    for (_, _, prio), (port, seen, unsent) in touched.items():
                        self.follow_xoff(port, prio, now, seen, at_once=unsent)
                    self.refresh_pauses(now)
            except Exception:   # keep the switches' congestion handling alive; say why
                self.logger.exception("data path signals")

    def on_signal(self, e: dict, now: float, seen: float) -> Port | None:
        """seen: when the program saw the packet (wall clock). An XOFF or XON is logged
        as decided; returns the ingress port it decided for."""
        s = self.slots[e["slot"]]
        if e["kind"] == dataplane.EV_PAUSE_RX or not e["sent"]:
            self.reaction["signal"].add(now - seen)     # what waited for this app
        if e["kind"] == dataplane.EV_PAUSE_RX:
            port = self.ports.get((s.node, s.port)) or self.host_port(s.node, s.port,
                                                                      self.link_rate(s))
            if port is None:
                return None
            for prio in range(8):
                if not e["value"] >> prio & 1:
                    continue
                q = e["quanta"][prio]
                if q:
                    self.close_gate(port, prio, now + q * pause.quantum_s(port.rate_mbps * 1e6),
                                    now)
                    self.gate_closed_for(s, prio, time.time())
                else:
                    self.open_gate(port, prio, now)
            return None
        # XOFF / XON for what arrives on this switch port (an ingress), decided as a
        # frame entered or left one of the switch's queues (`queue`)
        port = self.ports[(s.node, s.port)]
        queue = self.slots[e["queue"]].port if e["queue"] < len(self.slots) else None
        self.pending_events.append(decision_line(
            seen, "xoff" if e["kind"] == dataplane.EV_XOFF else "xon", port.device, port.port,
            e["prio"], e["value"], e["threshold"], queue, e["sent"]))
        return port

    def follow_xoff(self, port: Port, prio: int, now: float, seen: float | None = None,
                    signal: str | None = None, at_once: bool = False, **detail) -> None:
        """Make the PFC frames `port` sends for `prio` say what the data path's XOFF
        flag for it says now. The programs send most frames themselves, as they decide;
        user space sends what they could not (an XON decided on a host's end of a link:
        another namespace than the switch's ports), and catches up where the last frame
        on the wire (the port's egress program notes it) disagrees with the flag: two
        decisions on two CPUs at once may send, or signal, in the other order. A frame
        the data path is still sending (the PFC sender takes ~0.1 ms to wake) looks the
        same for a moment: such a disagreement is acted on once it lasted, with no new
        decision, RESYNC_S, or `at_once` (the data path said nobody sent it).
        `signal`: a decision made here ("xoff", "xon"), logged, its frame sent at once."""
        key = (port.device, port.port, prio)
        slot = self.slot_of[(port.device, port.port)]
        if signal:
            self.event(signal, port, prio=prio, t=seen, **detail)
        xoff = self.table.xoff(slot, prio)
        if xoff != self.table.wire_xoff(slot, prio):
            decided = self.table.decisions(slot, prio)
            since = self.disagreed.get(key)
            if since is None or since[0] != decided:
                since = self.disagreed[key] = (decided, now)
            if at_once or signal or now - since[1] >= RESYNC_S:
                self.disagreed.pop(key, None)
                self.send_pfc(port, prio, self.config.pause_quanta if xoff else 0)
                if signal != ("xoff" if xoff else "xon"):
                    self.event("xoff" if xoff else "xon", port, prio=prio, caught_up=True)
        else:
            self.disagreed.pop(key, None)
        if xoff and key not in self.xoff_sent:
            # (a GPU agent's transport stops by itself: no gate to wait for)
            # (a stub's far end, on another machine, is that machine's to close)
            peer = self.slot_of[port.peer]
            if not self.slots[peer].stub and not self.table.nic_honours(peer, prio):
                self.pausing[key] = (seen or now, {port.peer})
            self.xoff_sent[key] = now
        elif not xoff:
            self.xoff_sent.pop(key, None)

    def reconcile(self, nl: tcnl.Netlink) -> None:
        """Each switch queue's backlog as the data path counts it, against the kernel's:
        bytes it still counts that the kernel no longer holds, at two looks in a row
        with nothing seen leaving between them, left unseen: a queue flushed as its
        link went down, or the peer's program gone with its namespace. They are written
        off (what ingress ports held of them: reconcile_held). While frames still reach
        the peer, what the kernel no longer holds may be on its way: on a software CPU
        a full queue's frames in flight can outlast two looks, and written off, the
        program would count the queue short and admit frames the kernel then drops
        (as two CPUs queueing at once did before the program's admission was made one
        atomic step: dataplane.bpf.c's reserve). A look counts
        only if nothing entered the queue while the kernel was asked (what arrives in
        between would read as excess: measured, 2-5 KB under the incast)."""
        gates = {tcnl.handle(queues.gate_major(prio)): prio for prio in range(8)}
        arrived = {(slot, prio): self.table.in_bytes(slot, prio)
                   for slot in self.slot_of.values() for prio in range(8)}
        kernel = {(q.ifindex, gates[q.handle]): q.backlog_bytes for q in nl.qdiscs()
                  if q.handle in gates}
        lossless = self.config.thresholds
        for key, port in self.ports.items():
            slot = self.slot_of[key]
            if port.ifindex is None:
                try:
                    port.ifindex = socket.if_nametoindex(port.intf)
                except OSError:
                    continue
            for prio in range(8):
                k = kernel.get((port.ifindex, prio))
                if k is None:
                    continue
                if self.table.in_bytes(slot, prio) != arrived[(slot, prio)]:
                    self.excess.pop((slot, prio), None)    # not a clean look: start over
                    continue
                excess = self.table.backlog_bytes(slot, prio) - k
                left = self.table.out_bytes(slot, prio)
                last = self.excess.get((slot, prio))
                self.excess[(slot, prio)] = (excess, left)
                if last is None or last[1] != left:    # still reaching the peer
                    continue
                gone = min(last[0], excess)
                if gone <= RECONCILE_SLACK_BYTES:
                    continue
                self.table.write_off(slot, prio, gone)
                self.excess[(slot, prio)] = (excess - gone, left)
                self.count(port, prio).written_off_bytes += gone
                self.event("written_off", port, prio=prio, bytes=gone)
        for prio in lossless:
            self.reconcile_held(prio, arrived)

    def follow_flags(self) -> None:
        """Every port's PFC frames as its flags say (a signal lost to a full ring, or a
        frame the PFC sender did not send: caught up)."""
        now = time.time()
        for prio in self.config.thresholds:
            for port in self.ports.values():
                self.follow_xoff(port, prio, now)

    def reconcile_held(self, prio: int, arrived: dict[tuple[int, int], int]) -> None:
        """What a switch's ingress ports hold waits in its queues: with every queue of
        the switch empty (and nothing queued since `arrived` was read), what they still
        hold left unseen (a frame charged twice, a queue flushed) and is written off;
        an XOFF it was holding up is resumed."""
        by_switch: dict[str, list[int]] = {}
        for (sw, _), slot in ((k, self.slot_of[k]) for k in self.ports):
            by_switch.setdefault(sw, []).append(slot)
        for sw, slots in by_switch.items():
            stale = {slot: self.table.held_bytes(slot, prio) for slot in slots}
            if not any(stale.values()) or any(
                    self.table.backlog_bytes(slot, prio) for slot in slots) or any(
                    self.table.in_bytes(slot, prio) != arrived[(slot, prio)] for slot in slots):
                continue
            for slot, held in stale.items():
                if not held:
                    continue
                self.table.write_off_held(slot, prio, held)
                port = self.ports[(sw, self.slots[slot].port)]
                self.count(port, prio).written_off_bytes += held
                self.event("held_written_off", port, prio=prio, bytes=held)
                self.table.clear_xoff(slot, prio)
                self.follow_xoff(port, prio, time.time(), signal="xon", held=0)

    def gate_closed_for(self, s: dataplane.Slot, prio: int, t: float) -> None:
        """The reaction: from an ingress passing XOFF to the upstream gate closed."""
        for key, (since, waiting) in list(self.pausing.items()):
            if key[2] == prio and (s.node, s.port) in waiting:
                waiting.discard((s.node, s.port))
                if not waiting:
                    self.reaction["pause"].add(t - since)
                    del self.pausing[key]

    def link_rate(self, s: dataplane.Slot) -> float:
        ln = next(ln for ln in self.fabric.links if (ln.a, ln.a_port) == (s.node, s.port)
                  or (ln.b, ln.b_port) == (s.node, s.port))
        return ln.rate_mbps

    def refresh_pauses(self, now: float) -> None:
        """A queue still above XON renews its pause before the last one runs out."""
        c = self.config
        for (sw, p, prio), last in list(self.xoff_sent.items()):
            port = self.ports[(sw, p)]
            if now - last >= c.pause_quanta * pause.quantum_s(port.rate_mbps * 1e6) / 2:
                self.send_pfc(port, prio, c.pause_quanta)
                self.xoff_sent[(sw, p, prio)] = now

    def send_pfc_on_wire(self, out: Port, prio: int, quanta: int) -> None:
        """The frame out of the ingress port's veth, where the neighbour's MAC (its
        ingress program) takes it in; counted by this port's egress program."""
        if out.pfc_sock is None:
            out.pfc_sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
            out.pfc_sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, HTB_DIRECT_PRIORITY)
            out.pfc_sock.bind((out.intf, 0))
        try:
            out.pfc_sock.send(pause.pfc_frame(pause.port_mac(out.dpid, out.port), {prio: quanta}))
        except OSError as e:    # a link down: nothing upstream to pause
            self.logger.debug("PFC frame out of %s: %s", out.intf, e)

    def dataplane_counters(self) -> dict[tuple[str, int, int], dict]:
        """The programs' counts of PFC frames, CE marks and trimmed frames, per port and
        priority."""
        out = {}
        for i, s in enumerate(self.slots):
            for prio, counts in enumerate(self.table.pfc_and_marks(i)):
                if not any(counts):
                    continue
                tx_pause, tx_resume, rx_pause, rx_resume, ce, trimmed = counts
                out[(s.node, s.port, prio)] = {
                    "pause_frames_sent": tx_pause + tx_resume,
                    "pause_frames_received": rx_pause + rx_resume,
                    "xoff_frames_sent": tx_pause, "xon_frames_sent": tx_resume,
                    "xoff_frames_received": rx_pause, "xon_frames_received": rx_resume,
                    "ce_marked_packets": ce, "trimmed_packets": trimmed}
        return out

    # --- gates: this switch honouring a pause on one of its egress ports --------------
    def close_gate(self, port: Port, prio: int, until: float, now: float) -> None:
        key = (port.device, port.port, prio)
        if key in self.gates:
            self.gates[key]["until"] = until
            return
        self.set_gate(port, prio, queues.PAUSED_RATE_BYTES_S)
        self.gates[key] = {"since": now, "until": until, "watchdog": False}
        self.event("gate_close", port, prio=prio)

    def open_gate(self, port: Port, prio: int, now: float) -> None:
        g = self.gates.pop((port.device, port.port, prio), None)
        if g is None:
            return
        self.set_gate(port, prio, queues.gate_rate_bytes_s(port.rate_mbps))
        self.kick(port)
        self.count(port, prio).paused_s += now - g["since"]
        self.event("gate_open", port, prio=prio, paused_s=round(now - g["since"], 6))

    def kick(self, port: Port) -> None:
        """Make the port's qdisc dequeue again. A tbf that was throttled at 1 B/s has
        its wake-up timer set ~1000 s ahead, and a rate change does not move it; the
        queue drains at once only if something new is enqueued on the device. Upstream
        may be paused by this very queue (nothing will come), so send a frame the
        neighbour discards (a broadcast of the local experimental EtherType: no flow
        matches it on a switch, no protocol takes it on a host)."""
        if port.kick_sock is None:
            make = (lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))
            port.kick_sock = netns.in_netns(port.netns_pid, make) if port.netns_pid else make()
            port.kick_sock.bind((port.intf, 0))
        try:
            port.kick_sock.send(KICK_FRAME)
        except OSError:      # a full queue is already being drained
            pass

    def set_gate(self, port: Port, prio: int, rate_bytes_s: int) -> None:
        if port.ifindex is None:
            port.ifindex = socket.if_nametoindex(port.intf)
        q = queue_params(self.config)
        limit = q.host_buffer_bytes(prio) if port.netns_pid else q.buffer_bytes(prio)
        nl = port.nl or self.gate_nl
        paused = rate_bytes_s == queues.PAUSED_RATE_BYTES_S
        burst = queues.GATE_BURST_BYTES if paused else queues.gate_burst_bytes(port.rate_mbps)
        seq = nl.set_tbf(port.ifindex, tcnl.handle(1, queues.class_minor(prio)),
                         tcnl.handle(queues.gate_major(prio)), rate_bytes_s,
                         burst, limit, wait=self.unacked is None)
        if self.unacked is not None:
            self.unacked.append((nl, seq))

    def expire_gates(self, now: float) -> None:
        for (sw, p, prio), g in list(self.gates.items()):
            port = self.port_of(sw, p)
            if now >= g["until"]:
                self.open_gate(port, prio, now)
            elif not g["watchdog"] and now - g["since"] > self.config.watchdog_ms / 1000:
                g["watchdog"] = True
                report = {"device": sw, "port": p, "priority": prio,
                          "paused_for_s": round(now - g["since"], 3)}
                self.watchdog.append(report)
                self.logger.warning("PFC watchdog: %s port %d priority %d paused for %.0f ms "
                                    "(a pause storm or deadlock?)", sw, p, prio,
                                    (now - g["since"]) * 1e3)
                self.event("watchdog", port, prio=prio)

    # --- CE marking through the egress table ------------------------------------------
    def mark(self, port: Port, on: bool, backlog: int) -> None:
        key = (port.device, port.port)
        if on == (key in self.marking):
            return
        dp = self.datapaths.get(port.dpid)
        if dp is None:
            return
        ofp, parser = dp.ofproto, dp.ofproto_parser
        cookie = MARK_COOKIE << 16 | port.port
        for ect in (Ecn.ECT_0, Ecn.ECT_1):
            match = parser.OFPMatch(reg0=port.port, eth_type=ether.ETH_TYPE_IP, ip_ecn=int(ect))
            if on:
                inst = [parser.OFPInstructionActions(ofp.OFPIT_APPLY_ACTIONS, [
                    parser.OFPActionSetField(ip_ecn=int(Ecn.CE)),
                    parser.OFPActionOutput(port.port)])]
                dp.send_msg(parser.OFPFlowMod(dp, table_id=EGRESS_TABLE, cookie=cookie,
                                              priority=PRIORITY_EGRESS_MARK, match=match,
                                              flags=ofp.OFPFF_SEND_FLOW_REM, instructions=inst))
            else:
                dp.send_msg(parser.OFPFlowMod(dp, table_id=EGRESS_TABLE, cookie=cookie,
                                              cookie_mask=0xFFFFFFFFFFFFFFFF,
                                              command=ofp.OFPFC_DELETE_STRICT,
                                              priority=PRIORITY_EGRESS_MARK, match=match,
                                              out_port=ofp.OFPP_ANY, out_group=ofp.OFPG_ANY))
        if on:
            self.marking.add(key)
        else:
            self.marking.discard(key)
        self.event("mark_on" if on else "mark_off", port, backlog=backlog)

    # --- configuration and reporting -------------------------------------------------
    def reload(self) -> None:
        try:
            mtime = os.stat(self.config_file).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime == self.config_mtime:
            return
        self.config_mtime = mtime
        new = CongestionConfig.read(self.config_file)
        now = time.time()
        if new.ecn != "controller":
            for key in list(self.marking):
                self.mark(self.ports[key], False, 0)
        lossless = new.thresholds      # a priority no longer lossless is resumed
        for (sw, p, prio) in list(self.xoff_sent):
            if prio not in lossless:
                self.send_pfc(self.ports[(sw, p)], prio, 0)
                del self.xoff_sent[(sw, p, prio)]
        for (sw, p, prio) in list(self.gates):
            if prio not in lossless:
                self.open_gate(self.port_of(sw, p), prio, now)
        if new.realtime != self.config.realtime:
            self.realtime(new.realtime)
        if new.dataplane:
            self.open_dataplane()
            self.apply_dataplane(new, lossless)
        if new.dataplane != self.config.dataplane:
            for dp in list(self.datapaths.values()):
                self.pause_frames_flow(dp, new.dataplane)
        self.config = new
        self.logger.info("congestion configuration %d: %s", new.version, asdict(new))
        self.write_state(self.state())   # at once: the lab waits for this version

    def sampling(self) -> dict:
        """How punctual the queue sampling was: the gaps between samples."""
        return {"target_ms": self.config.sample_ms, **self.gaps.summary()}

    def realtime(self, on: bool) -> None:
        """While ECN or PFC is on, every thread of the controller runs SCHED_FIFO: a
        switch's congestion logic is hardware, never late, and here it competes with
        every GPU agent for two cores (measured at normal priority: a resume storm
        delayed the queue sampling 5-8 ms, long enough to overflow the headroom; with
        only the sampling thread raised it still waited behind OpenFlow threads holding
        the interpreter lock: priority inversion). Its threads block on sockets and
        sleep between samples. Off again when idle, and never while the fabric is
        being built. (On Ryu's eventlet hub all green threads share one OS thread:
        there it stays at normal priority.)

        Its heap is frozen too: Python's full garbage collection walks every object
        (os-ken and its imports: 83k, 10.5 ms here), a sampling gap long enough to
        overflow the headroom (a test-suite run: gap max 11.5 ms, 7 drops with
        ECN+PFC). Frozen objects are never walked again (a full collection: 0.05 ms)."""
        if on:
            gc.collect()
            gc.freeze()
        if getattr(hub, "HUB_TYPE", "eventlet") != "native":
            return
        policy = os.SCHED_FIFO if on else os.SCHED_OTHER
        param = os.sched_param(REALTIME_PRIORITY if on else 0)
        try:
            for tid in os.listdir("/proc/self/task"):
                os.sched_setscheduler(int(tid), policy, param)
        except OSError as e:
            self.logger.warning("congestion handling at normal priority (%s)", e)

    def count(self, port: Port, prio: int) -> PortCounters:
        return self.count_key((port.device, port.port, prio))

    def count_key(self, key: tuple[str, int, int]) -> PortCounters:
        return self.counters.setdefault(key, PortCounters())

    def event(self, kind: str, port: Port, t: float | None = None, **more) -> None:
        self.pending_events.append(json.dumps({"t": t or time.time(), "event": kind,
                                               "device": port.device, "port": port.port, **more}))

    def writer(self):
        """Every STATE_EVERY_S: the new events and the counters out to their files. Not
        in the sampling loop: a disk write can block for milliseconds, and the sampling
        must not wait (a late pause overflows the headroom)."""
        while True:
            try:
                with self.lock:
                    events, self.pending_events = self.pending_events, []
                    state = self.state()
                if events:
                    self.event_log.write("\n".join(events) + "\n")
                    self.event_log.flush()
                self.write_state(state)
            except Exception:
                self.logger.exception("congestion state writer")
            hub.sleep(STATE_EVERY_S)

    def write_state(self, state: dict) -> None:
        with self.write_lock:   # the writer thread, or a reload in the sampling loop
            write_state(self.config_file.parent, state)

    def state(self) -> dict:
        now = time.time()
        counters = {}
        wire = self.dataplane_counters() if self.config.dataplane and self.table else {}
        for key in wire:
            self.count_key(key)
        for (sw, p, prio), c in self.counters.items():
            d = {**vars(c), **wire.get((sw, p, prio), {})}     # (asdict: 10x slower)
            g = self.gates.get((sw, p, prio))
            if g:   # a gate still closed counts its time so far
                d["paused_s"] += now - g["since"]
            counters.setdefault(f"{sw}:{p}", {})[str(prio)] = d
        return {"version": self.config.version, "t": now, "counters": counters,
                "marking": sorted(f"{sw}:{p}" for sw, p in self.marking),
                "gates_closed": sorted(f"{sw}:{p}:{prio}" for sw, p, prio in self.gates),
                "xoff": sorted(f"{sw}:{p}:{prio}" for sw, p, prio in self.xoff_sent),
                "watchdog": self.watchdog, "sampling": self.sampling(),
                "headroom": {f"{sw}:{p}": h for (sw, p), h in self.headroom.items()},
                "reaction": {"signal": self.reaction["signal"].summary(),
                             "pause": self.reaction["pause"].summary()}}


def decision_line(t: float, kind: str, device: str, port: int, prio: int, held: int,
                  threshold: int, queue: int | None, sent: bool) -> str:
    """An XOFF or XON the data path decided, as the event log's JSON line (what
    CongestionControl.event writes). Formatted directly: ~1100 decisions a second in the
    incast, and json.dumps of a dict per decision was a third of the app's CPU there."""
    return (f'{{"t": {t!r}, "event": "{kind}", "device": "{device}", "port": {port}, '
            f'"prio": {prio}, "held": {held}, "threshold": {threshold}, '
            f'"queue": {"null" if queue is None else queue}, '
            f'"sent": {"true" if sent else "false"}}}')


class GapHistogram:
    """The gaps between samples in 0.1 ms bins: quantiles at any time for the cost of
    the bins, not of sorting every gap (2.9 ms for 20000: a sample late every time)."""
    BIN_S = 1e-4

    def __init__(self):
        self.bins: collections.Counter[int] = collections.Counter()
        self.count = 0
        self.max_s = 0.0

    def add(self, gap_s: float) -> None:
        self.bins[round(gap_s / self.BIN_S)] += 1
        self.count += 1
        self.max_s = max(self.max_s, gap_s)

    def quantile_ms(self, q: float) -> float:
        seen = 0
        for b in sorted(self.bins):
            seen += self.bins[b]
            if seen >= q * self.count:
                return round(b * self.BIN_S * 1e3, 3)
        return 0.0

    def summary(self) -> dict:
        return {"samples": self.count, "gap_ms_p50": self.quantile_ms(0.5),
                "gap_ms_p99": self.quantile_ms(0.99), "gap_ms_p999": self.quantile_ms(0.999),
                "gap_ms_max": round(self.max_s * 1e3, 3)}


def wait_readable(f, timeout_s: float) -> None:
    """Until f has something to read, or timeout_s. On Ryu's eventlet hub every green
    thread shares one OS thread: a plain select() there would stall them all."""
    if getattr(hub, "HUB_TYPE", "eventlet") == "native":
        select.select([f], [], [], timeout_s)
        return
    from eventlet.hubs import trampoline
    try:
        trampoline(f.fileno(), read=True, timeout=timeout_s, timeout_exc=TimeoutError)
    except TimeoutError:
        pass
