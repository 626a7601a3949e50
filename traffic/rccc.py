"""RCCC, Ultra Ethernet's receiver-credit congestion control, as the MRC receiver's
credit (traffic/mrc.py, `cc="rccc"` or `"nscc+rccc"`).

Incast is a fan-in at the receiver's own link: every path into it ends in the same
last-hop port, so no choice of path helps; the receiver is the one place that knows
how many senders want it and how fast it can take their packets. Under RCCC it paces
credit at its link's rate and shares it among the senders that asked: a sender sends
a few packets unsolicited (`initial_credit_packets`, so a short message needs no
round trip), asks for the rest (an MRC credit request: the edge it wants to reach and
its backlog), and from then on sends only what it was granted. The credit arrives in
the SACKs (their credit field: the sequence edge the sender may reach), and in a
credit SACK of its own when a sender has no packets in flight to be answered.

What the receiver grants adds up to its link's rate (`rate_share` of it), counted in
whole frames on the wire, and the credit out (granted, unsolicited packets included,
not yet arrived) stays within `max_outstanding_packets`: the pacing alone would grant
the time the link stood idle (senders that start late, a host that stalls) as a
burst that then stands in the last-hop queue for good (measured: 13 frames for the
whole 8-to-1 incast); the cap keeps that queue to what the cap leaves above the
round trip's packets. Credits are shared round robin, `quantum_packets` at a time,
among the senders that still want some: each gets an equal share whatever it asked.

Pure logic: time comes in as arguments, so it is tested without a network.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class RcccParams:
    rate_share: float = 1.0             # of the receiver's link rate the credits pace
    initial_credit_packets: int = 4     # per sender: sent before any credit (UET's
    # unsolicited data; the lab's buffer holds 8 senders' worth)
    quantum_packets: int = 2            # credit granted to one sender at a time
    max_outstanding_packets: int = 8    # credit granted and not arrived yet, all senders

    def validate(self) -> None:
        if not 0 < self.rate_share <= 1.5:
            raise ValueError(f"rate_share must be in (0, 1.5], got {self.rate_share}")
        if min(self.initial_credit_packets, self.quantum_packets,
               self.max_outstanding_packets) < 1:
            raise ValueError("initial_credit_packets, quantum_packets and "
                             "max_outstanding_packets must be >= 1")


class Rccc:
    """A receiver's credit scheduler, shared by the QPs it receives on (one per host
    and collective, like the agent's other per-host state). Sequence numbers are each
    QP's own (packets, from 0)."""

    def __init__(self, params: RcccParams, rate_mbps: float, frame_bytes: int):
        params.validate()
        self.p = params
        self.packets_per_s = params.rate_share * rate_mbps * 1e6 / 8 / frame_bytes
        self.edge: dict[int, int] = {}      # qpn -> the edge granted (a sequence number)
        self.wanted: dict[int, int] = {}    # qpn -> the edge its sender asked for
        self.arrived: dict[int, int] = {}   # qpn -> its packets arrived below its edge
        self.turns: deque[int] = deque()    # the senders still owed credit, in turn
        self.tokens = 0.0                   # packets' worth of link time not yet granted
        self.last: float | None = None
        self.unused_s: dict[int, float] = {}   # qpn -> link time lost while it was owed
        # credit (advance), split among the QPs owed it then

    def edge_of(self, qpn: int) -> int:
        return self.edge.get(qpn, self.p.initial_credit_packets)

    def request(self, qpn: int, wanted_edge: int, now: float) -> None:
        """A sender asks to reach `wanted_edge`. The first request from a QP brings its
        unsolicited packets onto the link's account: grants wait for them to pass."""
        self.advance(now)
        if qpn not in self.edge:
            self.edge[qpn] = self.p.initial_credit_packets
            self.tokens -= min(self.p.initial_credit_packets, wanted_edge)
        self.wanted[qpn] = max(self.wanted.get(qpn, 0), wanted_edge)
        if self.wanted[qpn] > self.edge[qpn] and qpn not in self.turns:
            self.turns.append(qpn)

    def arrival(self, qpn: int) -> None:
        """A packet the sender had credit for arrived (once per packet: not a copy)."""
        self.arrived[qpn] = self.arrived.get(qpn, 0) + 1

    def outstanding(self) -> int:
        return sum(e - self.arrived.get(q, 0) for q, e in self.edge.items())

    def advance(self, now: float) -> None:
        """Grant what the link's time since the last look pays for."""
        if self.last is not None and now > self.last:
            self.tokens += (now - self.last) * self.packets_per_s
        self.last = now if self.last is None else max(self.last, now)
        if not self.turns:
            self.tokens = min(self.tokens, 0.0)    # an idle link's time is not saved up
            return
        room = self.p.max_outstanding_packets - self.outstanding()
        while self.turns and self.tokens >= self.p.quantum_packets \
                and room >= self.p.quantum_packets:
            qpn = self.turns.popleft()
            n = min(self.p.quantum_packets, self.wanted[qpn] - self.edge[qpn])
            self.edge[qpn] += n
            self.tokens -= n
            room -= n
            if self.wanted[qpn] > self.edge[qpn]:
                self.turns.append(qpn)
        # time the cap held the grants back is not saved up past what it lets out: with
        # senders still owed credit that time is the link's, lost. The credit out had
        # not come back within the link time the cap covers (8 packets: 20 ms at
        # x0.34), which the hosts' round trip decides: natively it stays small; in the
        # lab VM the receiver's loop woke up to 50 ms apart and the last flow ended
        # 1.24x its ideal time
        lost = self.tokens - self.p.max_outstanding_packets
        if lost > 0:
            for qpn in self.turns:
                self.unused_s[qpn] = self.unused_s.get(qpn, 0.0) \
                    + lost / self.packets_per_s / len(self.turns)
            self.tokens = float(self.p.max_outstanding_packets)

    def next_grant(self) -> tuple[int, float] | None:
        """Who gets the next grant and when (None: nobody is owed credit, or what is
        out must arrive first: an arrival looks again)."""
        if not self.turns or self.last is None or \
                self.outstanding() > self.p.max_outstanding_packets - self.p.quantum_packets:
            return None
        short = max(0.0, self.p.quantum_packets - self.tokens)
        return self.turns[0], self.last + short / self.packets_per_s
