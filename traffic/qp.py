"""What every queue pair has: identity, its framer, counters, a receive region.

A QP is driven by its NIC (nic.py): `pending(now)` says whether it has a frame
to send now, `next_frame(now)` gives it, `on_packet(p, now)` takes a received
frame and returns response frames, `deadline()` says when a timer fires and
`on_timer(now)` fires it (returning response frames too: a delayed SACK). On a
multi-plane NIC, `sends_on(plane, now)` says whether the QP has a way out on that plane's
port, and `next_frame(now, plane)` gives a frame for it.
Completed messages are queued in `events`.
"""
from __future__ import annotations

from dataclasses import dataclass

from traffic.constants import DSCP_CNP, DSCP_ROCE_DATA, PSN_MODULUS, Ecn
from traffic.roce import Framer, Path, udp_sport_for_qp

HALF_PSN_SPACE = PSN_MODULUS // 2
# Pacing lets a frame go up to this early. A NIC woken when its next frame is due then
# sends every frame due within it, a short burst the host's queue (the real link, htb)
# smooths out, instead of one wake-up, one poll and one recv per frame: at 100 Mb/s
# that is ~6 frames per wake-up. Below ~20 Mb/s a frame takes longer than this, and
# pacing is frame by frame as before.
PACE_AHEAD_S = 0.0005


def psn_delta(psn24: int, base: int) -> int:
    """Signed distance of a 24-bit wire PSN from an absolute sequence number."""
    d = (psn24 - base) % PSN_MODULUS
    return d - PSN_MODULUS if d >= HALF_PSN_SPACE else d


@dataclass
class Counters:
    sent: int = 0
    retransmitted: int = 0
    received: int = 0
    duplicate: int = 0
    out_of_order: int = 0
    acks_sent: int = 0
    naks_sent: int = 0
    timeouts: int = 0
    timeout_wait_ms: float = 0.0    # how long lost packets waited for the timers that
                                    # found them: their spans from sending (RC: from the
                                    # last progress) to the timeout, overlaps counted once
    ecn_marked: int = 0
    cnps_sent: int = 0
    cnps_received: int = 0
    bytes_delivered: int = 0
    trimmed_received: int = 0       # packets that arrived trimmed (headers only)
    trim_nacks_sent: int = 0        # ...each answered with a NACK (MRC)
    trim_nacks_received: int = 0
    trim_resent: int = 0            # packets resent because a NACK asked for them
    resend_delay_ms_max: float = 0.0    # the longest from a lost (or trimmed) packet's
                                        # sending to its resending (MRC)
    resend_delay_ms_sum: float = 0.0    # ...and all of them together (a mean)
    srtt_ms: float = 0.0            # the sender's smoothed round trip, last (MRC)
    min_rtt_ms: float = 0.0         # ...and its least (MRC)
    credit_requests_sent: int = 0   # RCCC: the sender asked for credit...
    credit_requests_received: int = 0   # ...the receiver heard it
    credit_sacks_sent: int = 0      # SACKs a receiver sent only to grant credit
    credit_stalled_ms: float = 0.0  # a sender had data but no credit this long (RCCC)
    credit_unused_ms: float = 0.0   # the receiver's link time lost while this QP was owed
                                    # credit: what was out had not arrived (RCCC)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Region:
    """Registered memory a remote writer may place data into."""
    rkey: int
    buf: bytearray
    base_va: int = 0x10000000

    def place(self, va: int, data) -> None:
        off = va - self.base_va
        if off < 0 or off + len(data) > len(self.buf):
            raise IndexError(f"write of {len(data)} B at {va:#x} outside region {self.rkey}")
        self.buf[off:off + len(data)] = data


@dataclass
class Message:
    data: bytes
    remote_va: int
    rkey: int
    tag: int                       # carried to the responder (RC: immediate; MRC: message id)
    first_seq: int = 0
    n_packets: int = 0


class QueuePair:
    kind = "qp"

    def __init__(self, path: Path, qpn: int, remote_qpn: int, region: Region | None,
                 mtu_bytes: int, dscp: int = DSCP_ROCE_DATA):
        """dscp: the class of the QP's data and its acknowledgements (CNPs keep theirs)."""
        self.qpn, self.remote_qpn = qpn, remote_qpn
        self.peer_ip = path.dst_ip
        self.data_framer = Framer(path, dscp, Ecn.ECT_0)
        self.ctrl_framer = Framer(path, dscp, Ecn.NOT_ECT)
        self.cnp_framer = Framer(path, DSCP_CNP, Ecn.NOT_ECT)
        self.rate_bps: float | None = None     # a QP's own rate limit (congestion control)
        self.next_tx = 0.0
        self.sport = udp_sport_for_qp(qpn, remote_qpn)
        self.region = region
        self.mtu = mtu_bytes
        self.counters = Counters()
        self.events: list[tuple] = []       # ("received", tag, nbytes) / ("sent", tag)
        self.messages: list[Message] = []
        self.waited_until = float("-inf")   # the end of the last span timeout_wait_ms has

    def segment(self, msg: Message, first_seq: int) -> None:
        msg.first_seq = first_seq
        msg.n_packets = max(1, -(-len(msg.data) // self.mtu))
        self.messages.append(msg)

    def chunk(self, msg: Message, index: int) -> tuple[bytes, int]:
        """Payload and remote VA of packet `index` of `msg`."""
        off = index * self.mtu
        return msg.data[off:off + self.mtu], msg.remote_va + off

    def message_of(self, seq: int) -> tuple[Message, int]:
        for msg in self.messages:
            if msg.first_seq <= seq < msg.first_seq + msg.n_packets:
                return msg, seq - msg.first_seq
        raise KeyError(seq)

    def retire_acked(self, acked_below: int) -> None:
        """Messages whose every packet is below `acked_below` are complete."""
        keep = []
        for msg in self.messages:
            if msg.first_seq + msg.n_packets <= acked_below:
                self.events.append(("sent", msg.tag))
            else:
                keep.append(msg)
        self.messages = keep

    def timed_out(self, since: float, now: float) -> None:
        """A retransmit timer fired at `now` for what waited from `since`."""
        self.counters.timeouts += 1
        self.counters.timeout_wait_ms += max(0.0, now - max(since, self.waited_until)) * 1e3
        self.waited_until = max(self.waited_until, now)

    def idle(self) -> bool:
        return not self.messages

    def sends_on(self, plane: int, now: float) -> bool:
        """Whether the QP, pending, can send on plane `plane` now (a multi-plane NIC asks
        each of its ports in turn): one Path, plane 0's."""
        return plane == 0

    def paced(self, now: float) -> bool:
        """True while the QP's own rate limit holds it back."""
        return self.rate_bps is not None and now + PACE_AHEAD_S < self.next_tx

    def account(self, frame_bytes: int, now: float) -> None:
        if self.rate_bps:   # up to 1 ms of missed sending may be caught up (timer slack)
            self.next_tx = max(self.next_tx, now - 0.001) + frame_bytes * 8 / self.rate_bps
