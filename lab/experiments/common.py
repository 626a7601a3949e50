"""What experiments share (instead of importing each other): the RoCE frame size,
RC's parameters through congested ports, rates from a transport's samples, a port's
sent bytes and waiting for them to stop, the switches' drops from now on and what
frames lost inside OVS say about the machine, the all-reduce model, an all-reduce's
delivery while something fails and how long it stalled."""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from lab.experiments.base import DROPS, Excuse
from lab.fabric.telemetry import INSIDE
from traffic.constants import DEFAULT_MTU_BYTES, PRIORITY_ROCE_DATA
from traffic.dcqcn import time_scale_for
from traffic.roce import WRITE_OVERHEAD_BYTES

FRAME_BYTES = DEFAULT_MTU_BYTES + WRITE_OVERHEAD_BYTES   # a full RoCE frame on the wire
SETTLE_S = 0.3          # after a variant: queues drain, counters reach the state file
TIMEOUT_IDEALS = 4      # traffic gets this many times its ideal time before it is called stuck
MIN_TIMEOUT_S = 120.0
QUIET_FRAMES = 20       # a port that sent nothing for this many frame times has drained

log = logging.getLogger(__name__)


def rc_params(net, rate_mbps: float, kmax_kb: float, time_scale: float = 0.0,
              path_queues: int = 1) -> dict:
    """RC through congested ports of this rate: DCQCN's constants stretched to the
    marking queue (traffic/dcqcn.py); the retransmit timer well above the time the full
    buffers on the path take to drain, or a sender held by pauses would resend its whole
    window into a lossless fabric (a storm of duplicates, seen with 1 buffer's worth)."""
    drain_ms = net.queue_params.buffer_kb * 1024 * 8 / (rate_mbps * 1e3)
    return {"rate_scale": time_scale or time_scale_for(kmax_kb * 1024, rate_mbps * 1e6),
            "rto_ms": max(50.0, 4 * drain_ms * path_queues)}


def idle_rtt_ms(gpus, src: str, dst: str, nbytes: int = 32 * 1024) -> float:
    """The least round trip of an MRC data packet and its SACK between two hosts on the
    idle fabric: NSCC's base RTT. A real NIC is configured with its fabric's unloaded
    round trip; taking the least seen under load instead (all senders start at once)
    would count the first packets' queueing as the base, and NSCC would steer to a queue
    that much longer than its target (measured here: 26 KB for a 12 KB target)."""
    # twice: the first packets on a path wait for the switches to set up its flows (a
    # run's first measurement came out 1.26 ms, the second 0.29 ms)
    return min(flow["counters"]["min_rtt_ms"] for _ in range(2)
               for flow in gpus.transfers([(src, dst, nbytes)], "mrc",
                                          params={"credit_budget_packets": 0}))


def traffic_timeout_s(nbytes: float, rate_mbps: float) -> float:
    """How long to wait for traffic that puts `nbytes` through a `rate_mbps` bottleneck:
    TIMEOUT_IDEALS times the ideal, MIN_TIMEOUT_S at least. A fixed limit that covers the
    defaults cuts a run off on a calibrated slow machine, whose link rates shrink more
    than its sizes (lab/fabric/calibrate.py: a fixed 120 s stopped incast's ecn variant
    at x0.07, whose flows take 110 s at least)."""
    return max(MIN_TIMEOUT_S, TIMEOUT_IDEALS * nbytes * 8 / (rate_mbps * 1e6))


def rate(times: list[float], counts: list[float], since: float, until: float) -> float:
    """Growth per second of a sampled counter within [since, until]; 0 with fewer than
    two samples there (a starved sender counts as 0, not as absent)."""
    pts = [(t, n) for t, n in zip(times, counts) if since <= t <= until]
    return ((pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])
            if len(pts) >= 2 and pts[-1][0] > pts[0][0] else 0.0)


def sender_rates(flows: list[dict], since: float, until: float) -> dict[str, float]:
    """Packets per second each sender put on the wire within [since, until]
    (retransmissions included)."""
    return {f["src"]: rate(f["rate_samples"]["t"], f["rate_samples"]["sent"], since, until)
            for f in flows}


