"""An MRC-style (Multipath Reliable Connection) transport: spraying, selective
repeat, entropy-value health, congestion control at both ends.

Wire format (see traffic/constants.py and traffic/wireshark/fabriclab_mrc.lua):
every data packet is a self-describing RDMA WRITE ONLY WITH IMMEDIATE (its own
VA in the RETH; immediate = message id << 16 | packets in the message), sent on
an entropy value (EV: the UDP source port) of its own, so the fabric's ECMP
spreads one QP over every path. The receiver places packets as they come, in
any order, and answers each with a selective ACK (cumulative PSN + 64-bit
bitmap, the EV it came on, an ECN echo, and a credit: how far the sender may go),
sent back on that same EV so that the SACKs are sprayed too.

A switch that trims a packet instead of dropping it (lab/kernel/dataplane.bpf.c) sends
its headers on; the receiver answers those with a NACK naming the packet (MRC's
TRIM NACK), and the sender resends it at once: a loss repaired in a round trip.

Sender: a packet is lost once `reorder_packets` packets sent after it were
acknowledged, when a NACK says it was trimmed, or when its retransmit timer fires (the timeout follows the measured
round trip: srtt + max(4 rttvar, `rto_ms`), RFC 6298's estimator with Linux's floor on
the variation term, and `initial_rto_ms` before the first sample; samples only from
packets sent once, as Karn's algorithm says; the times in ms, this margin among them,
are chosen for 10 Mb/s links and stretch on slower ones: link_time_stretch); only lost
packets are resent, on another EV. An EV whose packets keep getting lost is assumed
bad (MRC's EV states: good, assumed_bad, probing, denied), probed out of band after a
while (a probe frame on it, answered by the receiver on the same EV) and readmitted
when a probe gets through; at least `min_active_evs` stay good. A denied EV
(`deny_evs`, or `deny_ev()` at run time: e.g. one that maps to a failed plane) is
never used nor probed. Each EV keeps the history of its states. The window (packets in
flight) grows by one per window of ACKs and shrinks on ECN echoes, on queueing delay
above a target and on losses, once per RTT (a loss on an EV whose previous packet was
lost too points at the path, not the queue: retiring the EV answers it, the window
stays); the receiver's credit caps it too (what tames incast: the receiver sizes the
credit). When nothing new may go, a packet that a later one passed is lost after
`tail_loss_srtts` smoothed RTTs and the receiver's SACK delay (RACK's time rule).

Multi-plane (`planes`: the Paths of planes 1, 2, ... to the same peer): each EV exists
on every plane, with that plane's addresses; the NIC asks each of its ports in turn for
a frame (traffic/nic.py) and the QP gives it a packet on one of that plane's usable EVs;
a lost packet is resent on another plane while one has usable EVs, and the answers
(SACK, NACK, probe reply) go back on the plane the packet came on.
"""
from __future__ import annotations

import bisect
import dataclasses
import struct
from dataclasses import dataclass, field

from traffic.constants import (DSCP_ROCE_DATA, EV_FIELD_BITS, EV_TIERS, EXPLICIT_EV_BASE,
                               EXPLICIT_EV_MAX_PATHS, IMMDT_BYTES, MRC_CREQX_BYTES,
                               MRC_IMM_COUNT_BITS, MRC_MAX_PACKETS_PER_MESSAGE,
                               MRC_MESSAGE_ID_MODULUS, MRC_NACK_CODE_TRIMMED, MRC_NACKX_BYTES,
                               MRC_PROBE_FLAG_REPLY, MRC_PROBEX_BYTES, MRC_SACK_BITMAP_BITS,
                               MRC_SACK_FLAG_ECN_ECHO, MRC_SACKX_BYTES, RETH_BYTES, Ecn,
                               Opcode)
from traffic.nscc import Nscc, NsccParams
from traffic.qp import Message, QueuePair, psn_delta
from traffic.rccc import Rccc, RcccParams
from traffic.roce import WRITE_OVERHEAD_BYTES, Framer, Parsed, Path, immdt, reth

_SACKX = struct.Struct("!QHBBI")
_NACKX = struct.Struct("!HBB")
_PROBEX = struct.Struct("!HBB")
_CREQX = struct.Struct("!I")
# The sender's window and the receiver's credit: "window" (the lab's window, a credit
# window from the receiver), "nscc" (Ultra Ethernet's sender window, traffic/nscc.py),
# "rccc" (Ultra Ethernet's paced receiver credit alone, traffic/rccc.py), "nscc+rccc"
CC_MODES = ("window", "nscc", "rccc", "nscc+rccc")
# How a QP delivers messages (UET's delivery modes): "unordered", reliable, each message
# complete as soon as its packets are (MRC's own); "ordered", reliable, a message
# complete only once every one before it is (RC's promise, over the sprayed packets);
# "unreliable", each packet sent once, never acknowledged: a message complete if all its
# packets arrive, else never (datagrams for small messages that may be lost)
DELIVERY_MODES = ("unordered", "ordered", "unreliable")
# A data packet's bytes on the wire besides its payload (RETH and ImmDt on every one)
DATA_OVERHEAD_BYTES = WRITE_OVERHEAD_BYTES + RETH_BYTES + IMMDT_BYTES
LOST = float("inf")                 # an in-flight packet's send time once it is declared lost
EXT_BYTES = {Opcode.MRC_SACK: MRC_SACKX_BYTES, Opcode.MRC_NACK: MRC_NACKX_BYTES,
             Opcode.MRC_PROBE: MRC_PROBEX_BYTES, Opcode.MRC_CREDIT_REQUEST: MRC_CREQX_BYTES}                          # for roce.parse
