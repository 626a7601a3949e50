"""RC and MRC transports over an in-memory link: delivery, loss recovery, spraying,
EV health, malformed input. No namespaces needed."""
import os
import random
import socket
import time

import pytest

from traffic.constants import PSN_MODULUS, TRIMMED_FRAME_BYTES, Opcode
from traffic.mrc import EXT_BYTES, MrcParams, MrcQP, generated_evs
from traffic.nic import Nic, SocketWire
from traffic.qp import Region
from traffic.rc import RcParams, RcQP
from traffic.roce import BTH_OFFSET, Path, parse

A = Path("02:fa:00:00:00:00", "02:fa:00:00:00:01", "10.1.0.1", "10.1.0.2")
B = Path("02:fa:00:00:00:01", "02:fa:00:00:00:00", "10.1.0.2", "10.1.0.1")


class MemoryWire(SocketWire):
    """One end of an in-memory link; `drop(frame)` decides losses on the way out."""

    def __init__(self, sock, drop=lambda frame: False, mark=lambda frame: frame):
        super().__init__(sock)
        self.drop, self.mark = drop, mark
        self.sent_ports = []

    def send(self, frame):
        self.sent_ports.append(parse(frame, EXT_BYTES).sport)
        return True if self.drop(frame) else super().send(self.mark(frame))


def link(drop_ab=lambda f: False, mark_ab=lambda f: f):
    sa, sb = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    for s in (sa, sb):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return MemoryWire(sa, drop_ab, mark_ab), MemoryWire(sb)


# The most the transports' clock moves per round of pump(). Natively a round takes
# ~0.25 ms (p50; a few ms when the machine is busy); on a software CPU ~10x that, with
# rounds of 100 ms, and on the real clock there every packet in flight timed out at
# once (five window cuts where one was due). Capped, the CPU looks fast enough anywhere.
MAX_ROUND_S = 1e-3


