"""PFC spreading: an innocent flow slowed by pauses meant for someone else.

Three hosts on leaf 0 send to one host R on leaf 1 (incast through the spine);
a victim on leaf 0 sends to another host V on leaf 1. The victim never crosses
R's congested port, and the fabric links have room for everyone (they run 4x
the host links): only R's port is short of bandwidth.
  pfc  R's port passes XOFF, leaf 1 pauses the spine; the spine's queue toward
       leaf 1, which the victim shares with the incast, stops: the victim waits
       behind packets that are going nowhere (head-of-line blocking), and as the
       spine's own queue fills it pauses leaf 0 in turn: pause spreads hop by hop.
  ecn  the incast senders slow down (DCQCN); nothing is paused; the victim keeps
       its rate.
The victim's sending rate while the incast runs is compared with its rate alone.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lab.core.errors import UsageError
from lab.experiments.base import Claim, RunContext, excuses
from lab.experiments.common import (FRAME_BYTES, SETTLE_S, rc_params,
                                    sender_rates, starved, traffic_timeout_s)
from lab.fabric.capture import NOT_PLAIN_ROCE_DATA, CapturePlan
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents
from lab.fabric.telemetry import write_flow_rates
from traffic.constants import PRIORITY_ROCE_DATA

log = logging.getLogger(__name__)
NAME = "pfc-spreading"
DESCRIPTION = "a victim flow beside an incast: head-of-line blocked under PFC, not under ECN"
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 1, "leaves": 2, "hosts_per_leaf": 4,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 40.0,
                                    "rate_scale": 10000}}
VARIANTS = ("alone", "pfc", "ecn")
PATH_QUEUES = 3         # leaf 0 uplink, spine to leaf 1, leaf 1 to the host: all may pause
HOL_LOSS = 0.8          # under PFC the victim keeps less than 80% of its rate alone...
KEEPS = 0.8             # ...under ECN at least 80% of it

SCALED_SIZES = ("incast_kb", "victim_kb")   # shrink with the link rates on a slow machine (calibrate.py)
# flow ends busy at once at the defaults (the victim's pair; the incast's share a link)
BUSY_ENDS = 4

@dataclass
class Params:
    topology: str = "leaf-spine"
    incast_kb: int = 400        # per incast sender
    victim_kb: int = 2000       # long enough to outlast the incast
    ecn: str = "auto"
    kmin_kb: float = CongestionParams.kmin_kb
    kmax_kb: float = CongestionParams.kmax_kb
    pmax: float = CongestionParams.pmax
    xoff_kb: float = CongestionParams.xoff_kb
    xon_kb: float = CongestionParams.xon_kb

    def validate(self) -> None:
        if self.topology != "leaf-spine":
            raise UsageError("pfc-spreading needs topology=leaf-spine (two leaves, one spine)")
        if self.ecn not in ("auto", "red", "bpf", "controller"):
            raise UsageError("ecn must be auto, red, bpf or controller")


def capture_plan(fabric, params: Params) -> CapturePlan:
    """The victim's port (the pauses that block it, from a switch it shares with the
    incast only) and the incast receiver's (its CNPs and marks under ECN)."""
    r = roles(fabric)
    return CapturePlan([r["victim"], r["receiver"]], NOT_PLAIN_ROCE_DATA,
                       "CE-marked data, CNPs, ACKs/NAKs and PFC frames (unmarked RoCE data "
                       "frames are left out)")


def roles(fabric) -> dict:
    by_leaf: dict[str, list[str]] = {}
    for h in fabric.hosts:
        by_leaf.setdefault(h.interface().switch, []).append(h.name)
    leaves = sorted(by_leaf)
    if len(leaves) < 2 or len(by_leaf[leaves[0]]) < 2 or len(by_leaf[leaves[1]]) < 2:
        raise UsageError("pfc-spreading needs two leaves with at least two hosts each")
    left, right = by_leaf[leaves[0]], by_leaf[leaves[1]]
    return {"senders": left[:-1], "victim": left[-1], "receiver": right[0],
            "victim_dst": right[1]}