# The link rate MRC's times (the timer's margin, the delay that counts as congestion, the
# SACK coalescing delay, the probe's wait, the credit pool's activity window) were chosen
# at: the experiments' default links (10 Mb/s standing for 100 Gb/s). On a slower link a
# packet takes longer, and these stretch with it (link_time_stretch).
TIME_REFERENCE_MBPS = 10.0


def link_time_stretch(line_rate_mbps: float) -> float:
    """How much longer a packet's time is on a link of `line_rate_mbps` than at
    TIME_REFERENCE_MBPS (1 at it or faster, or with no rate given): what MRC's times
    stretch by, so that each stands for as many packets as where it was chosen. (On a
    calibrated slow machine, x0.06: 0.625 Mb/s links, a full 64 KB port took 840 ms to
    drain while the timer's margin stayed 100 ms; the trimming run's senders timed out
    19,916 times on packets still queued or answered.) RC's timer and DCQCN stretch with
    the rate their own way (rc.py, dcqcn.py)."""
    return max(1.0, TIME_REFERENCE_MBPS / line_rate_mbps) if line_rate_mbps > 0 else 1.0


# An EV's states (MRC's): good (carries data), assumed_bad (retired after losses;
# probed out of band now and then), probing (a probe is out), denied (by the user or
# the controller: never used, never probed)
EV_STATES = ("good", "assumed_bad", "probing", "denied")


