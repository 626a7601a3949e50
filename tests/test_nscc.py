"""NSCC (traffic/nscc.py) on its own: the four responses, the bounded and paced
decrease, quick adapt, fairness of the increase; then MRC with cc="nscc" over the
in-memory link of test_transport.py. Pure: no namespaces."""
import os

import pytest

from test_transport import mark_ce, pair, pump
from traffic.mrc import MrcParams
from traffic.nscc import Nscc, NsccParams

MTU = 1024
RATE_MBPS = 10.0
BASE_S, TARGET_S = 0.004, 0.010


def nscc(cwnd_packets=16, **params) -> Nscc:
    p = NsccParams(base_rtt_ms=BASE_S * 1e3, target_delay_ms=TARGET_S * 1e3,
                   max_cwnd_bytes=256 * MTU, **params)
    return Nscc(p, MTU, RATE_MBPS, cwnd_packets * MTU)


def acks(n: Nscc, count: int, delay_s: float, ecn: bool, t0: float = 0.0,
         every_s: float = 0.001) -> float:
    """`count` acknowledgements of one MTU each, every `every_s`: their packets waited
    `delay_s` in queues. Returns the time after the last."""
    t = t0
    for _ in range(count):
        t += every_s
        n.on_ack(MTU, BASE_S + delay_s, ecn, t, int(n.cwnd))
    return t


def test_each_pair_of_signals_picks_its_response():
    for delay, ecn, response in ((0.002, False, "proportional"), (0.015, False, "fair"),
                                 (0.002, True, "noop"), (0.015, True, "decrease")):
        n = nscc(disable_qa=True)
        n.avg_delay_s = delay                 # the average agrees with the sample
        before = n.cwnd
        acks(n, 40, delay, ecn)
        assert n.decisions[response] > 0 and \
            sum(v for k, v in n.decisions.items() if k != response) == 0, (response, n.decisions)
        eta = n.adjustments * 0.15 * MTU     # every adjustment adds eta, noop or not
        assert n.adjustments >= 5            # (40 MTUs acknowledged over 10 base RTTs)
        assert {"proportional": n.cwnd > before + eta, "fair": n.cwnd > before + eta,
                "noop": n.cwnd == pytest.approx(before + eta),
                "decrease": n.cwnd < before}[response], response


def test_the_increase_is_proportional_to_the_room_below_the_target():
    grown = []
    for delay in (0.0015, 0.005, 0.009):
        n = nscc(disable_qa=True)
        acks(n, 64, delay, False)
        grown.append(n.cwnd)
    assert grown[0] > grown[1] > grown[2] > 16 * MTU


def test_a_decrease_follows_the_average_delay_is_bounded_and_paced():
    n = nscc(disable_qa=True, eta=0.0)
    n.avg_delay_s = 2 * TARGET_S
    n.on_ack(MTU, BASE_S + 2 * TARGET_S, True, 1.0, 0)
    # kept 1 - gamma (avg - target) / avg = 1 - 0.8 / 2 = 0.6 (the average moved 1/8 toward
    # the same sample: unchanged)
    assert n.cwnd == pytest.approx(16 * MTU * 0.6, rel=1e-6)
    n.on_ack(MTU, BASE_S + 2 * TARGET_S, True, 1.0 + BASE_S / 2, 0)   # within a base RTT
    assert n.cwnd == pytest.approx(16 * MTU * 0.6, rel=1e-6)
    n.avg_delay_s = 100 * TARGET_S                                   # far past the target:
    n.on_ack(MTU, BASE_S + 100 * TARGET_S, True, 1.0 + 2 * BASE_S, 0)   # at most max_md_jump
    assert n.cwnd == pytest.approx(16 * MTU * 0.6 * 0.5, rel=1e-3)


def test_quick_adapt_sets_the_window_to_what_was_delivered_after_a_nack():
    n = nscc(cwnd_packets=200)
    t = acks(n, 1, 0.0, False)                    # the first look opens the period
    n.on_nack()
    period = BASE_S + TARGET_S
    t = acks(n, 3, TARGET_S * 2, True, t, every_s=period / 3)   # 3 more MTUs delivered
    assert n.quick_adapts == 1 and n.cwnd == 4 * MTU      # (the first one too)
    # what was in flight then answers later: not acted on (no further cut)
    assert n.ignore_bytes > 0
    acks(n, 2, TARGET_S * 2, True, t)
    assert n.cwnd == 4 * MTU and n.decisions["decrease"] == 0
    # without a NACK, a loss or a long delay, a slow flow is left alone
    quiet = nscc(cwnd_packets=200)
    acks(quiet, 10, 0.002, False, every_s=period / 3)
    assert quiet.quick_adapts == 0


def test_two_windows_under_the_same_signals_converge():
    """The gathered increase is divided by the window: the small one grows faster."""
    big, small = nscc(cwnd_packets=64, disable_qa=True), nscc(cwnd_packets=4, disable_qa=True)
    t = 0.0
    for _ in range(40):                    # a fair increase, then a common decrease
        for n in (big, small):
            n.avg_delay_s = 0.0
            acks(n, int(n.cwnd // MTU) or 1, TARGET_S * 1.5, False, t)
        t += 0.1
        for n in (big, small):
            n.avg_delay_s = TARGET_S * 2
            n.on_ack(MTU, BASE_S + TARGET_S * 2, True, t, 0)
        t += 0.1
    assert big.cwnd / small.cwnd < 1.5 < 64 / 4


def test_parameters_are_checked():
    for bad in ({"gamma": 0}, {"max_md_jump": 1.0}, {"eta": -1}):
        with pytest.raises(ValueError):
            nscc(**bad)


def test_mrc_with_nscc_delivers_and_backs_off_when_marked():
    nic_a, nic_b, qa, qb, region = pair("mrc", cc="nscc", line_rate_mbps=800,
                                        nscc={"target_delay_ms": 1.0})
    data = os.urandom(300_000)
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data and qa.nscc.decisions["proportional"] > 0
    # every round trip counts as queueing delay (a base far below it): an in-memory link
    # has no queue, and measured from its own least round trip the delay was nil
    # wherever pump()'s clock moves in even steps (a software CPU: no decrease)
    nic_a, nic_b, qa, qb, region = pair("mrc", mark=mark_ce, cc="nscc", line_rate_mbps=800,
                                        nscc={"target_delay_ms": 0.001, "base_rtt_ms": 0.001})
    qa.post_write(data, region.base_va, 7, tag=1)
    pump([nic_a, nic_b], lambda: qa.idle() and any(e[0] == "received" for e in qb.events))
    assert bytes(region.buf[:len(data)]) == data
    assert qa.nscc.decisions["decrease"] > 0 and qa.cwnd < MrcParams().init_cwnd_packets
    with pytest.raises(ValueError, match="cc must be"):
        pair("mrc", cc="cubic")