def pump(nics, done, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    now = last = time.monotonic()
    while not done():
        t = time.monotonic()
        assert t < end, "transfer did not finish"
        now, last = now + min(t - last, MAX_ROUND_S), t
        for nic in nics:
            nic.receive(now)
            nic.transmit(now)
            nic.timers(now)


def pair(kind, drop=lambda f: False, mark=lambda f: f, rate_mbps=800, **params):
    wa, wb = link(drop, mark)
    nic_a, nic_b = Nic(wa, rate_mbps, EXT_BYTES), Nic(wb, rate_mbps, EXT_BYTES)
    region = Region(rkey=7, buf=bytearray(1 << 20))
    cls, pcls = (RcQP, RcParams) if kind == "rc" else (MrcQP, MrcParams)
    qa = nic_a.add(cls(A, 0x101, 0x102, None, pcls(**params)))
    qb = nic_b.add(cls(B, 0x102, 0x101, region, pcls(**params)))
    return nic_a, nic_b, qa, qb, region


def psn_of(frame):
    return int.from_bytes(frame[BTH_OFFSET + 9:BTH_OFFSET + 12], "big")


def drop_first_tx(psns):
    """Lose the first transmission of each data PSN in `psns`."""
    pending = set(psns)

    def drop(frame):
        psn = psn_of(frame)
        if psn in pending:
            pending.discard(psn)
            return True
        return False
    return drop


@pytest.mark.parametrize("kind", ["rc", "mrc"])
def test_message_arrives_intact(kind):
    nic_a, nic_b, qa, qb, region = pair(kind)
    data = os.urandom(300_000)
    qa.post_write(data, region.base_va + 1000, 7, tag=5)
    pump([nic_a, nic_b], lambda: ("received", 5, len(data)) in qb.events and qa.idle())
    assert bytes(region.buf[1000:1000 + len(data)]) == data
    assert ("sent", 5) in qa.events
    assert qa.counters.retransmitted == 0 and qb.counters.duplicate == 0


def test_an_rc_qps_first_packet_travels_alone():
    """RC's first packet goes out alone and the rest wait for its ACK: every switch on
    the path has the flow installed before they follow (OVS's kernel datapath would
    send a new flow's first frames on late, after later ones passed them)."""
    nic_a, nic_b, qa, qb, region = pair("rc")
    data = os.urandom(20 * 1024)
    qa.post_write(data, region.base_va, 7, tag=3)
    now = time.monotonic()
    for i in range(50):
        nic_a.transmit(now + i * 1e-3)
    assert len(nic_a.wire.sent_ports) == 1, "more than the first packet before its ACK"
    pump([nic_a, nic_b], lambda: qa.idle() and ("received", 3, len(data)) in qb.events)
    assert bytes(region.buf[:len(data)]) == data
    assert qa.counters.retransmitted == 0 and qb.counters.out_of_order == 0


def test_rc_uses_one_source_port_and_mrc_sprays():
    nic_a, nic_b, qa, qb, region = pair("rc")
    qa.post_write(os.urandom(50_000), region.base_va, 7, tag=1)
    pump([nic_a, nic_b], qa.idle)
    assert len(set(nic_a.wire.sent_ports)) == 1 and nic_a.wire.sent_ports[0] >= 0xC000
    nic_a, nic_b, qa, qb, region = pair("mrc")
    qa.post_write(os.urandom(50_000), region.base_va, 7, tag=1)
    pump([nic_a, nic_b], qa.idle)
    data_ports = nic_a.wire.sent_ports
    assert set(data_ports) == set(MrcParams().evs)
    counts = [data_ports.count(p) for p in MrcParams().evs]
    assert max(counts) - min(counts) <= 1          # round robin over healthy EVs


@pytest.mark.parametrize("kind", ["rc", "mrc"])
def test_loss_recovery_rc_goes_back_n_mrc_resends_only_the_lost(kind):
    lost = {10, 40, 41, 90}
    nic_a, nic_b, qa, qb, region = pair(kind, drop=drop_first_tx(lost), window_packets=64) \
        if kind == "rc" else pair(kind, drop=drop_first_tx(lost))
    data = os.urandom(200 * 1024)
    qa.post_write(data, region.base_va, 7, tag=9)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    if kind == "mrc":
        assert qa.counters.retransmitted == len(lost)
    else:
        assert qa.counters.retransmitted > len(lost)       # everything after each loss again
        assert qb.counters.out_of_order > 0 and qb.counters.naks_sent >= 1


@pytest.mark.parametrize("kind", ["rc", "mrc"])
def test_psn_wraps(kind):
    nic_a, nic_b, qa, qb, region = pair(kind)
    start = PSN_MODULUS - 20
    for q in (qa, qb):   # both ends agree on an initial PSN just below the wrap
        if kind == "rc":
            q.snd_una = q.snd_nxt = q.snd_end = q.high_sent = q.epsn = start
        else:
            q.snd_cum = q.snd_nxt = q.snd_end = q.rcv_cum = start
            q.credit_limit = start + q.params.credit_packets
    data = os.urandom(64 * 1024)
    qa.post_write(data, region.base_va, 7, tag=3)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    assert qa.counters.retransmitted == 0


def test_mrc_retires_a_dead_ev_and_keeps_going():
    dead = 0xF003
    nic_a, nic_b, qa, qb, region = pair(
        "mrc", drop=lambda f: int.from_bytes(f[34:36], "big") == dead, ev_probe_after_ms=5000)
    data = os.urandom(400 * 1024)
    qa.post_write(data, region.base_va, 7, tag=2)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    ev = {e["port"]: e for e in qa.ev_report()}
    assert ev[dead]["status"] == "assumed_bad" and ev[dead]["retirements"] == 1
    assert [h[1:] for h in ev[dead]["history"]] == [["assumed_bad", "8 losses in a row"]]
    p = MrcParams()   # retired within the first window, before its losses were even known
    assert ev[dead]["sent"] <= p.init_cwnd_packets / len(p.evs) + p.ev_fail_losses
    assert qa.counters.retransmitted == ev[dead]["lost"]    # only what was lost, once
    assert all(e["status"] == "good" for p, e in ev.items() if p != dead)


def test_mrc_probes_an_assumed_bad_ev_out_of_band_and_readmits_it():
    """While the path of EV 0xF003 is dead, its probes go unanswered and no data is sent
    on it; once the path is back, a probe is answered and the EV carries data again.
    (8 Mb/s: the message lasts ~1 s, and probes go out only while a QP has data.)"""
    dead, path_down = 0xF003, [True]

    def drop(frame):
        return path_down[0] and int.from_bytes(frame[34:36], "big") == dead
    nic_a, nic_b, qa, qb, region = pair("mrc", drop=drop, rate_mbps=8, ev_probe_after_ms=20)
    qa.post_write(os.urandom(1000 * 1024), region.base_va, 7, tag=1)
    ev = {e.port: e for e in qa.evs}[dead]
    pump([nic_a, nic_b], lambda: any(h[2] == "probe unanswered" for h in ev.history))
    sent_while_down, probes_while_down = ev.sent, ev.probes
    assert ev.status in ("assumed_bad", "probing") and ev.retirements == 1
    path_down[0] = False
    pump([nic_a, nic_b], lambda: ev.status == "good")           # the next probe is answered
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert ev.status == "good" and ev.sent > sent_while_down     # readmitted, carrying data
    states = [h[1] for h in ev.history]
    assert states[0] == "assumed_bad" and states[-2:] == ["probing", "good"]
    assert ev.history[-1][2] == "probe answered"
    # probes went out while it was down, each unanswered, and no data followed them
    assert "probe unanswered" in [h[2] for h in ev.history] and probes_while_down >= 1
    assert sent_while_down <= MrcParams().init_cwnd_packets / len(MrcParams().evs) \
        + MrcParams().ev_fail_losses


def test_a_generated_ev_profile_is_every_combination_of_its_fields():
    """MRC's generated EV profile: a field per tier, 6 bits each above 0xE000; a QP
    given `ev_fields` sprays over every combination, minus what it denies."""
    assert generated_evs(((0, 3),)) == (0xE000, 0xE001, 0xE002, 0xE003)
    assert generated_evs(((0, 1), (2, 3))) == (0xE080, 0xE081, 0xE0C0, 0xE0C1)
    for bad in ((), ((0, 64),), ((2, 1),), ((0, 1),) * 3):
        with pytest.raises(ValueError, match="generated EV profile"):
            generated_evs(bad)
    nic_a, nic_b, qa, qb, region = pair("mrc", ev_fields=((0, 3), (0, 1)), deny_evs=(0xE041,))
    assert [ev.port for ev in qa.evs] == list(generated_evs(((0, 3), (0, 1))))
    qa.post_write(os.urandom(64 * 1024), region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert set(nic_a.wire.sent_ports) == set(generated_evs(((0, 3), (0, 1)))) - {0xE041}


def test_an_idle_mrc_qp_does_not_probe():
    """Probes test a path for data to come: once its messages are done a QP sends none,
    however many EVs it holds assumed bad (the agent's NICs run on between collectives,
    and probes sent then would be on the wire but in no report)."""
    _, _, qa, qb, region = pair("mrc")
    ev = qa.evs[3]
    ev.retired_at = 0.0
    qa.set_ev(ev, "assumed_bad", 0.0, "losses")
    assert qa.idle() and qa.deadline() is None and qa.on_timer(10.0) == []
    qa.post_write(bytes(1024), region.base_va, 7, tag=1)
    assert [parse(f, EXT_BYTES).opcode for f in qa.on_timer(10.0)] == [Opcode.MRC_PROBE]


def test_a_denied_ev_is_never_used_nor_probed():
    nic_a, nic_b, qa, qb, region = pair("mrc", deny_evs=(0xF001, 0xF002))
    qa.post_write(os.urandom(64 * 1024), region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    used = set(nic_a.wire.sent_ports)
    assert used == set(MrcParams().evs) - {0xF001, 0xF002}
    qa.deny_ev(0xF000, time.monotonic(), "a failed plane")       # at run time, too
    qa.post_write(os.urandom(64 * 1024), region.base_va, 7, tag=2)
    before = len(nic_a.wire.sent_ports)
    pump([nic_a, nic_b], lambda: qa.idle() and len(qb.events) == 2)
    assert 0xF000 not in nic_a.wire.sent_ports[before:]
    assert {e.port: e.history for e in qa.evs}[0xF000][-1][1:] == ["denied", "a failed plane"]
    with pytest.raises(ValueError, match="every EV"):
        pair("mrc", evs=(1, 2), deny_evs=(1, 2))


def test_mrc_never_goes_below_min_active_evs():
    nic_a, nic_b, qa, qb, region = pair(
        "mrc", drop=lambda f: int.from_bytes(f[34:36], "big") in (0xF000, 0xF001, 0xF002),
        evs=(0xF000, 0xF001, 0xF002, 0xF003), min_active_evs=2, ev_probe_after_ms=5000)
    data = os.urandom(200 * 1024)
    qa.post_write(data, region.base_va, 7, tag=2)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events),
         timeout_s=30)
    assert bytes(region.buf[:len(data)]) == data
    assert len(qa.active_evs()) >= 2


@pytest.mark.parametrize("kind", ["rc", "mrc"])
def test_receiver_survives_malformed_input(kind):
    nic_a, nic_b, qa, qb, region = pair(kind)
    data = os.urandom(20_000)
    qa.post_write(data, region.base_va, 7, tag=1)
    good = []
    nic_a.wire.drop = lambda f: good.append(f) or False
    pump([nic_a, nic_b], qa.idle)
    rng = random.Random(1)
    for _ in range(2000):
        f = bytearray(rng.choice(good))
        mutation = rng.randrange(4)
        if mutation == 0:
            f = f[:rng.randrange(len(f))]                            # truncated
        elif mutation == 1:
            f[rng.randrange(14, len(f))] ^= 1 << rng.randrange(8)    # bit flip: bad ICRC
        elif mutation == 2:
            f = bytearray(os.urandom(len(f)))                        # noise
        else:
            f[BTH_OFFSET] = rng.randrange(256)                       # unknown opcode (bad ICRC too)
        nic_b.deliver(bytes(f), time.monotonic())
    assert nic_b.malformed > 1000
    # Flips in the fields the ICRC leaves out by design (ECN, TTL, checksums, FECN/BECN)
    # leave a valid frame: a duplicate. Nothing else was taken as data.
    assert qb.counters.received - qb.counters.duplicate == len(good)
    assert qb.counters.bytes_delivered == 20_000 and bytes(region.buf[:20_000]) == data


# --- DCQCN -----------------------------------------------------------------------
from traffic.dcqcn import DcqcnParams, NotificationPoint, ReactionPoint  # noqa: E402


def test_dcqcn_reaction_point_cuts_then_recovers():
    p = DcqcnParams()                        # real time constants, 100 Gb/s line
    rp = ReactionPoint(100e9, p, now=0.0)
    rp.on_cnp(0.0)
    assert rp.rc == pytest.approx(50e9)      # alpha starts at 1: the first cut halves
    assert rp.alpha == pytest.approx(1 - p.g + p.g)
    for _ in range(3):
        rp.on_cnp(0.0)
    cut = rp.rc
    assert cut < 10e9
    t = 0.0
    for _ in range(p.fast_recovery_events):   # fast recovery halves the gap to Rt each event
        t += p.rate_timer_s
        rp.tick(t)
    assert cut < rp.rc < rp.rt
    rp.tick(t + 2000 * p.rate_timer_s)        # additive then hyper increase: back at line rate
    assert rp.rc == pytest.approx(100e9)
    assert rp.alpha < 0.001                  # no CNPs: alpha decayed


def test_dcqcn_time_constants_stretch_with_the_rate_scale():
    p = DcqcnParams().at_scale(1000)
    assert p.alpha_timer_s == pytest.approx(55e-3) and p.cnp_interval_s == pytest.approx(50e-3)


def test_notification_point_sends_at_most_one_cnp_per_interval():
    np_ = NotificationPoint(DcqcnParams(cnp_interval_s=0.01))
    sent = [np_.should_notify(True, t / 1000) for t in range(100)]   # CE every ms for 100 ms
    assert sum(sent) == 10
    assert not np_.should_notify(False, 1.0)


def mark_ce(frame):
    """What a congested switch does (issue 4): set CE in the IP ECN field (which the
    ICRC leaves out, so the frame stays valid)."""
    f = bytearray(frame)
    f[15] |= 0b11
    return bytes(f)


def test_rc_sender_slows_down_when_the_fabric_marks_ce():
    nic_a, nic_b, qa, qb, region = pair("rc", mark=mark_ce, line_rate_mbps=800, rate_scale=10)
    data = os.urandom(400_000)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    assert qb.counters.ecn_marked == qb.counters.received
    assert qb.counters.cnps_sent > 0 and qa.counters.cnps_received == qb.counters.cnps_sent
    assert qa.rate_bps < 800e6 * 0.6          # cut well below the line rate


def test_rc_sender_keeps_line_rate_without_marks():
    nic_a, nic_b, qa, qb, region = pair("rc", line_rate_mbps=800, rate_scale=10)
    qa.post_write(os.urandom(400_000), region.base_va, 7, tag=1)
    pump([nic_a, nic_b], qa.idle)
    assert qb.counters.cnps_sent == 0 and qa.rate_bps == pytest.approx(800e6)


def test_a_slow_rc_sender_asks_for_acks_before_its_timer_runs_out():
    """DCQCN may cut a sender to 1% of its line; the responder coalesces 16 packets per
    ACK. At 0.5 Mb/s 16 packets take 0.28 s against a 50 ms timer: without asking for
    ACKs itself, the sender would time out and resend what was not lost."""
    nic_a, nic_b, qa, qb, region = pair("rc", line_rate_mbps=100, rate_scale=10)

    def cut_to_half_a_megabit(nbytes, now):     # as DCQCN's deepest cuts leave it
        qa.rate_bps = 0.5e6
        qa.account(nbytes, now)
    qa._rate_control = cut_to_half_a_megabit
    data = os.urandom(40 * 1024)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    assert qa.counters.timeouts == 0 and qa.counters.retransmitted == 0
    assert qb.counters.acks_sent >= 40      # one per packet: each took > rto / 4


def test_mrc_timer_follows_a_slow_receivers_round_trip():
    """A receiver host that gets the CPU for 20 ms in every 100 ms (as under a software
    CPU beside busy neighbours) answers up to 80 ms late: within the 100 ms margin of
    MRC's timer over the round trip, but only if what the receiver coalesced goes out
    within its slice (sack_delay_ms), not a slice later, when the sender's window waits
    for it. Nothing is resent, nothing was lost. (A stall longer than the margin would
    time packets out: the margin is what a lab host's stalls must stay under.)"""
    nic_a, nic_b, qa, qb, region = pair("mrc")
    data = os.urandom(300 * 1024)
    qa.post_write(data, region.base_va, 7, tag=1)
    t0 = time.monotonic()
    while not (qa.idle() and any(e[0] == "received" for e in qb.events)):
        now = time.monotonic()
        assert now < t0 + 30, "transfer did not finish"
        nics = [nic_a, nic_b] if (now - t0) % 0.1 > 0.08 else [nic_a]
        for nic in nics:
            nic.receive(now)
            nic.transmit(now)
            nic.timers(now)
        time.sleep(0.001)
    assert bytes(region.buf[:len(data)]) == data
    assert qa.counters.timeouts == 0 and qa.counters.retransmitted == 0
    assert qb.counters.acks_sent < qb.counters.received     # still coalesced


def test_mrc_timer_before_and_after_samples():
    q = MrcQP(A, 0x101, 0x102, None)
    assert q.rto_s == MrcParams().initial_rto_ms / 1000         # no sample yet
    for _ in range(20):
        q._rtt_sample(0.002, 0.0)                               # a quick, steady path
    assert q.rto_s == pytest.approx(0.002 + MrcParams().rto_ms / 1000)   # the margin's floor
    for i in range(20):
        q._rtt_sample(0.05 if i % 2 else 0.25, 0.0)            # a jittery one
    assert q.rto_s > q.srtt + 0.2 > q.srtt + MrcParams().rto_ms / 1000   # 4 rttvar rules


@pytest.mark.parametrize("rate_mbps", [100.0, 10.0, 2.0, 0.625])
def test_mrc_times_stretch_with_a_slow_links_packet_time(rate_mbps):
    """A full 64 KB port drains in 52 ms at 10 Mb/s, within the timer's 100 ms margin
    over a steady round trip; at 0.625 Mb/s (a calibrated slow machine's x0.06) it takes
    840 ms, and a fixed margin timed out packets still queued (natively, at those rates:
    14,126 timeouts in trimming's drop variant). The margin, the delay that counts as
    congestion, the SACK coalescing delay, the probe's wait and the credit pool's window
    stand for as many packets at any rate up to TIME_REFERENCE_MBPS, and stay as they
    are above it."""
    from traffic.mrc import TIME_REFERENCE_MBPS, CreditPool
    p = MrcParams(line_rate_mbps=rate_mbps)
    q = MrcQP(A, 0x101, 0x102, None, p)
    for _ in range(20):
        q._rtt_sample(0.002, 0.0)                       # a quick, steady path
    drain_s = 64 * 1024 * 8 / (rate_mbps * 1e6)
    assert q.rto_s - q.srtt > 1.5 * drain_s
    packet_s = (p.mtu_bytes * 8) / (rate_mbps * 1e6)
    reference_packet_s = (p.mtu_bytes * 8) / (TIME_REFERENCE_MBPS * 1e6)
    packets = {"margin": p.rto_ms, "target": p.target_delay_ms, "sack": p.sack_delay_ms,
               "probe": p.ev_probe_after_ms, "active": CreditPool.ACTIVE_S * 1e3}
    got = {"margin": q.rto_margin_s, "target": q.target_delay_s, "sack": q.sack_delay_s,
           "probe": q.ev_probe_after_s,
           "active": CreditPool(8, line_rate_mbps=rate_mbps).active_s}
    for k, ms in packets.items():
        at_reference = ms / 1e3 / reference_packet_s
        expected = at_reference * packet_s if rate_mbps < TIME_REFERENCE_MBPS else ms / 1e3
        assert got[k] == pytest.approx(expected), k


def test_mrc_receiver_answers_what_it_coalesced_within_sack_delay():
    """A sender whose window is full waits for the SACK of its last packets: the
    receiver's coalescing timer sends it."""
    _, _, qa, qb, region = pair("mrc")
    qa.post_write(os.urandom(16 * 1024), region.base_va, 7, tag=1)
    frames = [qa.next_frame(0.0) for _ in range(2)]
    assert [qb.on_packet(parse(f, EXT_BYTES), 0.0) for f in frames] == [[], []]   # coalesced
    delay_s = MrcParams().sack_delay_ms / 1000
    assert qb.deadline() == pytest.approx(delay_s)
    assert qb.on_timer(delay_s / 2) == []
    [sack] = qb.on_timer(delay_s)
    assert psn_of(sack) == 2 and qb.deadline() is None              # both answered


def test_mrc_receiver_answers_at_once_at_the_credit_edge():
    """With many senders a receiver grants each fewer packets than it coalesces
    (CreditPool: budget / senders, at least 2): the packet at the edge of what it
    granted is answered at once, or its sender would wait for the coalescing timer."""
    _, _, qa, qb, region = pair("mrc", credit_packets=3, credit_budget_packets=0)
    qa.post_write(os.urandom(16 * 1024), region.base_va, 7, tag=1)
    frames = [qa.next_frame(0.0) for _ in range(3)]
    assert not qa.pending(0.0)                                      # no credit left
    out = [qb.on_packet(parse(f, EXT_BYTES), 0.0) for f in frames]
    assert [len(o) for o in out] == [0, 0, 1]
    qa.on_packet(parse(out[2][0], EXT_BYTES), 0.001)
    assert qa.pending(0.001) and qa.credit_limit == 3 + 3


def test_mrc_resent_packets_neither_time_the_path_nor_pass_others():
    """Karn: the answer to a resent packet may be the first sending's, so it gives no
    RTT sample, and it does not count as sent after the packets in flight (it would
    'pass' them by more than reorder_packets, declaring them lost)."""
    _, _, qa, qb, region = pair("mrc")
    qa.post_write(os.urandom(40 * 1024), region.base_va, 7, tag=1)
    first = qa.next_frame(0.0)
    for _ in range(19):
        qa.next_frame(0.5)
    qa.on_timer(qa.rto_s + 0.001)                    # seq 0 times out (no answer yet)
    assert qa.counters.timeouts == 1
    qa.next_frame(1.1)                               # and is resent, after seqs 1-19
    qb.on_packet(parse(first, EXT_BYTES), 1.2)       # the first sending arrives late
    [sack] = qb.on_timer(1.3)
    qa.on_packet(parse(sack, EXT_BYTES), 1.3)
    assert qa.srtt is None and qa.snd_cum == 1
    assert not qa.retx and qa.counters.timeouts == 1   # seqs 1-19 still in flight, not lost


def test_mrc_finds_a_lost_tail_packet_without_its_retransmit_timer():
    """The last packets of a message have too few after them to be passed by
    reorder_packets: once nothing new may go, a packet that a later one passed is lost
    after tail_loss_srtts smoothed RTTs (RACK's time rule), not after the RTO's 100 ms."""
    nic_a, nic_b, qa, qb, region = pair("mrc", drop=drop_first_tx({18}))
    data = os.urandom(20 * 1024)
    qa.post_write(data, region.base_va, 7, tag=1)
    t0 = time.monotonic()
    pump([nic_a, nic_b], lambda: ("received", 1, len(data)) in qb.events and qa.idle())
    assert bytes(region.buf[:len(data)]) == data
    assert qa.counters.retransmitted == 1 and qa.counters.timeouts == 0
    assert time.monotonic() - t0 < MrcParams().rto_ms / 1000


def test_mrc_tail_rule_waits_for_an_answer_the_receiver_may_hold():
    """A packet passed by a later one at a message's tail is lost after tail_loss_srtts
    smoothed RTTs plus the receiver's SACK delay, not before: its answer may be waiting
    in the receiver's coalescing. (With 2 SRTTs alone, ~3 ms natively against a 5 ms
    delay, a sprayed ring resent ~22 packets a run that had all arrived.)"""
    _, _, qa, qb, region = pair("mrc")
    qa.post_write(os.urandom(4 * 1024), region.base_va, 7, tag=1)
    frames = [qa.next_frame(0.0) for _ in range(4)]
    qa._rtt_sample(0.001, 0.0)                       # a quick path: 2 SRTTs are 2 ms
    # the last packet arrives first and is answered at once (it ends the message); the
    # others are on their way, or held by the receiver's coalescing
    [sack] = qb.on_packet(parse(frames[3], EXT_BYTES), 0.0005)
    qa.on_packet(parse(sack, EXT_BYTES), 0.0006)
    f, due = qa._tail_loss_due()
    delay_s = MrcParams().sack_delay_ms / 1000
    assert due == pytest.approx(f.sent_at + 2 * qa.srtt + delay_s)
    qa.on_timer(0.004)                               # past 2 SRTTs, within the delay
    assert not qa.retx and qa.counters.retransmitted == 0
    qa.on_timer(due + 1e-6)
    assert qa.retx                                   # now it counts as lost


def test_mrc_losses_on_a_dead_ev_shrink_the_window_once():
    """A loss on an EV whose previous packet was lost too points at the path: the EV is
    retired after ev_fail_losses of them, and only the first shrank the window."""
    dead = MrcParams().evs[0]
    nic_a, nic_b, qa, qb, region = pair(
        "mrc", drop=lambda f: parse(f, EXT_BYTES).sport == dead and f[BTH_OFFSET] != 0xC3)
    decreases = []
    shrink = qa._decrease
    qa._decrease = lambda now: (decreases.append(now), shrink(now))
    data = os.urandom(300_000)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: ("received", 1, len(data)) in qb.events and qa.idle())
    ev = next(e for e in qa.evs if e.port == dead)
    assert ev.retirements >= 1 and ev.lost >= MrcParams().ev_fail_losses
    assert len(decreases) == 1, decreases