def generated_evs(fields: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """MRC's generated EV profile: every combination of its fields, (min, max) per tier,
    as EVs (constants.py: field k in bits EV_FIELD_BITS x k above EXPLICIT_EV_BASE); the
    controller maps field k at the k-th switch up to that port."""
    if not 0 < len(fields) <= EV_TIERS or any(
            not 0 <= lo <= hi < EXPLICIT_EV_MAX_PATHS for lo, hi in fields):
        raise ValueError(f"a generated EV profile has 1 to {EV_TIERS} fields, each (min, max) "
                         f"within 0..{EXPLICIT_EV_MAX_PATHS - 1}; got {fields}")
    evs = [EXPLICIT_EV_BASE]
    for k, (lo, hi) in enumerate(fields):
        evs = [ev | v << (EV_FIELD_BITS * k) for v in range(lo, hi + 1) for ev in evs]
    return tuple(evs)


@dataclass
class MrcParams:
    mtu_bytes: int = 1024
    evs: tuple[int, ...] = tuple(range(0xF000, 0xF008))   # MRC's explicit EV profile...
    ev_fields: tuple = ()              # ...or a generated one: per tier (min, max), every
                                       # combination (generated_evs); replaces `evs`
    min_active_evs: int = 2
    reorder_packets: int = 16
    tail_loss_srtts: float = 2.0       # when nothing new may go (a message's tail; the window
                                       # or the credit used up), a packet is lost once one
                                       # sent after it was answered and it waited this many
                                       # smoothed RTTs and the receiver's SACK delay
                                       # (RACK's time rule, RFC 8985): no later
                                       # packets come to pass it, and the retransmit timer
                                       # takes rto_ms at least
    rto_ms: float = 100.0              # the timeout's margin over the smoothed RTT, at least:
                                       # above a busy host's scheduling stalls, or a spurious
                                       # timeout resends what was not lost (a host answering
                                       # in bursts has little variation to go by)
    initial_rto_ms: float = 1000.0     # before the first RTT sample (RFC 6298's 1 s): a host
                                       # slower than the floor must not time its first window out
    init_cwnd_packets: float = 64.0
    min_cwnd_packets: float = 4.0
    max_cwnd_packets: float = 1024.0
    decrease_factor: float = 0.7
    target_delay_ms: float = 5.0       # queueing delay above the base RTT that counts as congestion
    ev_fail_losses: int = 8            # losses on one EV (without a success between) to retire it:
                                       # a dead path loses every packet; a congested one, some
    ev_probe_after_ms: float = 100.0   # an assumed-bad EV is probed this long after
                                       # it was retired (or its last probe went unanswered)
    deny_evs: tuple[int, ...] = ()     # EVs never to use (e.g. those of a failed plane)
    credit_packets: int = 256          # receiver: how far past its cumulative ACK a sender may go
    sack_every_packets: int = 4        # receiver: coalesce SACKs, but answer at once a packet
                                       # that is out of order, CE-marked or ends a message
    sack_delay_ms: float = 5.0         # receiver: what was coalesced is answered this long
                                       # after it arrived at the latest (a sender whose window
                                       # is full waits for it: without the timer, until its RTO)
    credit_budget_packets: int = 64    # receiver: packets in flight it grants all its senders
                                       # together (0: each QP its own credit_packets)
    cc: str = "window"                 # one of CC_MODES. "window": the lab's own (+1 per
                                       # window of ACKs, x decrease_factor on an ECN echo, a
                                       # delay past target_delay_ms or a loss, once per RTT)
                                       # with credit_packets / credit_budget_packets;
                                       # "nscc", "rccc", "nscc+rccc": Ultra Ethernet's
    nscc: dict = field(default_factory=dict)   # NsccParams fields, for cc "nscc"
    rccc: dict = field(default_factory=dict)   # RcccParams fields, for cc "rccc"
    dscp: int = DSCP_ROCE_DATA         # its traffic class (DSCP_EXPRESS: the express class)
    line_rate_mbps: float = 0.0        # the NIC's rate (the agent sets it): NSCC's BDP
    delivery: str = "unordered"        # one of DELIVERY_MODES


class CreditPool:
    """A receiver's credit budget, shared by the senders it is hearing from: with
    N senders at once (incast) each may have budget/N packets in flight, so their
    sum fits the receiver's link buffer instead of overflowing it."""

    ACTIVE_S = 0.05                    # at TIME_REFERENCE_MBPS: a sender heard this
                                       # recently is sending

    def __init__(self, budget_packets: int, min_packets: int = 2, line_rate_mbps: float = 0.0):
        self.budget, self.min = budget_packets, min_packets
        self.active_s = self.ACTIVE_S * link_time_stretch(line_rate_mbps)
        self.heard: dict[int, float] = {}

    def grant(self, qpn: int, now: float) -> int:
        self.heard[qpn] = now
        active = sum(now - t < self.active_s for t in self.heard.values())
        return max(self.min, self.budget // max(1, active))


@dataclass
class EvState:
    port: int
    plane: int = 0                     # the NIC port (plane) it leaves by
    status: str = "good"               # one of EV_STATES
    sent: int = 0
    lost: int = 0
    failures: int = 0                  # losses since the last success
    retired_at: float = 0.0            # when it was assumed bad, or last probed in vain
    retirements: int = 0
    probes: int = 0
    probe_sent_at: float = 0.0
    history: list = field(default_factory=list)   # [ms since the QP's first send, state, why]


@dataclass(slots=True)
class Inflight:
    seq: int
    sent_at: float
    ev: EvState
    tx_index: int
    resent: bool = False   # its answer may be the first sending's: no RTT sample (Karn)


class MrcQP(QueuePair):
    kind = "mrc"

    def __init__(self, path, qpn, remote_qpn, region, params: MrcParams | None = None,
                 credit_pool: CreditPool | None = None, rccc: Rccc | None = None,
                 planes: tuple[Path, ...] = ()):
        """planes: on a multi-plane NIC, the Paths of planes 1, 2, ... to the same peer
        (`path` is plane 0's): the QP sprays over every plane, each EV on each plane."""
        self.params = params or MrcParams()
        self.credit_pool = credit_pool
        self.rccc = rccc                    # the receiving host's credit scheduler (RCCC)
        super().__init__(path, qpn, remote_qpn, region, self.params.mtu_bytes, self.params.dscp)
        p = self.params
        if p.ev_fields:
            p = self.params = dataclasses.replace(
                p, evs=generated_evs(tuple(tuple(f) for f in p.ev_fields)))
        if len(p.evs) < p.min_active_evs:
            raise ValueError(f"{len(p.evs)} EVs is fewer than min_active_evs={p.min_active_evs}")
        if p.cc not in CC_MODES:
            raise ValueError(f"cc must be one of {', '.join(CC_MODES)}, got {p.cc!r}")
        if p.delivery not in DELIVERY_MODES:
            raise ValueError(f"delivery must be one of {', '.join(DELIVERY_MODES)}, got "
                             f"{p.delivery!r}")
        self.reliable = p.delivery != "unreliable"
        stretch = link_time_stretch(p.line_rate_mbps)
        self.rto_margin_s = p.rto_ms / 1000 * stretch
        self.target_delay_s = p.target_delay_ms / 1000 * stretch
        self.sack_delay_s = p.sack_delay_ms / 1000 * stretch
        self.ev_probe_after_s = p.ev_probe_after_ms / 1000 * stretch
        if "rccc" in p.cc and rccc is None:
            raise ValueError(f"cc={p.cc} needs the receiving host's Rccc scheduler")
        # NSCC keeps the window in bytes; self.cwnd (packets) follows it
        self.nscc = Nscc(NsccParams(**p.nscc), p.mtu_bytes, p.line_rate_mbps or 100.0,
                         p.init_cwnd_packets * p.mtu_bytes) if "nscc" in p.cc else None
        # RCCC alone: the credit is the only limit (the window stays at its largest)
        self.fixed_window = p.cc == "rccc"
        # one framer per plane: each plane's frames carry that plane's addresses
        self.data_framers = [self.data_framer] + [Framer(pp, p.dscp, Ecn.ECT_0) for pp in planes]
        self.ctrl_framers = [self.ctrl_framer] + [Framer(pp, p.dscp, Ecn.NOT_ECT)
                                                  for pp in planes]
        self.evs = [EvState(port, plane) for plane in range(len(self.data_framers))
                    for port in p.evs]
        # (EV, plane, state, why), not yet reported
        self.ev_events: list[tuple[int, int, str, str]] = []
        self.t0: float | None = None        # the first send: the EV history's zero
        for ev in self.evs:
            if ev.port in p.deny_evs:
                ev.status = "denied"
        if all(ev.status == "denied" for ev in self.evs):
            raise ValueError(f"every EV of {p.evs} is denied: nothing left to send on")
        self._statuses_changed()
        self.ev_turn: dict[int | None, int] = {}   # per plane (None: any), round robin
        # sender
        self.snd_cum = 0                # every seq below is acknowledged
        self.snd_nxt = 0                # next new seq
        self.snd_end = 0
        # in the order sent (a resent packet moves to the end): the oldest are first,
        # so timers and loss detection look at the front only
        self.inflight: dict[int, Inflight] = {}
        self.retx: list[int] = []
        # seq -> (when the sending that was lost went, whether a NACK said so): until the
        # packet is resent
        self.lost_sent_at: dict[int, tuple[float, bool]] = {}
        self.tx_index = 0
        self.max_acked_tx = -1
        self.answered_tx = -1               # the latest sending answered (resent or not)
        self.cwnd = p.max_cwnd_packets if self.fixed_window else \
            self.nscc.cwnd / self.mtu if self.nscc else p.init_cwnd_packets
        # until the receiver speaks, a sender may use its share of a pooled budget, or
        # (RCCC) its unsolicited packets
        self.credit_limit = RcccParams(**p.rccc).initial_credit_packets if rccc else \
            min(p.credit_packets, p.credit_budget_packets or p.credit_packets)
        self.requested = self.credit_limit  # RCCC: the edge last asked for...
        self.requested_at = 0.0             # ...and when it asked or last got credit
        self.stalled_since: float | None = None   # RCCC: data waiting, no credit
        self.base_rtt = None
        self.srtt = None
        self.rttvar = None
        self.rto_s = p.initial_rto_ms / 1000 * stretch
        self.last_decrease = -1.0
        self.ecn_echoes = 0
        # receiver
        self.rcv_cum = 0
        self.rcv_seen: set[int] = set()
        self.rcv_count: dict[int, int] = {}
        self.rcv_bytes: dict[int, int] = {}
        self.rcv_last: dict[int, int] = {}          # a message's highest seq seen (ordered)
        self.held: list[tuple[int, int, int]] = []  # complete, earlier ones not: (last, tag, B)
        self.unsacked = 0
        self.unsacked_since: float | None = None   # the oldest packet not answered yet
        self.unsacked_sport, self.unsacked_plane = 0, 0
        self.last_sport, self.last_plane = 0, 0    # the EV the sender's last packet came on
        self.granted = self.credit_limit   # the credit edge the sender last heard (a seq)

    # --- sender ---------------------------------------------------------------------
    def post_write(self, data: bytes, remote_va: int, rkey: int, tag: int) -> None:
        msg = Message(data, remote_va, rkey, tag % MRC_MESSAGE_ID_MODULUS)
        self.segment(msg, self.snd_end)
        if msg.n_packets > MRC_MAX_PACKETS_PER_MESSAGE:
            raise ValueError(f"message of {msg.n_packets} packets; MRC carries at most "
                             f"{MRC_MAX_PACKETS_PER_MESSAGE} per message")
        self.snd_end += msg.n_packets

    def pending(self, now: float) -> bool:
        return bool(self.retx) or self._new_data(now)

    def _new_data(self, now: float) -> bool:
        """A packet not sent before may go now (window, credit)."""
        if not self.reliable:              # datagrams: as fast as the NIC paces them
            return self.snd_nxt < self.snd_end
        if self.snd_nxt >= self.snd_end or len(self.inflight) >= self.cwnd:
            return False
        if self.snd_nxt < self.credit_limit:
            return True
        if self.stalled_since is None:     # data to send, no credit for it
            self.stalled_since = now
        return False

    def _request_due(self) -> float | None:
        """RCCC: when the sender asks for credit: at once for data beyond what it
        asked for; again when it has waited a timeout for credit and heard none since it
        asked or last got some (the request or its answers may have been lost)."""
        if self.rccc is None or not self.reliable or self.snd_end <= self.credit_limit:
            return None
        if self.snd_end > self.requested:
            return 0.0
        return self.requested_at + self.rto_s if self.snd_nxt >= self.credit_limit else None

    def _credit_request(self, now: float) -> bytes:
        self.requested, self.requested_at = self.snd_end, now
        self.counters.credit_requests_sent += 1
        backlog = (self.snd_end - self.snd_nxt) * self.mtu
        ev = self._pick_ev(now)
        return self.ctrl_framers[ev.plane].frame(ev.port, Opcode.MRC_CREDIT_REQUEST,
                                      self.remote_qpn, self.snd_end,
                                      ext=_CREQX.pack(min(backlog, 0xFFFFFFFF)))

    def active_evs(self) -> list[EvState]:
        """The EVs that carry data."""
        return [ev for ev in self.evs if ev.status == "good"]

    def set_ev(self, ev: EvState, status: str, now: float, why: str) -> None:
        """An EV's state change, kept in its history (what link-failure reports)."""
        if ev.status == status:
            return
        ev.status = status
        t = 0.0 if self.t0 is None else (now - self.t0) * 1e3
        ev.history.append([round(t, 3), status, why])
        self.ev_events.append((ev.port, ev.plane, status, why))   # for the agent to report
        self._statuses_changed()

    def deny_ev(self, port: int, now: float, why: str = "denied", plane: int = 0) -> None:
        """Stop using EV `port` of plane `plane` for good (the controller's or the user's
        decision: e.g. it maps to a failed link); a packet in flight on it is resent as
        usual if lost. The last EV that is not denied cannot be."""
        ev = next((e for e in self.evs if e.port == port and e.plane == plane), None)
        if ev is None:
            raise ValueError(f"EV {port:#x} of plane {plane} is not one of this QP's")
        if ev.status != "denied" and all(e.status == "denied" for e in self.evs if e is not ev):
            raise ValueError(f"EV {port:#x} is the last one not denied")
        self.set_ev(ev, "denied", now, why)

    def _statuses_changed(self) -> None:
        self.good_evs = [ev for ev in self.evs if ev.status == "good"]
        # the EVs that carry data: the good ones (min_active_evs keeps some; if every one
        # was denied but the others, the assumed-bad ones carry it rather than nothing)
        self.usable = self.good_evs or [ev for ev in self.evs if ev.status != "denied"]
        # ...per plane: a plane whose EVs all went bad (a failed plane) gets no data
        self.usable_on = [[ev for ev in self.usable if ev.plane == plane]
                          for plane in range(len(self.data_framers))]
        self.planes_usable = sum(1 for evs in self.usable_on if evs)

    def sends_on(self, plane: int, now: float) -> bool:
        if plane >= len(self.usable_on) or not self.usable_on[plane]:
            return False
        return self.planes_usable < 2 or self._resend_on(plane) is not None \
            or self._new_data(now)

    def _resend_on(self, plane: int) -> int | None:
        """Which of the lost packets (an index into retx) plane `plane` resends: one lost
        on another plane, while another plane can carry it (a plane that loses a packet
        is likely to lose its resend too: the whole plane may have failed)."""
        for i, seq in enumerate(self.retx):
            old = self.inflight.get(seq)
            if self.planes_usable < 2 or old is None or old.ev.plane != plane:
                return i
        return None

    def _pick_ev(self, now: float, avoid: EvState | None = None,
                 plane: int | None = None) -> EvState:
        """The next usable EV, round robin (of plane `plane`, None: of any)."""
        active = self.usable if plane is None else self.usable_on[plane]
        for _ in range(len(active)):
            turn = self.ev_turn.get(plane, 0)
            ev = active[turn % len(active)]
            self.ev_turn[plane] = turn + 1
            if ev is not avoid or len(active) == 1:
                return ev
        return active[0]

    def next_frame(self, now: float, plane: int = 0) -> bytes:
        i = self._resend_on(plane) if self.retx else None
        resent = i is not None
        if self.t0 is None:
            self.t0 = now
        if resent:
            seq = self.retx.pop(i)
            old = self.inflight.pop(seq, None)
            ev = self._pick_ev(now, avoid=old.ev if old else None, plane=plane)
            self.counters.retransmitted += 1
            if seq in self.lost_sent_at:
                sent_at, by_nack = self.lost_sent_at.pop(seq)
                delay_ms, c = (now - sent_at) * 1e3, self.counters
                c.trim_resent += by_nack
                c.resend_delay_ms_max = max(c.resend_delay_ms_max, round(delay_ms, 3))
                c.resend_delay_ms_sum = round(c.resend_delay_ms_sum + delay_ms, 3)
        else:
            seq = self.snd_nxt
            self.snd_nxt += 1
            ev = self._pick_ev(now, plane=plane)
        msg, i = self.message_of(seq)
        payload, va = self.chunk(msg, i)
        if self.reliable:
            self.inflight[seq] = Inflight(seq, now, ev, self.tx_index, resent)
        elif i == msg.n_packets - 1:
            self.retire_acked(seq + 1)     # a datagram message is done once sent
        self.tx_index += 1
        ev.sent += 1
        self.counters.sent += 1
        imm = msg.tag << MRC_IMM_COUNT_BITS | msg.n_packets
        return self.data_framers[ev.plane].frame(ev.port, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                                      self.remote_qpn, seq, ext=reth(va, msg.rkey, len(payload))
                                      + immdt(imm), payload=payload)

    def deadline(self) -> float | None:
        due = [] if self.unsacked_since is None \
            else [self.unsacked_since + self.sack_delay_s]
        for f in self.inflight.values():     # the oldest still waiting for its answer
            if f.sent_at != LOST:
                due.append(f.sent_at + self.rto_s)
                break
        tail = self._tail_loss_due()
        if tail is not None:
            due.append(tail[1])
        if len(self.good_evs) < len(self.evs) and not self.idle():
            due += [self._probe_due(ev) for ev in self.evs
                    if ev.status in ("assumed_bad", "probing")]
        if self.rccc is not None:
            due += [t for t in (self._request_due(), self._grant_due()) if t is not None]
        return min(due) if due else None

    def _tail_loss_due(self) -> tuple[Inflight, float] | None:
        """When nothing new may go (none left, or the window or the credit is used up):
        the oldest packet in flight that one sent later passed (it, or its resending, was
        answered), and when it counts as lost."""
        if self.srtt is None or not self.reliable or (
                self.snd_nxt < min(self.snd_end, self.credit_limit)
                and len(self.inflight) < self.cwnd):
            return None
        for f in self.inflight.values():
            if f.sent_at != LOST:
                if f.tx_index >= self.answered_tx:
                    return None
                # ...plus the receiver's SACK delay, which may hold its answer that long:
                # without it a sprayed ring resent ~22 packets a run that had arrived
                # (natively, at the defaults: 2 SRTTs were ~3 ms, the delay 5 ms)
                return f, (f.sent_at + self.params.tail_loss_srtts * self.srtt
                           + self.sack_delay_s)
        return None

    def _grant_due(self) -> float | None:
        """RCCC, receiving: credit the sender has not heard of is told at once; else the
        scheduler's next grant, if it is this QP's."""
        if self.rccc.edge_of(self.qpn) > self.granted:
            return 0.0
        nxt = self.rccc.next_grant()
        return nxt[1] if nxt is not None and nxt[0] == self.qpn else None

    def _probe_due(self, ev: EvState) -> float:
        """When an assumed-bad EV gets its next probe, or a probe out its answer."""
        if ev.status == "probing":
            return ev.probe_sent_at + self.rto_s
        return ev.retired_at + self.ev_probe_after_s

    def on_timer(self, now: float) -> list[bytes]:
        """Fire what is due; the SACK that was waiting, if its time came."""
        out = []
        if self.unsacked_since is not None and \
                now >= self.unsacked_since + self.sack_delay_s:
            out.append(self._sack(self.unsacked_sport, self.unsacked_plane, False, now))
        for f in self.inflight.values():
            if f.sent_at == LOST:
                continue
            if now - f.sent_at < self.rto_s:
                break                          # and so is every later one
            self.timed_out(f.sent_at, now)
            self._lost(f, now)
        tail = self._tail_loss_due()
        while tail is not None and tail[1] <= now:
            self._lost(tail[0], now)
            tail = self._tail_loss_due()
        if len(self.good_evs) < len(self.evs) and not self.idle():
            out += self._probe(now)
        if self.rccc is not None:
            due = self._request_due()
            if due is not None and due <= now:
                out.append(self._credit_request(now))
            self._advance_credit(now)
            if self.rccc.edge_of(self.qpn) > self.granted:
                self.counters.credit_sacks_sent += 1
                out.append(self._sack(self.last_sport, self.last_plane, False, now))
        return out

    def _probe(self, now: float) -> list[bytes]:
        """Out of band: each assumed-bad EV whose time has come gets a probe on it (no
        data is risked there); a probe unanswered within the RTO leaves it assumed bad
        until the next. Only while the QP has data to send: an idle QP needs no path
        (the agent keeps its NICs running between collectives, and an idle QP probing a
        dead EV would keep sending after its collective was reported)."""
        out = []
        for ev in self.evs:
            if ev.status not in ("assumed_bad", "probing") or now < self._probe_due(ev):
                continue
            if ev.status == "probing":
                ev.retired_at = now
                self.set_ev(ev, "assumed_bad", now, "probe unanswered")
                continue
            ev.probes += 1
            ev.probe_sent_at = now
            self.set_ev(ev, "probing", now, "probe sent")
            out.append(self.ctrl_framers[ev.plane].frame(
                ev.port, Opcode.MRC_PROBE, self.remote_qpn, ev.probes,
                ext=_PROBEX.pack(ev.port, 0, 0)))
        return out

    def _on_probe(self, p: Parsed, now: float) -> list[bytes]:
        port, flags, _ = _PROBEX.unpack_from(p.ext)
        if not flags & MRC_PROBE_FLAG_REPLY:     # the receiver: answered on the same EV
            return [self.ctrl_framers[p.plane].frame(
                p.sport, Opcode.MRC_PROBE, self.remote_qpn, p.psn,
                ext=_PROBEX.pack(port, MRC_PROBE_FLAG_REPLY, 0))]
        ev = next((e for e in self.evs if e.port == port and e.plane == p.plane), None)
        if ev is not None and ev.status == "probing":
            ev.failures = 0
            self.set_ev(ev, "good", now, "probe answered")
        return []

    def _lost(self, f: Inflight, now: float) -> None:
        self.lost_sent_at[f.seq] = (f.sent_at, False)
        self.retx.append(f.seq)
        f.sent_at = LOST                  # not lost twice before it is resent
        ev = f.ev
        ev.lost += 1
        ev.failures += 1
        if ev.status == "good" and ev.failures >= self.params.ev_fail_losses \
                and len(self.active_evs()) > self.params.min_active_evs:
            ev.retirements += 1
            ev.retired_at = now        # (its failures stand until a probe is answered)
            self.set_ev(ev, "assumed_bad", now, f"{self.params.ev_fail_losses} losses in a row")
        # A loss is a congestion signal when its EV's packets got through before; on an EV
        # whose previous packet was lost too, it points at the path (a dead link, a failed
        # plane), which retiring the EV answers: shrinking the window for it as well would
        # starve the healthy paths (measured: a failed plane of two, every loss a
        # decrease, left MRC 18% of its rate, 50 losses a second, too few to retire the
        # plane's 8 EVs)
        if ev.failures == 1:
            if self.nscc:
                self.nscc.on_loss()
            self._decrease(now)

    def _decrease(self, now: float) -> None:
        """The lab's own window ("window"): NSCC decides for itself; RCCC alone keeps
        the window at its largest (the credit paces the sender)."""
        if self.nscc or self.fixed_window:
            return
        rtt = self.srtt or self.rto_margin_s
        if now - self.last_decrease >= rtt:
            self.cwnd = max(self.params.min_cwnd_packets, self.cwnd * self.params.decrease_factor)
            self.last_decrease = now

    def _on_sack(self, p: Parsed, now: float) -> None:
        bitmap, _ev_port, flags, _, credit = _SACKX.unpack_from(p.ext)
        # (never past what was sent: a broken SACK must not acknowledge the future)
        cum = min(self.snd_nxt, self.snd_cum + psn_delta(p.psn, self.snd_cum))
        newly = [s for s in range(self.snd_cum, cum) if s in self.inflight]
        base = cum + 1
        while bitmap:                      # the bits set (of 64: _SACKX), lowest first
            low = bitmap & -bitmap
            seq = base + low.bit_length() - 1
            if seq in self.inflight:
                newly.append(seq)
            bitmap ^= low
        timed = None                       # the round trip of the youngest packet answered
        for seq in newly:
            f = self.inflight.pop(seq)
            if seq in self.retx:
                self.retx.remove(seq)
                self.lost_sent_at.pop(seq, None)
            if f.sent_at != LOST:
                self.answered_tx = max(self.answered_tx, f.tx_index)
            if f.sent_at != LOST and not f.resent:
                self._rtt_sample(now - f.sent_at, now)
                timed = now - f.sent_at
            f.ev.failures = 0
            if not f.resent:   # (which sending arrived is not known: the first, maybe)
                self.max_acked_tx = max(self.max_acked_tx, f.tx_index)
            if not self.nscc and not self.fixed_window:
                self.cwnd = min(self.params.max_cwnd_packets, self.cwnd + 1 / self.cwnd)
        if self.nscc and newly:
            self.nscc.on_ack(len(newly) * self.mtu, timed, bool(flags & MRC_SACK_FLAG_ECN_ECHO),
                             now, len(self.inflight) * self.mtu)
            self.cwnd = self.nscc.cwnd / self.mtu
        if cum > self.snd_cum:
            self.snd_cum = cum
            self.retire_acked(cum)
        edge = self.snd_cum + psn_delta(credit, self.snd_cum)
        if edge > self.credit_limit:
            self.credit_limit, self.requested_at = edge, now
            if self.stalled_since is not None:
                self.counters.credit_stalled_ms = round(
                    self.counters.credit_stalled_ms + (now - self.stalled_since) * 1e3, 3)
                self.stalled_since = None
        if flags & MRC_SACK_FLAG_ECN_ECHO:
            self.ecn_echoes += 1
            self._decrease(now)
        passed = self.max_acked_tx - self.params.reorder_packets
        for f in self.inflight.values():   # holes passed by later packets are losses
            if f.tx_index >= passed:
                break                      # in the order sent: so is every later one
            if f.sent_at != LOST:
                self._lost(f, now)

    def _on_nack(self, p: Parsed, now: float) -> None:
        """A receiver got packet `p.psn` trimmed: resent at once (its timer would take an
        RTO), and a congestion signal (a queue was full), not a sign of a bad path."""
        ev_port, code, _flags = _NACKX.unpack_from(p.ext)
        self.counters.trim_nacks_received += 1
        seq = self.snd_cum + psn_delta(p.psn, self.snd_cum)
        f = self.inflight.get(seq)
        # nothing to do if it was acknowledged since, waits to be resent, or was resent
        # already (a resend takes another EV: this NACK is about an earlier sending)
        if code != MRC_NACK_CODE_TRIMMED or f is None or f.sent_at == LOST \
                or f.ev.port != ev_port or f.ev.plane != p.plane:
            return
        self.lost_sent_at[seq] = (f.sent_at, True)
        self.retx.append(seq)
        f.sent_at = LOST
        if self.nscc:
            self.nscc.on_nack()
        self._decrease(now)

    def _rtt_sample(self, rtt: float, now: float) -> None:
        self.base_rtt = rtt if self.base_rtt is None else min(self.base_rtt, rtt)
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:                              # RFC 6298, 2.3: rttvar first, from the old srtt
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto_s = self.srtt + max(self.rto_margin_s, 4 * self.rttvar)
        self.counters.srtt_ms = round(self.srtt * 1e3, 3)
        self.counters.min_rtt_ms = round(self.base_rtt * 1e3, 3)
        if rtt - self.base_rtt > self.target_delay_s:
            self._decrease(now)

    # --- receiver -------------------------------------------------------------------
    def on_packet(self, p: Parsed, now: float) -> list[bytes]:
        if p.opcode == Opcode.MRC_SACK:
            self._on_sack(p, now)
            return []
        if p.opcode == Opcode.MRC_NACK:
            self._on_nack(p, now)
            return []
        if p.opcode == Opcode.MRC_PROBE:
            return self._on_probe(p, now)
        if p.opcode == Opcode.MRC_CREDIT_REQUEST:
            return self._on_credit_request(p, now)
        if p.opcode != Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE or p.imm is None:
            raise ValueError(f"opcode {p.opcode:#x} is not MRC data")
        if p.trimmed:
            return self._on_trimmed(p) if self.reliable else []
        if not self.reliable:
            return self._on_datagram(p)
        self.last_sport, self.last_plane = p.sport, p.plane
        self.counters.received += 1
        self.counters.ecn_marked += p.ce
        seq = self.rcv_cum + psn_delta(p.psn, self.rcv_cum)
        if seq < self.rcv_cum or seq in self.rcv_seen:
            self.counters.duplicate += 1
        else:
            if seq != self.rcv_cum:
                self.counters.out_of_order += 1
            self.region.place(p.va, p.payload)
            self.counters.bytes_delivered += len(p.payload)
            self.rcv_seen.add(seq)
            if self.rccc is not None:
                self.rccc.arrival(self.qpn)
            while self.rcv_cum in self.rcv_seen:
                self.rcv_seen.discard(self.rcv_cum)
                self.rcv_cum += 1
            tag, count = p.imm >> MRC_IMM_COUNT_BITS, p.imm & MRC_MAX_PACKETS_PER_MESSAGE
            self.rcv_count[tag] = self.rcv_count.get(tag, 0) + 1
            self.rcv_bytes[tag] = self.rcv_bytes.get(tag, 0) + len(p.payload)
            self.rcv_last[tag] = max(seq, self.rcv_last.get(tag, seq))
            if self.rcv_count[tag] == count:
                done = (self.rcv_last.pop(tag), tag, self.rcv_bytes.pop(tag))
                del self.rcv_count[tag]
                if self.params.delivery == "ordered":
                    bisect.insort(self.held, done)
                else:
                    self.events.append(("received", tag, done[2]))
                self.unsacked = self.params.sack_every_packets      # answer now
            # ordered: a message is delivered once every packet before its last has come
            while self.held and self.held[0][0] < self.rcv_cum:
                _, tag, nbytes = self.held.pop(0)
                self.events.append(("received", tag, nbytes))
        self.unsacked += 1
        # coalesced, unless something is worth telling at once; a packet at the credit
        # edge is: its sender can send nothing more until it hears back
        if self.unsacked < self.params.sack_every_packets and not p.ce and not self.rcv_seen \
                and seq + 1 < self.granted:
            if self.unsacked_since is None:
                self.unsacked_since = now
            self.unsacked_sport, self.unsacked_plane = p.sport, p.plane
            return []
        return [self._sack(p.sport, p.plane, p.ce, now)]

    def _on_credit_request(self, p: Parsed, now: float) -> list[bytes]:
        """RCCC: a sender wants credit up to the edge in the PSN; answered at once with
        what it has (a repeated request: the answer before was lost), and with the rest
        as the scheduler grants it (on_timer)."""
        self.counters.credit_requests_received += 1
        self.last_sport, self.last_plane = p.sport, p.plane
        if self.rccc is None:
            return []
        self.rccc.request(self.qpn, self.rcv_cum + psn_delta(p.psn, self.rcv_cum), now)
        self.counters.credit_sacks_sent += 1
        return [self._sack(p.sport, p.plane, False, now)]

    def _on_datagram(self, p: Parsed) -> list[bytes]:
        """Unreliable delivery: placed, counted, never answered."""
        self.counters.received += 1
        self.counters.ecn_marked += p.ce
        self.region.place(p.va, p.payload)
        self.counters.bytes_delivered += len(p.payload)
        tag, count = p.imm >> MRC_IMM_COUNT_BITS, p.imm & MRC_MAX_PACKETS_PER_MESSAGE
        self.rcv_count[tag] = self.rcv_count.get(tag, 0) + 1
        self.rcv_bytes[tag] = self.rcv_bytes.get(tag, 0) + len(p.payload)
        if self.rcv_count[tag] == count:
            del self.rcv_count[tag]
            self.events.append(("received", tag, self.rcv_bytes.pop(tag)))
        return []

    def _on_trimmed(self, p: Parsed) -> list[bytes]:
        """A data packet a switch trimmed: its headers say which one; ask for it again
        (unless it has arrived whole meanwhile: a trimmed copy of a resend)."""
        self.counters.trimmed_received += 1
        seq = self.rcv_cum + psn_delta(p.psn, self.rcv_cum)
        if seq < self.rcv_cum or seq in self.rcv_seen:
            return []
        self.counters.trim_nacks_sent += 1
        # on the EV it came on, like a SACK; echoing its CE mark
        nack = _NACKX.pack(p.sport, MRC_NACK_CODE_TRIMMED, MRC_SACK_FLAG_ECN_ECHO if p.ce else 0)
        return [self.ctrl_framers[p.plane].frame(p.sport, Opcode.MRC_NACK, self.remote_qpn,
                                                 p.psn, ext=nack)]

    def _sack(self, sport: int, plane: int, ce: bool, now: float) -> bytes:
        """Answer everything received so far, on the EV `sport` of plane `plane` (that
        of the packet answered), echoing its CE mark."""
        self.unsacked, self.unsacked_since = 0, None
        base = self.rcv_cum + 1
        bitmap = 0
        for s in self.rcv_seen:
            if 0 <= s - base < MRC_SACK_BITMAP_BITS:
                bitmap |= 1 << (s - base)
        flags = MRC_SACK_FLAG_ECN_ECHO if ce else 0
        if self.rccc is not None:
            self._advance_credit(now)
            self.granted = self.rccc.edge_of(self.qpn)
        else:
            grant = self.credit_pool.grant(self.qpn, now) if self.credit_pool \
                else self.params.credit_packets
            self.granted = self.rcv_cum + grant
        credit = self.granted & 0xFFFFFF
        self.counters.acks_sent += 1
        # on the EV the answered packet came on: SACKs spread over the paths as the data
        # does, so one dead path cannot take every SACK (a fixed port would pin them all)
        return self.ctrl_framers[plane].frame(sport, Opcode.MRC_SACK, self.remote_qpn,
                                              self.rcv_cum,
                                              ext=_SACKX.pack(bitmap, sport, flags, 0, credit))

    def _advance_credit(self, now: float) -> None:
        """RCCC, receiving: the scheduler grants what is due; the link time it lost on
        this QP's account is counted."""
        self.rccc.advance(now)
        self.counters.credit_unused_ms = round(self.rccc.unused_s.get(self.qpn, 0.0) * 1e3, 3)

    def ev_report(self) -> list[dict]:
        return [dict(ev.__dict__) for ev in self.evs]
