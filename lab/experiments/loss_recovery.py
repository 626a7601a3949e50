"""Loss recovery: RC's go-back-N against MRC's selective repeat, same lossy link.

nftables drops a random share of the RoCE frames arriving at the receiver
(counting each drop); one flow crosses the fabric over RC, then over MRC.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lab.core.errors import UsageError
from lab.experiments.base import RESENDS, Claim, Excuse, RunContext, excuses
from lab.experiments.common import SETTLE_S
from lab.fabric.capture import CapturePlan
from lab.fabric.gpus import GpuAgents
from lab.kernel.impair import RandomLoss

log = logging.getLogger(__name__)
NAME = "loss-recovery"
DESCRIPTION = "random loss on one link: retransmissions per lost packet, RC go-back-N vs MRC"
# 20 Mb/s links stand for 100 Gb/s: at 100 Mb/s the sender was CPU-bound on 2 cores
TOPOLOGY_DEFAULTS = {"leaf-spine": {"host_rate_mbps": 20.0, "fabric_rate_mbps": 20.0,
                                    "rate_scale": 5000}}

# The flow keeps its size on a slower machine (no SCALED_SIZES, calibrate.py): the losses
# are random, and 2 MB at 1% expects 20 a run (none: p ~ 2e-9). Shrunk to x0.25 it
# expected 5 (none: p ~ 0.7%), and a tour in the lab VM saw RC lose none.

@dataclass
class Params:
    topology: str = "leaf-spine"
    loss_percent: float = 1.0
    flow_mb: float = 2.0

    def validate(self) -> None:
        if not 0 < self.loss_percent <= 5:
            raise UsageError(f"loss_percent must be in (0, 5], got {self.loss_percent}")
        if self.flow_mb <= 0:
            raise UsageError(f"flow_mb must be positive, got {self.flow_mb}")


def capture_plan(fabric, params: Params) -> CapturePlan:
    """The switch port into the lossy link: every frame sent toward the loss, so
    retransmissions (a QP's PSN again) and RC's NAKs show."""
    return CapturePlan([fabric.hosts[-1].name])


def run(ctx: RunContext) -> dict:
    p = ctx.params
    src, dst = ctx.fabric.hosts[0], ctx.fabric.hosts[-1]
    nbytes = int(p.flow_mb * 1e6)
    out = {"src": src.name, "dst": dst.name, "flow_bytes": nbytes,
           "lossy_link": f"into {dst.interface().name}", "loss_percent": p.loss_percent}
    with GpuAgents(ctx.net, [src.name, dst.name]) as gpus:
        for transport in ("rc", "mrc"):
            t0 = time.time()
            with RandomLoss(ctx.net.host_pid(dst.name), dst.interface().name,
                            p.loss_percent) as loss:
                [flow] = gpus.transfers([(src.name, dst.name, nbytes)], transport)
                lost = loss.dropped()
            time.sleep(SETTLE_S)
            retx = flow["counters"]["retransmitted"]
            dups = flow["receiver_counters"]["duplicate"]
            m = {"lost_packets": lost, "retransmitted_packets": retx,
                 "receiver_duplicates": dups,   # resent though not lost (e.g. a stalled host)
                 "timeouts": flow["counters"]["timeouts"],
                 "receiver_naks": flow["receiver_counters"]["naks_sent"],
                 # the span the counters cover (unix time), for checking against captures
                 "counted_unix_s": [round(t0, 4), round(time.time(), 4)],
                 "retransmitted_per_lost": retx / lost if lost else None,
                 "completion_s": flow["completion_s"],
                 "goodput_mbps": nbytes * 8 / flow["completion_s"] / 1e6,
                 "intact": flow["intact"]}
            log.info(f"{transport}: {lost} lost, {retx} retransmitted ({dups} arrived as "
                     f"duplicates), goodput {m['goodput_mbps']:.1f} Mb/s")
            out[transport] = m
        out["cpu_bound_hosts"] = gpus.cpu_bound()
    out["starved"] = excuses(spurious(out["mrc"]))
    return out


def spurious(m: dict) -> list[Excuse]:
    """MRC packets resent though they had arrived (the receiver counted them twice):
    not the transport's loss recovery at fault but the machine, when the sender's
    timer fired while their SACKs were still on the way (a host stalled past its
    margin), or later packets overtook them by more than reorder_packets."""
    dups = m["receiver_duplicates"]
    if not dups:
        return []
    why = (f"its retransmit timer fired ({m['timeouts']} timeouts) while their SACKs "
           f"were still on the way: the hosts stalled longer than the timer's margin"
           if m["timeouts"] else
           "packets sent after them were acknowledged first, by more than reorder_packets "
           "(a path or a host that stalled)")
    return [Excuse("mrc", (RESENDS,),
                   f"{dups} of the {m['retransmitted_packets']} packets resent had arrived "
                   f"(the receiver counted them twice): {why}, so the resends beyond the "
                   f"{m['lost_packets']} lost come from the machine's load, not from MRC")]


def claims(params: Params, m: dict) -> list[Claim]:
    rc, mrc = m["rc"], m["mrc"]
    return [
        Claim("the link really lost packets (nftables counter), in both runs",
              rc["lost_packets"] > 0 and mrc["lost_packets"] > 0,
              f"rc {rc['lost_packets']}, mrc {mrc['lost_packets']}", "> 0 each"),
        Claim("both flows arrived intact (CRC-32 end to end)", rc["intact"] and mrc["intact"],
              f"rc {rc['intact']}, mrc {mrc['intact']}", "True, True"),
        Claim("mrc: resends exactly the lost packets",
              mrc["retransmitted_packets"] == mrc["lost_packets"],
              mrc["retransmitted_packets"], f"== {mrc['lost_packets']} lost", "packets",
              rests_on=(RESENDS,)),
        Claim("rc: go-back-N resends more than it lost",
              rc["retransmitted_packets"] > rc["lost_packets"],
              rc["retransmitted_packets"], f"> {rc['lost_packets']} lost", "packets"),
    ]