def test_the_wait_for_timeouts_counts_overlapping_waits_once():
    """timeout_wait_ms: how long lost packets waited for the timers that found them;
    two packets lost 10 ms apart waited rto + 10 ms together, not twice the rto."""
    _, _, qa, _, region = pair("mrc")
    qa.post_write(os.urandom(4 * 1024), region.base_va, 7, tag=1)
    qa.next_frame(0.0)
    qa.next_frame(0.01)
    qa.on_timer(qa.rto_s + 0.001)                     # the first times out
    qa.on_timer(qa.rto_s + 0.011)                     # the second
    assert qa.counters.timeouts == 2
    assert qa.counters.timeout_wait_ms == pytest.approx((qa.rto_s + 0.011) * 1e3)
    _, _, ra, _, region = pair("rc")
    ra.post_write(os.urandom(4 * 1024), region.base_va, 7, tag=1)
    ra.next_frame(0.0)
    ra.on_timer(ra.rto_s + 0.002)                     # go back N: waited from the send
    assert ra.counters.timeout_wait_ms == pytest.approx((ra.rto_s + 0.002) * 1e3)


def test_mrc_window_shrinks_on_ecn_echo():
    nic_a, nic_b, qa, qb, region = pair("mrc", mark=mark_ce)
    data = os.urandom(300_000)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    assert qa.ecn_echoes == qb.counters.received      # every SACK echoed the CE mark
    assert qa.cwnd < MrcParams().init_cwnd_packets / 2


