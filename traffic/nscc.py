"""NSCC, Ultra Ethernet's sender congestion control (Network-Signal-based CC), as the
MRC sender's window (traffic/mrc.py, `cc="nscc"`).

Two signals per acknowledgement: the queueing delay its packet saw (its round trip
less the base round trip) against a target, and whether it came back ECN-marked.
Together they pick one of four responses:
    delay < target, no mark    proportional increase: by how far below the target
    delay >= target, no mark   fair increase (a fixed amount: the queue is draining)
    delay >= target, marked    multiplicative decrease, by how far the average delay
                               is above the target, at most once per base round trip
    delay < target, marked     nothing (one hot path: the spraying moves off it)
Increases are gathered and applied together every `adjust_bytes_threshold` bytes
acknowledged or `adjust_period_threshold_ms`, divided by the window (so a small window
grows faster than a large one: fairness), plus `eta`. A nearly empty path grows the
window fast (by `fi_scale` of what was acknowledged). Quick adapt: when a NACK
(a trimmed packet), a loss or a delay past `qa_threshold_ms` comes while the flow
delivered less than its maximum window >> `qa_gate` in the last base RTT + target,
the window becomes what was delivered, and the feedback of what was already in flight
is not acted on.

The parameters are those of OCP MRC's NSCC configuration (mrc_ctl.h's
mrc_ctl_cc_nscc_cfg), with the lab's units in their names (ms where it has ns).
Their values are the lab's: its links run `rate_scale` times slower than the real
ones, so the time parameters are derived from the emulated link (see NsccParams),
not copied from a 100 Gb/s deployment.
"""
from __future__ import annotations

from dataclasses import dataclass

# The queue NSCC steers to by default, in bytes on the wire: 12 frames of the default
# MTU, between ECN's Kmin (2 KB) and Kmax (16 KB) in the lab's defaults, so NSCC and
# DCQCN aim at the same standing queue and compare on the same port.
TARGET_QUEUE_BYTES = 12 * 1066
DELAY_WEIGHT = 1 / 8        # the average delay's EWMA weight, per acknowledgement (the
# lab's receivers answer every 4 packets: fewer samples per round trip than a NIC's)


@dataclass
class NsccParams:
    target_delay_ms: float = 0.0        # 0: the line-rate time of TARGET_QUEUE_BYTES
    base_rtt_ms: float = 0.0            # 0: the least round trip measured
    max_cwnd_bytes: int = 0             # 0: 1.5 x the base BDP (base RTT x line rate)
    eta: float = 0.15                   # MTUs added at each adjustment
    fi: float = 1.0                     # fair increase: MTUs per window of acknowledgements
    fi_scale: float = 0.25              # fast increase: of the bytes acknowledged
    gamma: float = 0.8                  # decrease: keep 1 - gamma (avg - target) / avg
    max_md_jump: float = 0.5            # ...but cut at most this share at once
    adjust_bytes_threshold: int = 8 * 1024       # apply the gathered increase after this
    adjust_period_threshold_ms: float = 0.0      # ...or this long (0: a base round trip)
    qa_gate: int = 3                    # quick adapt only below max_cwnd >> qa_gate delivered
    qa_threshold_ms: float = 0.0        # ...after a delay past this (0: 4 x target)
    disable_qa: bool = False

    def validate(self) -> None:
        if min(self.target_delay_ms, self.base_rtt_ms, self.max_cwnd_bytes, self.eta,
               self.fi, self.fi_scale, self.adjust_bytes_threshold,
               self.adjust_period_threshold_ms, self.qa_gate, self.qa_threshold_ms) < 0:
            raise ValueError("NSCC's parameters are not negative")
        if not 0 < self.gamma <= 1 or not 0 < self.max_md_jump < 1:
            raise ValueError(f"NSCC needs 0 < gamma <= 1 and 0 < max_md_jump < 1, got "
                             f"{self.gamma}, {self.max_md_jump}")


