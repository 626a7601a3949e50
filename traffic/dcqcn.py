"""DCQCN (Zhu et al., SIGCOMM 2015): RoCE's congestion control, both NIC roles.

Notification point (receiver): a CE-marked data packet makes it send a CNP to
the sender's QP, at most one per QP per `cnp_interval`.
Reaction point (sender): each CNP cuts the rate, Rt = Rc, Rc = Rc (1 - alpha/2),
and raises alpha = (1 - g) alpha + g; without CNPs alpha decays every alpha
timer. The rate climbs back at each rate-increase event (a timer period or a
byte count): fast recovery towards Rt for F events, then additive increase of
Rt by R_AI, then hyper increase by R_HAI.

Time dilation: the lab's links run `rate_scale` times slower than the real ones
they stand for, so every real time constant is stretched by the same factor
(`DcqcnParams.at_scale`) and rates are fractions of the line rate: the
control loop keeps its shape relative to the emulated BDP.
"""
from __future__ import annotations

from dataclasses import dataclass, replace


# How long a full marking queue (Kmax) takes to drain on real hardware, the time
# scale DCQCN's 50-55 us constants act on: 160 us is e.g. 800 KB on a 40 Gb/s port.
# Calibrated in the lab's incast experiment (8 to 1, 10 Mb/s, Kmax 16 KB, marking per
# packet in the data path). At 80 us (a 164x stretch) each sender's CNPs came about as
# often as its fast recovery lasts (5 timer events), so rates never reached additive
# increase: cuts and recoveries are both multiplicative, which keeps the senders'
# ratios instead of closing them, and 4 runs in 20 ended with a sender 20-28% off the
# fair share. At 160 us (82x) the timers run twice as often relative to the CNPs:
# every sender within 1.5-6% of the fair share in 20 of 20 runs, the queue p50 at
# 5-6.5 KB, between Kmin and Kmax. (At 40 us the senders cut so deep that the queue
# stood empty half the time.)
REFERENCE_KMAX_DRAIN_S = 160e-6


def time_scale_for(kmax_bytes: float, rate_bps: float) -> float:
    """How much slower an emulated marking queue drains than a real one: stretching
    DCQCN's constants by it keeps the control loop as fast, relative to the queue,
    as on real hardware. (The lab's buffers shrink less than its rates, since a
    frame stays ~1 KB, so this is not simply the rate scale.)"""
    return (kmax_bytes * 8 / rate_bps) / REFERENCE_KMAX_DRAIN_S


@dataclass
class DcqcnParams:
    g: float = 1 / 256
    alpha_timer_s: float = 55e-6              # real time, as in the paper
    rate_timer_s: float = 55e-6
    byte_counter_bytes: int = 10 * 1024 * 1024
    fast_recovery_events: int = 5             # F
    rai_fraction: float = 0.005               # additive increase, of the line rate
    rhai_fraction: float = 0.05               # hyper increase, of the line rate
    min_rate_fraction: float = 0.01
    cnp_interval_s: float = 50e-6             # notification point: one CNP per QP per interval

    def at_scale(self, rate_scale: float) -> "DcqcnParams":
        """The same controller for links `rate_scale` times slower than the real ones."""
        return replace(self, alpha_timer_s=self.alpha_timer_s * rate_scale,
                       rate_timer_s=self.rate_timer_s * rate_scale,
                       cnp_interval_s=self.cnp_interval_s * rate_scale,
                       byte_counter_bytes=max(1, int(self.byte_counter_bytes / rate_scale)))


class ReactionPoint:
    """The sender's rate for one QP."""

    def __init__(self, line_rate_bps: float, p: DcqcnParams, now: float = 0.0):
        self.p, self.line = p, line_rate_bps
        self.rc = self.rt = line_rate_bps
        self.alpha = 1.0
        self.timer_events = self.byte_events = 0
        self.bytes_since = 0
        self.next_alpha = now + p.alpha_timer_s
        self.next_increase = now + p.rate_timer_s
        self.cnps = 0

    def on_cnp(self, now: float) -> None:
        p = self.p
        self.cnps += 1
        self.rt = self.rc
        self.rc = max(self.line * p.min_rate_fraction, self.rc * (1 - self.alpha / 2))
        self.alpha = (1 - p.g) * self.alpha + p.g
        self.timer_events = self.byte_events = self.bytes_since = 0
        self.next_alpha = now + p.alpha_timer_s
        self.next_increase = now + p.rate_timer_s

    def on_sent(self, nbytes: int, now: float) -> None:
        self.bytes_since += nbytes
        if self.bytes_since >= self.p.byte_counter_bytes:
            self.bytes_since = 0
            self.byte_events += 1
            self._increase()
        self.tick(now)

    def tick(self, now: float) -> None:
        p = self.p
        while now >= self.next_alpha:
            self.alpha *= 1 - p.g
            self.next_alpha += p.alpha_timer_s
        while now >= self.next_increase:
            self.timer_events += 1
            self.next_increase += p.rate_timer_s
            self._increase()

    def _increase(self) -> None:
        p, f = self.p, self.p.fast_recovery_events
        if max(self.timer_events, self.byte_events) < f:
            pass                                              # fast recovery: towards Rt
        elif min(self.timer_events, self.byte_events) > f:
            i = min(self.timer_events, self.byte_events) - f
            self.rt = min(self.line, self.rt + i * p.rhai_fraction * self.line)   # hyper
        else:
            self.rt = min(self.line, self.rt + p.rai_fraction * self.line)        # additive
        self.rc = min(self.line, (self.rt + self.rc) / 2)


class NotificationPoint:
    """The receiver's CNP pacing for one QP."""

    def __init__(self, p: DcqcnParams):
        self.p = p
        self.last_cnp = float("-inf")
        self.cnps_sent = 0

    def should_notify(self, ce: bool, now: float) -> bool:
        if ce and now - self.last_cnp >= self.p.cnp_interval_s:
            self.last_cnp = now
            self.cnps_sent += 1
            return True
        return False