def trim_first_tx(psns):
    """A switch trimming the first transmission of each data PSN in `psns` (its queue
    full then): what goes on is the frame's headers, DSCP_TRIMMED."""
    from scapy.layers.l2 import Ether
    from traffic.packets import trimmed
    pending = set(psns)

    def mark(frame):
        psn = psn_of(frame)
        if psn in pending and len(frame) > TRIMMED_FRAME_BYTES:
            pending.discard(psn)
            return bytes(trimmed(Ether(frame)))
        return frame
    return mark


@pytest.mark.parametrize("kind", ["rc", "mrc"])
def test_a_trimmed_packet_mrc_resends_at_its_nack_rc_goes_back_n(kind):
    """MRC: each trimmed packet is NACKed and resent at once, within a round trip and
    never by its timer; nothing else is resent. RC has no TRIM NACK: a trimmed packet is
    a lost one, and go-back-N resends it and all after it."""
    trims = {10, 40, 41, 90}
    nic_a, nic_b, qa, qb, region = pair(kind, mark=trim_first_tx(trims))
    data = os.urandom(200 * 1024)
    qa.post_write(data, region.base_va, 7, tag=9)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    assert qb.counters.trimmed_received == len(trims)
    if kind == "mrc":
        c = qa.counters
        assert qb.counters.trim_nacks_sent == c.trim_nacks_received == len(trims)
        assert c.retransmitted == c.trim_resent == len(trims) and c.timeouts == 0
        assert 0 < c.resend_delay_ms_max < MrcParams().rto_ms
        assert qb.counters.duplicate == 0
    else:
        assert qa.counters.retransmitted > len(trims)