def run_variant(ctx: RunContext, gpus: GpuAgents, variant: str, r: dict) -> dict:
    p, net = ctx.params, ctx.net
    cp = CongestionParams(ecn=p.ecn if variant == "ecn" else "off", kmin_kb=p.kmin_kb,
                          kmax_kb=p.kmax_kb, pmax=p.pmax, pfc=variant == "pfc",
                          xoff_kb=p.xoff_kb, xon_kb=p.xon_kb)
    mode = net.set_congestion(cp)
    recv_if = ctx.fabric.host(r["receiver"]).interface()
    rc = rc_params(net, recv_if.rate_mbps, p.kmax_kb, path_queues=PATH_QUEUES)
    flows = [(r["victim"], r["victim_dst"], p.victim_kb * 1024)]
    if variant != "alone":
        flows += [(s, r["receiver"], p.incast_kb * 1024) for s in r["senders"]]
    prio = PRIORITY_ROCE_DATA
    dp = net.dataplane
    drops0 = ctx.telemetry.drops(prio) if dp else {}
    before = net.congestion_state().get("counters", {})
    t0 = time.time()
    # every flow's bytes through the receiver's port: the victim's too, when pauses hold it
    res = gpus.transfers(flows, "rc", params=rc,
                         timeout_s=traffic_timeout_s(sum(n for *_, n in flows),
                                                     recv_if.rate_mbps))
    t1 = time.time()
    time.sleep(SETTLE_S)
    after = net.congestion_state().get("counters", {})
    if dp:      # exact: every drop the data path made while counting
        drops = {k: n - drops0[k] for k, n in ctx.telemetry.drops(prio).items()
                 if n - drops0[k]}
    else:
        drops = {k: q["drops_packets"] for k, q in ctx.telemetry.summary(t0, t1).items()
                 if q["drops_packets"]}
    victim, incast = res[0], res[1:]
    write_flow_rates(ctx.workdir / f"flows-{variant}.csv", res, FRAME_BYTES)
    # the victim's rate while the incast runs (alone: over its own middle half)
    end = t0 + (min(f["completion_s"] for f in incast) if incast else victim["completion_s"])
    rate = sender_rates([victim], t0 + 0.25 * (end - t0), end).get(r["victim"], 0.0)

    def delta(key: str) -> dict[str, int]:
        n = {port: after[port].get(str(prio), {}).get(key, 0)
             - before.get(port, {}).get(str(prio), {}).get(key, 0) for port in after}
        return {port: d for port, d in n.items() if d}
    xoff, xon = delta("xoff_frames_sent"), delta("xon_frames_sent")
    pauses_sent = {port: xoff.get(port, 0) + xon.get(port, 0) for port in set(xoff) | set(xon)}
    return {"ecn_mode": mode, "pfc": variant == "pfc",
            "victim_rate_pps": round(rate, 1),
            "victim_completion_s": round(victim["completion_s"], 3),
            "incast_completion_s_max": round(max((f["completion_s"] for f in incast),
                                                 default=0.0), 3),
            "pause_frames_sent_by_switch": _by_switch(pauses_sent),
            "pause_frames_received_by_port": delta("pause_frames_received"),
            "pfc_frames_sent_by_port": {port: {"xoff": xoff.get(port, 0), "xon": xon.get(port, 0)}
                                        for port in sorted(set(xoff) | set(xon))},
            "victim_pause_frames_received": victim["sender_nic"]["pause_frames_received"],
            # at the incast's receiver: CE-marked frames it took in, the CNPs it sent
            "ce_marked_packets": sum(f["receiver_counters"]["ecn_marked"] for f in incast),
            "cnp_packets": sum(f["counters"]["cnps_received"] for f in incast),
            "drops_packets": drops,
            "counted_unix_s": [round(t0, 4), round(time.time(), 4)],
            "retransmitted_packets": sum(f["counters"]["retransmitted"] for f in res),
            "timeouts": sum(f["counters"]["timeouts"] for f in res),
            "all_intact": all(f["intact"] for f in res)}


def _by_switch(per_port: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for port, n in per_port.items():
        sw = port.split(":")[0]
        out[sw] = out.get(sw, 0) + n
    return out


def run(ctx: RunContext) -> dict:
    r = roles(ctx.fabric)
    out = {"roles": r}
    hosts = [*r["senders"], r["victim"], r["receiver"], r["victim_dst"]]
    with GpuAgents(ctx.net, hosts=hosts) as gpus:
        for variant in VARIANTS:
            log.info(f"{variant}: victim {r['victim']} -> {r['victim_dst']}"
                     + ("" if variant == "alone" else
                            f" beside {len(r['senders'])} senders -> {r['receiver']}"))
            m = out[variant] = run_variant(ctx, gpus, variant, r)
            log.info(f"  victim {m['victim_rate_pps']:.0f} packets/s; pause frames sent "
                     f"by {m['pause_frames_sent_by_switch'] or 'no switch'}")
        out["cpu_bound_hosts"] = gpus.cpu_bound()
    out["starved"] = excuses(starved("pfc", out["pfc"]["drops_packets"]))
    ctx.net.set_congestion(CongestionParams())
    alone = out["alone"]["victim_rate_pps"] or 1.0
    out["victim_rate_vs_alone"] = {v: round(out[v]["victim_rate_pps"] / alone, 3)
                                   for v in ("pfc", "ecn")}
    return out


def claims(params: Params, m: dict) -> list[Claim]:
    ratio = m["victim_rate_vs_alone"]
    spread = m["pfc"]["pause_frames_sent_by_switch"]
    return [
        Claim("every message arrived intact", all(m[v]["all_intact"] for v in VARIANTS),
              {v: m[v]["all_intact"] for v in VARIANTS}, "all True"),
        Claim("pfc: pause spreads beyond the congested switch (two switches send pauses)",
              len(spread) >= 2, spread, ">= 2 switches", "pause frames"),
        Claim(f"pfc: the victim loses throughput (< {HOL_LOSS:.0%} of its rate alone)",
              ratio["pfc"] < HOL_LOSS, ratio["pfc"], f"< {HOL_LOSS}"),
        Claim(f"ecn: the victim keeps its throughput (>= {KEEPS:.0%} of its rate alone)",
              ratio["ecn"] >= KEEPS, ratio["ecn"], f">= {KEEPS}"),
    ]
