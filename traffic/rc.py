"""RoCE RC (reliable connection) as NICs implement it: in-order delivery,
go-back-N loss recovery.

Requester: a message is an RDMA WRITE segmented at the MTU (FIRST/MIDDLE/LAST,
or ONLY), PSNs consecutive (24-bit, wrapping), the last one asking for an ACK
and carrying the message's tag as immediate data. A packet also asks for one when
a quarter of the retransmit timer has passed since the last that did: a sender
slowed by DCQCN (down to 1% of the line) or by pauses would otherwise wait for
`ack_every_packets` longer than its timer, and resend what was not lost (seen in
the incast's ecn+pfc variant: 2 timeouts in 2 of 6 runs). At most `window_packets`
unacknowledged. A NAK (PSN sequence error) or a retransmit timeout rewinds to
the oldest unacknowledged PSN and resends everything from there: go-back-N.
Every packet of the QP leaves on one UDP source port (udp_sport_for_qp). Its first
packet travels alone: the rest wait for its ACK, a round trip, as a connection's
handshake costs a real QP before its data. Emulated switches need it: OVS's kernel
datapath hands a new flow's first frames to ovs-vswitchd, which sends them on once it
has installed the flow, after later frames of the flow passed them on the fast path
(seen in the lab VM on a 2-tier fabric: PSNs 0-9 of every flow 8-120 ms late at every
switch, so receivers NAKed 4-12 times a run with nothing lost). The first packet
installs the flow in every switch on the path, its ACK the way back.

Responder: accepts only the expected PSN; a later PSN means a loss: it is
dropped and answered with one NAK (until the gap closes); an earlier PSN is a
duplicate, re-ACKed. ACKs are coalesced: one per `ack_every_packets`, and at
every packet that asks for one.
"""
from __future__ import annotations

from dataclasses import dataclass

from traffic.constants import DSCP_ROCE_DATA, AethSyndrome, Opcode
from traffic.dcqcn import DcqcnParams, NotificationPoint, ReactionPoint
from traffic.qp import Message, QueuePair, psn_delta
from traffic.roce import WRITE_OVERHEAD_BYTES, Parsed, aeth, immdt, reth


@dataclass
class RcParams:
    mtu_bytes: int = 1024
    window_packets: int = 64
    ack_every_packets: int = 16
    rto_ms: float = 50.0
    dcqcn: bool = True
    line_rate_mbps: float = 0.0      # the NIC's rate, DCQCN's ceiling (0: no DCQCN pacing)
    rate_scale: float = 1000.0       # stretches DCQCN's time constants (dcqcn.py)
    dscp: int = DSCP_ROCE_DATA       # its traffic class (DSCP_EXPRESS: the express class)