def test_mrc_ignores_a_nack_for_what_arrived_meanwhile():
    """A NACK for a packet already acknowledged (or already waiting to be resent)
    resends nothing."""
    _, _, qa, qb, region = pair("mrc")
    qa.post_write(os.urandom(8 * 1024), region.base_va, 7, tag=1)
    frames = [qa.next_frame(0.0) for _ in range(8)]
    from scapy.layers.l2 import Ether
    from traffic.packets import trimmed
    [nack] = qb.on_packet(parse(bytes(trimmed(Ether(frames[3]))), EXT_BYTES), 0.01)
    qa.on_packet(parse(nack, EXT_BYTES), 0.02)
    qa.on_packet(parse(nack, EXT_BYTES), 0.02)            # the same NACK twice
    assert qa.retx == [3] and qa.counters.trim_nacks_received == 2
    qa.next_frame(0.03)
    sacks = [s for f in frames[:3] + frames[4:] for s in qb.on_packet(parse(f, EXT_BYTES), 0.04)]
    sacks += qb.on_timer(1.0)
    qa.on_packet(parse(sacks[-1], EXT_BYTES), 1.0)       # all but seq 3
    assert qa.snd_cum == 3 and list(qa.inflight) == [3]
    qa.on_packet(parse(nack, EXT_BYTES), 1.0)             # a late copy: seq 3 in flight again
    assert not qa.retx and qa.counters.retransmitted == 1