def tx_bytes(intf: str) -> int:
    """The bytes a switch port (an interface of the root namespace) has sent."""
    return int(Path(f"/sys/class/net/{intf}/statistics/tx_bytes").read_text())


def drain_quiet_s(rate_mbps: float) -> float:
    """How long a port of this rate stays silent before its queue counts as drained:
    QUIET_FRAMES frame times, SETTLE_S at least (gaps between frames grow on a slow
    machine, and the counters need SETTLE_S to reach the state file anyway)."""
    return max(SETTLE_S, QUIET_FRAMES * FRAME_BYTES * 8 / (rate_mbps * 1e6))


def once_quiet(read, quiet_s: float, limit_s: float = 30.0, what: str = "the ports"):
    """`read()` again every `quiet_s` until it reads the same twice: the counters it reads
    stopped moving. Flows stopped mid-way leave frames in the fabric's queues, which go
    on leaving through its ports; counted while they do, a frame sent between the count
    and its timestamp is in a capture's span and not in the count (measured once,
    natively, one frame). Its last reading, with a warning if it still moved after
    `limit_s`."""
    last, deadline = read(), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read()
        if now == last:
            return now
        last = now
    log.warning(f"{what} still carried traffic {limit_s:g} s after the flows stopped: "
                f"their counts may differ from a capture's by the frames in between")
    return last


class SwitchDrops:
    """The RoCE data frames the switches' queues drop from now until `count()`: the data
    path's exact counters, or where it cannot run the queue telemetry's. The frames a
    switch took in and sent nowhere (lost inside OVS: `inside()`) are apart: that is a
    difference of two counters read while frames cross the switch, so a variant's
    edges leave it a frame or two off either way (a CI run's training-step counted -1)."""

    def __init__(self, net, telemetry):
        self.dp, self.telemetry = net.dataplane, telemetry
        self.t0 = time.time()
        self.before = telemetry.drops(PRIORITY_ROCE_DATA) if self.dp else {}
        self.after: dict[str, int] = {}

    def _since(self) -> dict[str, int]:
        self.after = self.telemetry.drops(PRIORITY_ROCE_DATA)
        return {k: n - self.before.get(k, 0) for k, n in self.after.items()}

    def count(self) -> int:
        if self.dp:
            return sum(n for k, n in self._since().items() if not k.endswith(f":{INSIDE}"))
        return sum(q["drops_packets"] for k, q in self.telemetry.summary(
            self.t0, time.time()).items() if k.endswith(f":{PRIORITY_ROCE_DATA}"))

    def inside(self) -> int | None:
        """The frames lost inside the switches meanwhile, as of the last count() (None
        without the data path)."""
        if not self.dp:
            return None
        return sum(n - self.before.get(k, 0) for k, n in self.after.items()
                   if k.endswith(f":{INSIDE}"))


def starved(variant: str, drops: dict[str, int]) -> list[Excuse]:
    """What a lossless variant's drops say about the machine: frames a switch took in
    and sent nowhere were lost inside OVS's user-space datapath (its receive rings
    overflowed or its sends failed), which under PFC, with its queues short of their
    limits, happens when OVS does not get the CPU it needs. Measured: 2 frames in 1 of
    40 PFC variants on this machine (while a `pip install` ran), 400-530 in 2 of 6
    beside a qemu VM busy on both cores. (Lossy variants lose a few there too, 2-54 per
    `none` run: sends to a port whose queue is at its limit.)"""
    return [Excuse(variant, (DROPS,),
                   f"{key.rpartition(':')[0]} lost {n} frames inside OVS's user-space "
                   f"datapath (taken in, sent nowhere): the switch was short of CPU, so this "
                   f"lossless variant's drops come from the machine's load, not from PFC")
            for key, n in sorted(drops.items()) if key.endswith(f":{INSIDE}") and n > 0]