class Nscc:
    """One sender's window, in bytes."""

    def __init__(self, params: NsccParams, mtu_bytes: int, line_rate_mbps: float,
                 init_cwnd_bytes: float):
        params.validate()
        self.p, self.mtu = params, mtu_bytes
        self.rate_bytes_s = line_rate_mbps * 1e6 / 8
        self.target_s = (params.target_delay_ms / 1e3
                         or TARGET_QUEUE_BYTES / self.rate_bytes_s)
        self.base_rtt_s = params.base_rtt_ms / 1e3 or None
        self.cwnd = float(init_cwnd_bytes)
        self._clamp()                    # the first window too: a configured base RTT
        # makes max_cwnd small, and 8 senders' first windows would overflow the port
        self.avg_delay_s = 0.0
        self.inc_bytes = 0.0             # gathered increases, applied at the adjustment
        self.adjust_acked = 0
        self.last_adjust = None
        self.last_decrease = -1.0
        self.fast_acked = 0              # acknowledged in a row at (nearly) no delay
        self.achieved = 0                # delivered in the current quick-adapt period
        self.qa_end = None
        self.qa_trigger = False          # a NACK or a loss since the last look
        self.ignore_bytes = 0            # feedback from before quick adapt, not acted on
        self.quick_adapts = 0
        self.adjustments = 0
        self.decisions = {"proportional": 0, "fair": 0, "decrease": 0, "noop": 0, "fast": 0}

    # --- what the window may be --------------------------------------------------------
    @property
    def max_cwnd(self) -> float:
        if self.p.max_cwnd_bytes:
            return float(self.p.max_cwnd_bytes)
        bdp = (self.base_rtt_s or self.target_s) * self.rate_bytes_s
        return max(1.5 * bdp, 2.0 * self.mtu)

    def _clamp(self) -> None:
        self.cwnd = min(self.max_cwnd, max(float(self.mtu), self.cwnd))

    # --- signals ------------------------------------------------------------------------
    def on_nack(self) -> None:
        """A trimmed packet: the queue it crossed was full."""
        self.qa_trigger = True

    def on_loss(self) -> None:
        self.qa_trigger = True

    def on_ack(self, acked_bytes: int, rtt_s: float | None, ecn: bool, now: float,
               inflight_bytes: int) -> None:
        """Acknowledged bytes; the round trip of the packet the acknowledgement answers
        (None: a resent packet's, which times nothing) and its ECN echo."""
        if rtt_s is not None and not self.p.base_rtt_ms:
            self.base_rtt_s = rtt_s if self.base_rtt_s is None else min(self.base_rtt_s, rtt_s)
        base = self.base_rtt_s or 0.0
        delay = max(0.0, rtt_s - base) if rtt_s is not None else self.avg_delay_s
        self.avg_delay_s += (delay - self.avg_delay_s) * DELAY_WEIGHT
        self.achieved += acked_bytes
        if self._quick_adapt(delay, now, inflight_bytes):
            return
        if self.ignore_bytes > 0:         # answers to what was sent before it
            self.ignore_bytes -= acked_bytes
            return
        target = self.target_s
        if not ecn and delay < target:
            if delay < target / 8:
                self.fast_acked += acked_bytes
                if self.fast_acked >= self.cwnd:   # a window's worth at no delay
                    self.cwnd += acked_bytes * self.p.fi_scale
                    self.decisions["fast"] += 1
            else:
                self.fast_acked = 0
            # bytes per byte acknowledged: 4 MTUs a round trip from an empty queue
            self.inc_bytes += 4 * self.mtu * acked_bytes * (target - delay) / target
            self.decisions["proportional"] += 1
        elif not ecn:
            self.fast_acked = 0
            self.inc_bytes += self.p.fi * self.mtu * acked_bytes
            self.decisions["fair"] += 1
        elif delay >= target:
            self.fast_acked = 0
            self._decrease(now)
        else:
            self.decisions["noop"] += 1
        self._adjust(acked_bytes, now)
        self._clamp()

    def _decrease(self, now: float) -> None:
        avg, target = self.avg_delay_s, self.target_s
        if avg <= target or now - self.last_decrease < (self.base_rtt_s or target):
            return
        kept = max(1 - self.p.gamma * (avg - target) / avg, 1 - self.p.max_md_jump)
        self.cwnd *= kept
        self.last_decrease = now
        self.decisions["decrease"] += 1

    def _adjust(self, acked_bytes: int, now: float) -> None:
        """The gathered increase, divided by the window, now and then."""
        if self.last_adjust is None:
            self.last_adjust = now
        self.adjust_acked += acked_bytes
        period = self.p.adjust_period_threshold_ms / 1e3 or self.base_rtt_s or self.target_s
        if self.adjust_acked < self.p.adjust_bytes_threshold and now - self.last_adjust < period:
            return
        self.cwnd += self.inc_bytes / self.cwnd + self.p.eta * self.mtu
        self.inc_bytes, self.adjust_acked, self.last_adjust = 0.0, 0, now
        self.adjustments += 1

    def _quick_adapt(self, delay: float, now: float, inflight_bytes: int) -> bool:
        """Once per base RTT + target: a flow that delivered far less than its maximum
        window while a NACK, a loss or a very long delay says the network is full gets
        the window it delivered (an incast is met in one round trip, not in halvings)."""
        if self.p.disable_qa:
            return False
        period = (self.base_rtt_s or 0.0) + self.target_s
        if self.qa_end is None:
            self.qa_end = now + period
            return False
        if now < self.qa_end:
            return False
        threshold = self.p.qa_threshold_ms / 1e3 or 4 * self.target_s
        fired = (self.qa_trigger or delay > threshold) and \
            self.achieved < self.max_cwnd / (1 << self.p.qa_gate)
        if fired:
            self.cwnd = max(float(self.achieved), float(self.mtu))
            self.ignore_bytes = inflight_bytes
            self.inc_bytes = 0.0
            self.quick_adapts += 1
        self.achieved, self.qa_trigger, self.qa_end = 0, False, now + period
        return fired