# --- delivery modes ----------------------------------------------------------------------
def test_ordered_delivery_completes_messages_in_the_order_sent():
    """Message 1's first packet is lost and resent after message 2 has arrived whole:
    unordered delivery completes 2 first, ordered holds it until 1 is complete."""
    orders = {}
    for delivery in ("unordered", "ordered"):
        nic_a, nic_b, qa, qb, region = pair("mrc", drop=drop_first_tx({0}), delivery=delivery)
        qa.post_write(os.urandom(4 * 1024), region.base_va, 7, tag=1)        # PSNs 0-3
        qa.post_write(os.urandom(4 * 1024), region.base_va + 8192, 7, tag=2)  # PSNs 4-7
        pump([nic_a, nic_b], lambda: qa.idle() and len(qb.events) == 2)
        orders[delivery] = [tag for kind, tag, _ in qb.events]
        assert qa.counters.retransmitted == 1
    assert orders == {"unordered": [2, 1], "ordered": [1, 2]}


def test_unreliable_delivery_sends_once_and_never_answers():
    """Datagrams: every packet once, no SACK back, no resend; a message whose packet is
    lost never completes, the others do."""
    lost = {3, 17, 40}                         # one-packet messages: PSN = message
    nic_a, nic_b, qa, qb, region = pair("mrc", drop=drop_first_tx(lost), delivery="unreliable")
    for tag in range(50):
        qa.post_write(os.urandom(512), region.base_va + tag * 1024, 7, tag=tag)
    pump([nic_a, nic_b], lambda: qa.idle() and len(qb.events) == 50 - len(lost))
    time.sleep(0.05)
    nic_b.receive(time.monotonic())
    assert sorted(tag for _, tag, _ in qb.events) == [t for t in range(50) if t not in lost]
    assert [e for e in qa.events if e[0] == "sent"] == [("sent", t) for t in range(50)]
    assert qa.counters.sent == 50 and qa.counters.retransmitted == 0
    assert nic_b.wire.sent_ports == [] and qb.counters.acks_sent == 0
    with pytest.raises(ValueError, match="delivery must be"):
        pair("mrc", delivery="sometimes")


