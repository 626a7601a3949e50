"""RCCC (traffic/rccc.py) on its own: credit paced at the link's rate, shared equally,
the unsolicited packets counted, idle time not saved up; then MRC with cc="rccc" over
the in-memory link of test_transport.py: the sender sends only what it was granted, a
lost credit request is asked again. Pure: no namespaces."""
import os
import time

import pytest

from test_transport import A, B, link, pump
from traffic.constants import Opcode
from traffic.mrc import DATA_OVERHEAD_BYTES, EXT_BYTES, MrcParams, MrcQP
from traffic.nic import Nic
from traffic.qp import Region
from traffic.rccc import Rccc, RcccParams
from traffic.roce import parse

MTU = 1024
FRAME = DATA_OVERHEAD_BYTES + MTU


def carry(r: Rccc, wants: dict, seconds: float, link_share: float = 1.0) -> list[int]:
    """Requests at 0, then a link that carries what was granted (first granted, first
    carried) at `link_share` of the receiver's rate, looked at every ms. Returns the
    packets waiting on the link at each look (the last hop's queue)."""
    waiting, queue, owed = [], [], 0.0
    for qpn, edge in wants.items():
        r.request(qpn, edge, 0.0)
        waiting += [qpn] * r.edge_of(qpn)            # the unsolicited packets
    for i in range(1, int(seconds * 1000) + 1):
        before = {q: r.edge_of(q) for q in wants}
        r.advance(i / 1000)
        for q in wants:
            waiting += [q] * (r.edge_of(q) - before[q])
        owed += r.packets_per_s * link_share / 1000
        while owed >= 1 and waiting:
            owed -= 1
            r.arrival(waiting.pop(0))
        owed = min(owed, 1.0)
        queue.append(len(waiting))
    return queue


def test_credit_is_paced_at_the_link_rate_and_shared_equally():
    r = Rccc(RcccParams(initial_credit_packets=4, quantum_packets=2), 10.0, FRAME)
    wants = {1: 1000, 2: 1000, 3: 40}           # 3 wants little: the rest share its part
    carry(r, wants, 1.0)
    per_s = 10e6 / 8 / FRAME
    granted = {q: r.edge_of(q) - 4 for q in wants}
    # the unsolicited 12 packets were paid for first; then about a second's worth
    assert per_s - 12 - 10 <= sum(granted.values()) <= per_s - 12
    assert granted[3] == 36                     # all it asked for
    assert abs(granted[1] - granted[2]) <= 2    # the others alike


def test_the_cap_keeps_credit_a_slow_link_has_not_carried_out_of_the_queue():
    """Pacing alone would grant at the receiver's rate whatever the link carries; the
    cap on what is out holds the queue to it when the link is slower (a stall)."""
    r = Rccc(RcccParams(max_outstanding_packets=8), 10.0, FRAME)
    queue = carry(r, {1: 1000, 2: 1000}, 1.0, link_share=0.5)
    assert max(queue[100:]) <= 8 and r.outstanding() <= 8


def test_the_link_time_lost_while_credit_is_out_is_counted_for_the_qps_owed_it():
    """A link that carries what was granted keeps up: nothing is lost. One at half the
    rate (the credit out comes back late: a slow host's round trip) loses half the
    link's time, split between the two QPs owed credit; the run names it on a slow
    machine (incast's starved)."""
    r = Rccc(RcccParams(max_outstanding_packets=8), 10.0, FRAME)
    carry(r, {1: 10_000, 2: 10_000}, 1.0)
    assert sum(r.unused_s.values()) < 0.01
    r = Rccc(RcccParams(max_outstanding_packets=8), 10.0, FRAME)
    carry(r, {1: 10_000, 2: 10_000}, 1.0, link_share=0.5)
    assert sum(r.unused_s.values()) == pytest.approx(0.5, abs=0.03)
    assert r.unused_s[1] == pytest.approx(r.unused_s[2], rel=0.05)


def test_grants_wait_for_the_unsolicited_packets_and_idle_time_is_not_saved():
    r = Rccc(RcccParams(initial_credit_packets=4, quantum_packets=1), 10.0, FRAME)
    r.advance(0.0)
    r.advance(5.0)                               # nobody asked: nothing saved up
    r.request(1, 100, 5.0)
    per_packet_s = FRAME * 8 / 10e6
    who, when = r.next_grant()
    assert who == 1 and when == pytest.approx(5.0 + 5 * per_packet_s)   # 4 unsolicited + 1
    r.advance(when - 1e-6)
    assert r.edge_of(1) == 4
    r.advance(when + 1e-6)
    assert r.edge_of(1) == 5


def test_nobody_is_owed_credit_once_every_want_is_granted():
    r = Rccc(RcccParams(), 10.0, FRAME)
    r.request(1, 6, 0.0)
    r.advance(1.0)
    assert r.edge_of(1) == 6 and r.next_grant() is None


def rccc_pair(rate_mbps, drop=lambda f: False, **params):
    """A sender and a receiver whose credit scheduler paces `rate_mbps` (the NICs run at
    800 Mb/s: the credit is what holds the sender back)."""
    wa, wb = link(drop)
    nic_a, nic_b = Nic(wa, 800, EXT_BYTES), Nic(wb, 800, EXT_BYTES)
    region = Region(rkey=7, buf=bytearray(1 << 20))
    p = MrcParams(cc="rccc", **params)
    sched = {side: Rccc(RcccParams(**p.rccc), rate_mbps, FRAME) for side in "ab"}
    qa = nic_a.add(MrcQP(A, 0x101, 0x102, None, p, rccc=sched["a"]))
    qb = nic_b.add(MrcQP(B, 0x102, 0x101, region, p, rccc=sched["b"]))
    return nic_a, nic_b, qa, qb, region


def test_mrc_sends_only_what_the_receiver_granted_at_its_rate():
    nic_a, nic_b, qa, qb, region = rccc_pair(4.0)
    data = os.urandom(100 * MTU)
    qa.post_write(data, region.base_va, 7, tag=1)
    over = []

    def done():
        over.append(qa.snd_nxt - qb.rccc.edge_of(qb.qpn))   # sent past what was granted
        return qa.idle() and any(e[0] == "received" for e in qb.events)
    t0 = time.monotonic()
    pump([nic_a, nic_b], done)
    took = time.monotonic() - t0
    assert bytes(region.buf[:len(data)]) == data
    assert max(over) <= 0
    ideal = (100 - 4) * FRAME * 8 / 4e6          # all but the unsolicited, at 4 Mb/s
    assert 0.9 * ideal <= took <= 1.5 * ideal, (took, ideal)
    assert qa.counters.credit_requests_sent == 1 == qb.counters.credit_requests_received
    assert qb.counters.credit_sacks_sent > 10 and qa.counters.credit_stalled_ms > 0


def test_a_lost_credit_request_is_asked_again():
    lost = []

    def drop_first_request(frame):
        if parse(frame, EXT_BYTES).opcode == Opcode.MRC_CREDIT_REQUEST and not lost:
            lost.append(frame)
            return True
        return False
    nic_a, nic_b, qa, qb, region = rccc_pair(8.0, drop=drop_first_request, rto_ms=50.0)
    data = os.urandom(20 * MTU)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data and lost
    assert qa.counters.credit_requests_sent == 2 and qb.counters.credit_requests_received == 1
    assert qa.counters.timeouts == 0             # waiting for credit is not a loss


def test_rccc_needs_the_receivers_scheduler():
    with pytest.raises(ValueError, match="Rccc scheduler"):
        MrcQP(A, 1, 2, None, MrcParams(cc="rccc"))
