"""netem on a GPU host's link: the delay shows in the RTT, the loss at its rate."""
import math
import statistics

import pytest

from kernel_lab import echo_rtts_ms, leaf_spine
from lab.kernel.netem import LinkImpairment, Netem

pytestmark = pytest.mark.kernel

DELAY_MS = 40.0
# The two medians differ by the delay plus the difference of two medians of a noisy
# software-CPU RTT; netem's own timer is precise to well under a millisecond.
DELAY_TOLERANCE_MS = 5.0
RTT_SAMPLES = 30
LOSS_PCT = 10.0
LOSS_PROBES = 2000
LOSS_SIGMAS = 4      # binomial: a correct netem fails this 6 times in 100,000 runs


def _netem_on(net, host: str, impairment: LinkImpairment) -> Netem:
    return Netem(net.host_pid(host), net.fabric.host(host).interface().name, impairment)


def test_netem_delay_adds_its_delay_to_the_rtt(tmp_path):
    with leaf_spine(tmp_path, spines=2, leaves=2, hosts_per_leaf=1) as net:
        echo_rtts_ms(net, "g0", "g1", 5, rate_pps=50)   # warm-up: neighbours, flows
        base = echo_rtts_ms(net, "g0", "g1", RTT_SAMPLES, rate_pps=20)
        netem = _netem_on(net, "g0", LinkImpairment(delay_ms=DELAY_MS))
        with netem:
            delayed = echo_rtts_ms(net, "g0", "g1", RTT_SAMPLES, rate_pps=20)
        after = echo_rtts_ms(net, "g0", "g1", RTT_SAMPLES, rate_pps=20)
        kinds = {q["kind"] for q in netem.qdiscs()}
    assert None not in base + delayed + after, "echoes were lost on a link without loss"
    added = statistics.median(delayed) - statistics.median(base)
    print(f"median RTT {statistics.median(base):.2f} ms -> {statistics.median(delayed):.2f} "
          f"ms with {DELAY_MS} ms netem delay (+{added:.2f}); after: "
          f"{statistics.median(after):.2f} ms")
    assert min(delayed) >= DELAY_MS, "an echo came back sooner than the delay allows"
    assert abs(added - DELAY_MS) <= DELAY_TOLERANCE_MS
    # leaving the context restores the link's own queue, and its RTT
    assert "netem" not in kinds and "bfifo" in kinds
    assert statistics.median(after) < statistics.median(base) + DELAY_TOLERANCE_MS


def test_netem_loss_matches_its_rate(tmp_path):
    with leaf_spine(tmp_path, spines=2, leaves=2, hosts_per_leaf=1) as net:
        echo_rtts_ms(net, "g0", "g1", 5, rate_pps=50)
        with _netem_on(net, "g0", LinkImpairment(loss_pct=LOSS_PCT)) as netem:
            rtts = echo_rtts_ms(net, "g0", "g1", LOSS_PROBES, rate_pps=400)
            counters = netem.counters()
    lost = sum(r is None for r in rtts)
    p = LOSS_PCT / 100
    expected, sigma = LOSS_PROBES * p, math.sqrt(LOSS_PROBES * p * (1 - p))
    print(f"lost {lost} of {LOSS_PROBES} echoes ({lost / LOSS_PROBES:.1%}); expected "
          f"{expected:.0f} +- {sigma:.1f}; netem counted {counters}")
    assert abs(lost - expected) <= LOSS_SIGMAS * sigma
    # every lost echo is a netem drop (nothing else lost any): netem saw the echo
    # requests plus the odd other packet (ARP), and dropped at most those others too
    others = counters["sent_packets"] + counters["dropped_packets"] - LOSS_PROBES
    assert 0 <= counters["dropped_packets"] - lost <= others