# --- PFC: the host side -------------------------------------------------------------
from traffic.constants import PRIORITY_CNP, PRIORITY_ROCE_DATA  # noqa: E402
from traffic.packets import pause_8023x, pfc_pause, pfc_resume  # noqa: E402


def test_nic_honours_pfc_pause_and_resume_per_priority():
    nic_a, nic_b, qa, qb, region = pair("rc", dcqcn=False)
    qa.post_write(os.urandom(2_000_000), region.base_va, 7, tag=1)
    t0 = time.monotonic()
    pump([nic_a, nic_b], lambda: len(nic_a.wire.sent_ports) > 50)
    quanta_per_s = 800e6 / 512                           # the NIC runs at 800 Mb/s
    nic_a.deliver(bytes(pfc_pause({PRIORITY_ROCE_DATA: 0xFFFF})), time.monotonic())
    assert nic_a.paused_until[PRIORITY_ROCE_DATA] > time.monotonic() + 0.9 * 0xFFFF / quanta_per_s
    assert nic_a.paused_until[PRIORITY_CNP] < time.monotonic()   # other priorities flow
    sent = len(nic_a.wire.sent_ports)
    end = time.monotonic() + 0.03
    while time.monotonic() < end:                          # paused: not one data frame
        pump([nic_a, nic_b], lambda: True)
        nic_a.receive(time.monotonic())
        nic_a.transmit(time.monotonic())
    assert len(nic_a.wire.sent_ports) == sent
    nic_a.deliver(bytes(pfc_resume([PRIORITY_ROCE_DATA])), time.monotonic())
    pump([nic_a, nic_b], lambda: len(nic_a.wire.sent_ports) > sent + 50)
    assert nic_a.pause_frames_received == 2 and nic_a.paused_s[PRIORITY_ROCE_DATA] > 0.02
    assert time.monotonic() - t0 < 5