def model_time_s(algorithm: str, n: int, size_bytes: int, link_mbps: float,
                 racks: int = 1, up_mbps: float = 0.0) -> float:
    """The bandwidth term of the alpha-beta model, which no run can beat. A ring moves
    2(n-1)/n S over every link; a tree's root takes S from each of its children;
    hierarchical: a ring of the g GPUs of a rack over scale-up (2(g-1)/g S), then a
    ring across the racks over scale-out on 1/g of the data."""
    bits = size_bytes * 8
    if algorithm == "tree":
        return min(2, n - 1) * bits / (link_mbps * 1e6)
    if algorithm == "hier":
        g = n // racks
        return (2 * (g - 1) / g * bits / (up_mbps * 1e6)
                + 2 * (racks - 1) / racks * bits / g / (link_mbps * 1e6))
    return 2 * (n - 1) / n * bits / (link_mbps * 1e6)


def floor_time_s(algorithm: str, n: int, size_bytes: int, link_mbps: float,
                 racks: int = 1, up_mbps: float = 0.0) -> float:
    """The least time the lab's links allow: the bandwidth term less what their token
    buckets (lab/kernel/queues.py) let through at once, a burst of GATE_BURST_BYTES
    after an idle spell, once per phase on its slowest link (a ring: one phase;
    hierarchical: scale-up, scale-out, scale-up). At the defaults a few ms against
    seconds; at a slow machine's x0.05 (a 0.1 Mb/s scale-out link: 128 ms a burst) the
    hierarchical all-reduce of 32 KB ended 1 ms inside its bandwidth term."""
    from lab.kernel.queues import GATE_BURST_BYTES
    burst_bits = GATE_BURST_BYTES * 8
    bursts_s = (2 * burst_bits / (up_mbps * 1e6) + burst_bits / (link_mbps * 1e6)
                if algorithm == "hier" else burst_bits / (link_mbps * 1e6))
    return max(0.0, model_time_s(algorithm, n, size_bytes, link_mbps, racks, up_mbps)
               - bursts_s)


def stall_s(samples: dict, since: float) -> float:
    """The longest stretch after `since` in which the delivered bytes did not grow."""
    longest, last_growth, last = 0.0, since, None
    for t, d in zip(samples["t"], samples["delivered"]):
        if t < since:
            last = d
            continue
        if last is not None and d > last:
            longest = max(longest, t - last_growth)
            last_growth = t
        last = d
    return round(longest, 3)


def merged_delivery(series: list[dict]) -> dict:
    """One delivered-bytes series out of several ({"t": [...], "delivered": [...]}
    each): at every sample of any of them, the sum of each one's latest value."""
    points = sorted((t, i, d) for i, s in enumerate(series)
                    for t, d in zip(s["t"], s["delivered"]))
    latest = [0] * len(series)
    out: dict = {"t": [], "delivered": []}
    for t, i, d in points:
        latest[i] = d
        out["t"].append(t)
        out["delivered"].append(sum(latest))
    return out


def allreduce_delivery(gpus, allreduce_kb: int, transport: str, timeout_s: float,
                       params: dict | None = None) -> dict:
    """A ring all-reduce of `allreduce_kb` of float32 per GPU (op mean, seeded tensors)
    while something fails: whether every GPU holds the mean, when, and the bytes
    delivered over time summed over every receiving QP (what stall_s reads)."""
    n = len(gpus.hosts)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(allreduce_kb * 256).astype(np.float32) for _ in range(n)]
    res = gpus.allreduce(grads, transport, op="mean", params=params, timeout_s=timeout_s)
    expected = np.mean(np.stack(grads), axis=0)
    counters = [c for per_host in res.counters for c in per_host.values()]
    per_host = [{"t": s["t"], "delivered": [sum(v) for v in zip(*s["delivered"].values())]}
                for s in res.rate_samples]
    return {"delivery": merged_delivery(per_host), "completion_s": res.time_s,
            "retransmitted_packets": sum(c["retransmitted"] for c in counters),
            "timeouts": sum(c["timeouts"] for c in counters),
            "evs": [evs for per_host in res.evs for evs in per_host.values()],
            "intact": all(np.allclose(r, expected, atol=1e-5 * n) for r in res.results)}