class RcQP(QueuePair):
    kind = "rc"

    def __init__(self, path, qpn, remote_qpn, region, params: RcParams | None = None):
        self.params = params or RcParams()
        super().__init__(path, qpn, remote_qpn, region, self.params.mtu_bytes, self.params.dscp)
        self.snd_una = 0         # oldest unacknowledged sequence number (absolute)
        self.snd_nxt = 0         # next to send
        self.snd_end = 0         # one past the last queued
        self.high_sent = 0       # one past the highest ever sent (to count retransmits)
        self.last_progress = 0.0
        self.epsn = 0            # responder: expected sequence number (absolute)
        self.nak_outstanding = False
        self.unacked_rx = 0
        self.msn = 0
        self.rx_va = 0           # where the next in-order payload lands
        self.rx_bytes = 0        # of the message being received
        p = self.params
        # The timer must outlast sending a whole window at the line rate, or a slow
        # link turns every window into a spurious go-back-N (seen at 2 Mb/s: no end)
        window_s = (2 * p.window_packets * (p.mtu_bytes + WRITE_OVERHEAD_BYTES) * 8
                    / (p.line_rate_mbps * 1e6)) if p.line_rate_mbps else 0.0
        self.rto_s = max(p.rto_ms / 1000, window_s)
        self.ackreq_at = float("-inf")     # when a packet last asked for an ACK
        self.dcqcn = DcqcnParams().at_scale(p.rate_scale) if p.dcqcn else None
        self.rp: ReactionPoint | None = None       # made at the first send (needs the clock)
        self.np = NotificationPoint(self.dcqcn) if self.dcqcn else None

    # --- requester ------------------------------------------------------------------
    def post_write(self, data: bytes, remote_va: int, rkey: int, tag: int) -> None:
        msg = Message(data, remote_va, rkey, tag)
        self.segment(msg, self.snd_end)
        self.snd_end += msg.n_packets

    def pending(self, now: float) -> bool:
        opened = self.snd_una > 0 or self.snd_nxt == 0      # the first packet's ACK came
        return opened and self.snd_nxt < self.snd_end and not self.paced(now) and \
            self.snd_nxt - self.snd_una < self.params.window_packets

    def next_frame(self, now: float, plane: int = 0) -> bytes:
        seq = self.snd_nxt
        msg, i = self.message_of(seq)
        payload, va = self.chunk(msg, i)
        last = i == msg.n_packets - 1
        if msg.n_packets == 1:
            op, ext = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, reth(va, msg.rkey, len(msg.data)) \
                + immdt(msg.tag)
        elif i == 0:
            op, ext = Opcode.RDMA_WRITE_FIRST, reth(va, msg.rkey, len(msg.data))
        elif last:
            op, ext = Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE, immdt(msg.tag)
        else:
            op, ext = Opcode.RDMA_WRITE_MIDDLE, b""
        if self.snd_una == self.snd_nxt:
            self.last_progress = now     # the RTO runs from the oldest outstanding packet
        self.snd_nxt += 1
        self.counters.sent += 1
        if seq < self.high_sent:
            self.counters.retransmitted += 1
        self.high_sent = max(self.high_sent, self.snd_nxt)
        ackreq = last or now - self.ackreq_at >= self.rto_s / 4
        if ackreq:
            self.ackreq_at = now
        frame = self.data_framer.frame(self.sport, op, self.remote_qpn, seq, ackreq=ackreq,
                                       ext=ext, payload=payload)
        self._rate_control(len(frame), now)
        return frame

    def _rate_control(self, nbytes: int, now: float) -> None:
        if self.dcqcn is None or not self.params.line_rate_mbps:
            return
        if self.rp is None:
            self.rp = ReactionPoint(self.params.line_rate_mbps * 1e6, self.dcqcn, now)
        self.rp.on_sent(nbytes, now)
        self.rate_bps = self.rp.rc
        self.account(nbytes, now)

    def deadline(self) -> float | None:
        if self.snd_una < self.snd_nxt:
            return self.last_progress + self.rto_s
        return None

    def on_timer(self, now: float) -> list[bytes]:
        if self.snd_una < self.snd_nxt and now >= self.last_progress + self.rto_s:
            self.timed_out(self.last_progress, now)
            self.snd_nxt = self.snd_una          # go back N
            self.last_progress = now
        return []

    def _on_ack(self, p: Parsed, now: float) -> None:
        d = psn_delta(p.psn, self.snd_una)
        if p.syndrome == AethSyndrome.NAK_PSN_SEQUENCE_ERROR:
            if 0 <= d <= self.snd_nxt - self.snd_una:
                self.snd_una += d                 # everything before the NAK'd PSN arrived
                self.snd_nxt = self.snd_una       # go back N from it
                self.last_progress = now
        elif 0 <= d < self.snd_nxt - self.snd_una:
            self.snd_una += d + 1
            self.last_progress = now
        self.retire_acked(self.snd_una)

    # --- responder ------------------------------------------------------------------
    def on_packet(self, p: Parsed, now: float) -> list[bytes]:
        if p.opcode == Opcode.ACKNOWLEDGE:
            self._on_ack(p, now)
            return []
        if p.opcode == Opcode.CNP:
            self.counters.cnps_received += 1
            if self.rp is not None:
                self.rp.on_cnp(now)
                self.rate_bps = self.rp.rc
            return []
        if p.trimmed:       # RC has no TRIM NACK: a trimmed packet is a lost one (go-back-N)
            self.counters.trimmed_received += 1
            return []
        self.counters.received += 1
        self.counters.ecn_marked += p.ce
        out = self._cnp(now) if self.np and self.np.should_notify(p.ce, now) else []
        return out + self._respond(p, now)

    def _cnp(self, now: float) -> list[bytes]:
        self.counters.cnps_sent += 1
        return [self.cnp_framer.frame(self.sport, Opcode.CNP, self.remote_qpn, 0, becn=True,
                                      payload=bytes(16))]

    def _respond(self, p: Parsed, now: float) -> list[bytes]:
        d = psn_delta(p.psn, self.epsn)
        if d > 0:
            self.counters.out_of_order += 1
            if self.nak_outstanding:
                return []
            self.nak_outstanding = True
            self.counters.naks_sent += 1
            return [self._response(AethSyndrome.NAK_PSN_SEQUENCE_ERROR, self.epsn)]
        if d < 0:
            self.counters.duplicate += 1
            return [self._response(AethSyndrome.ACK, self.epsn - 1)]
        self.nak_outstanding = False
        self._place(p)
        self.epsn += 1
        self.unacked_rx += 1
        if p.ackreq or self.unacked_rx >= self.params.ack_every_packets:
            self.unacked_rx = 0
            return [self._response(AethSyndrome.ACK, self.epsn - 1)]
        return []

    def _place(self, p: Parsed) -> None:
        if p.opcode in (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY,
                        Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE):
            self.rx_va = p.va
            self.rx_bytes = 0
        self.region.place(self.rx_va, p.payload)
        self.rx_va += len(p.payload)
        self.rx_bytes += len(p.payload)
        self.counters.bytes_delivered += len(p.payload)
        if p.imm is not None:                    # LAST/ONLY WITH IMMEDIATE: message complete
            self.msn += 1
            self.events.append(("received", p.imm, self.rx_bytes))

    def _response(self, syndrome: int, seq: int) -> bytes:
        self.counters.acks_sent += syndrome == AethSyndrome.ACK
        return self.ctrl_framer.frame(self.sport, Opcode.ACKNOWLEDGE, self.remote_qpn, seq,
                                      ext=aeth(syndrome, self.msn))