def test_8023x_pause_stops_every_priority():
    nic_a, *_ = pair("rc", dcqcn=False)
    now = time.monotonic()
    nic_a.deliver(bytes(pause_8023x(1000)), now)
    assert nic_a.paused_until == [pytest.approx(now + 1000 * 512 / 800e6)] * 8


# --- a multi-plane NIC: one port per plane --------------------------------------------
A1 = Path("02:f1:00:00:00:00", "02:f1:00:00:00:01", "10.11.0.1", "10.11.0.2")
B1 = Path("02:f1:00:00:00:01", "02:f1:00:00:00:00", "10.11.0.2", "10.11.0.1")


def two_planes(kind, drop_plane1=lambda f: False, rate_mbps=400, **params):
    """Two hosts whose NICs have a port on each of two planes (two in-memory links)."""
    wa0, wb0 = link()
    wa1, wb1 = link(drop_plane1)
    nic_a, nic_b = Nic(wa0, rate_mbps, EXT_BYTES), Nic(wb0, rate_mbps, EXT_BYTES)
    nic_a.add_plane(wa1, rate_mbps, A1.src_mac, A.src_mac)
    nic_b.add_plane(wb1, rate_mbps, B1.src_mac, B.src_mac)
    region = Region(rkey=7, buf=bytearray(1 << 20))
    if kind == "rc":
        qa = nic_a.add(RcQP(A, 0x101, 0x102, None, RcParams(**params)))
        qb = nic_b.add(RcQP(B, 0x102, 0x101, region, RcParams(**params)))
    else:
        qa = nic_a.add(MrcQP(A, 0x101, 0x102, None, MrcParams(**params), planes=(A1,)))
        qb = nic_b.add(MrcQP(B, 0x102, 0x101, region, MrcParams(**params), planes=(B1,)))
    return nic_a, nic_b, qa, qb, region, (wa0, wa1, wb0, wb1)


def test_mrc_sprays_over_every_plane_and_answers_on_the_plane_it_heard():
    nic_a, nic_b, qa, qb, region, (wa0, wa1, wb0, wb1) = two_planes("mrc")
    data = os.urandom(400_000)
    qa.post_write(data, region.base_va, 7, tag=3)
    pump([nic_a, nic_b], lambda: ("received", 3, len(data)) in qb.events and qa.idle())
    assert bytes(region.buf[:len(data)]) == data
    n0, n1 = len(wa0.sent_ports), len(wa1.sent_ports)
    assert abs(n0 - n1) <= 0.1 * (n0 + n1)          # each plane's port paced on its own
    assert set(wa0.sent_ports) == set(wa1.sent_ports) == set(MrcParams().evs)
    assert wb0.sent_ports and wb1.sent_ports         # SACKs on both planes...
    assert set(wb1.sent_ports) <= set(MrcParams().evs)   # ...on the EVs they answer
    assert {ev.plane for ev in qa.evs} == {0, 1} and len(qa.evs) == 2 * len(MrcParams().evs)


def test_mrc_survives_a_dead_plane_and_rc_keeps_to_plane_0():
    dead = {"on": False}
    nic_a, nic_b, qa, qb, region, (wa0, wa1, *_) = two_planes(
        "mrc", drop_plane1=lambda f: dead["on"], rto_ms=20.0)
    data = os.urandom(600_000)
    qa.post_write(data[:100_000], region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: ("received", 1, 100_000) in qb.events and qa.idle())
    dead["on"] = True                                # plane 1 fails: every frame lost
    qa.post_write(data[100_000:], region.base_va + 100_000, 7, tag=2)
    pump([nic_a, nic_b], lambda: ("received", 2, 500_000) in qb.events and qa.idle())
    assert bytes(region.buf[:len(data)]) == data
    bad = [ev for ev in qa.evs if ev.status != "good"]
    assert bad and all(ev.plane == 1 for ev in bad)
    assert len(bad) == len(MrcParams().evs)          # every EV of the dead plane retired
    assert qa.counters.retransmitted > 0
    nic_a, nic_b, ra, rb, region, (wa0, wa1, *_) = two_planes("rc")
    ra.post_write(data[:50_000], region.base_va, 7, tag=1)
    pump([nic_a, nic_b], ra.idle)
    assert wa0.sent_ports and not wa1.sent_ports


def test_a_pause_holds_its_own_plane_only():
    from traffic import pause
    nic_a, nic_b, qa, qb, region, (wa0, wa1, *_) = two_planes("mrc")
    nic_a.deliver(pause.pfc_frame("02:00:00:00:00:01", {PRIORITY_ROCE_DATA: 0xFFFF}),
                  time.monotonic(), nic_a.ports[1])
    assert nic_a.ports[1].paused_until[PRIORITY_ROCE_DATA] > time.monotonic()
    assert nic_a.ports[0].paused_until[PRIORITY_ROCE_DATA] < time.monotonic()
    data = os.urandom(100_000)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: ("received", 1, len(data)) in qb.events and qa.idle())
    assert bytes(region.buf[:len(data)]) == data
    assert wa0.sent_ports and not wa1.sent_ports     # plane 1's port sent nothing
