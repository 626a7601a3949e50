"""Packet trimming: the incast without PFC, MRC over a queue that drops against MRC over
a queue that trims.

N GPU hosts send to one over MRC at full rate, as in the incast; the receiver's switch
port overflows. Two variants, one after the other on the same fabric:
  drop   the full queue drops what does not fit: MRC learns of each loss when packets
         sent after it are acknowledged (reorder_packets) or when its timer fires
  trim   the port cuts what does not fit to its headers and sends those on in the
         control class (lab/kernel/dataplane.bpf.c); the receiver answers each with a
         NACK and the sender resends exactly that packet (traffic/mrc.py), about a
         round trip after sending it, instead of a timeout
The receivers grant no pooled credit here (`credit_budget_packets` 0: each sender's
own window): the receiver's credit is what keeps MRC's incast from overflowing a
queue at all, and this experiment is about what happens when one does overflow.
Trimming runs in the BPF data path only (where doctor says it cannot run, the run
stops and says why).
"""
from __future__ import annotations

import logging
import time
from statistics import mean
from dataclasses import dataclass

from lab.core.errors import LabError, UsageError
from lab.experiments.base import (DROPS, RESEND_DELAY, RESENDS, Claim, Excuse, RunContext,
                                  excuses)
from lab.experiments.common import SETTLE_S, idle_rtt_ms, traffic_timeout_s
from lab.fabric.capture import CapturePlan
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents
from traffic.constants import PRIORITY_ROCE_DATA
from traffic.mrc import CC_MODES

log = logging.getLogger(__name__)
NAME = "trimming"
DESCRIPTION = "incast over MRC without PFC: a queue that drops vs one that trims (NACK, resend)"
# the incast's fabric: 8 senders and a receiver on one leaf; 10 Mb/s for 100 Gb/s
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 1, "leaves": 1, "hosts_per_leaf": 9,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 10.0,
                                    "rate_scale": 10000}}
VARIANTS = ("drop", "trim")
# flow ends busy at once at the defaults (calibrate.py): 8 senders keep their windows
# full into one port (a full queue trims rather than slows them), and their receiver
BUSY_ENDS = 9
ROUND_TRIPS = 2.0    # "about a round trip": a trimmed packet's resend, against the smoothed RTT


@dataclass
class Params:
    topology: str = "leaf-spine"
    senders: int = 8
    flow_kb: int = 600          # per sender: ~4 s of the 10 Mb/s port for all eight
    variants: str = ",".join(VARIANTS)
    trim_kb: float = 0.0        # trimming starts at this backlog; 0: the buffer (instead
    # of the drops)
    credit_budget_packets: int = 0   # the receivers' pooled credit (0: none, see above)
    cc: str = "window"          # MRC's congestion control: window (the lab's) | nscc |
    # rccc | nscc+rccc (traffic/mrc.py's CC_MODES)
    ecn: str = "off"            # the switches' ECN marking in both variants (NSCC decreases
    # on marks): off | auto | bpf | red | controller

    def validate(self) -> None:
        bad = set(self.variant_list) - set(VARIANTS)
        if bad:
            raise UsageError(f"unknown trimming variant(s) {sorted(bad)}; choose from "
                             f"{', '.join(VARIANTS)}")
        if self.senders < 2 or self.flow_kb <= 0:
            raise UsageError("need senders >= 2 and flow_kb > 0")
        if self.credit_budget_packets < 0:
            raise UsageError("credit_budget_packets must be 0 (none) or more")
        if self.cc not in CC_MODES:
            raise UsageError(f"cc must be one of {', '.join(CC_MODES)}, got {self.cc!r}")
        if self.ecn not in ("off", "auto", "bpf", "red", "controller"):
            raise UsageError(f"ecn must be off, auto, bpf, red or controller, got {self.ecn!r}")
        if "nscc" in self.cc and self.ecn == "off":
            raise UsageError("NSCC cuts its window on ECN-marked acknowledgements: with "
                             "ecn=off it would only grow; add --set ecn=auto")

    @property
    def variant_list(self) -> list[str]:
        return [v.strip() for v in self.variants.split(",") if v.strip()]


def capture_plan(fabric, params: Params) -> CapturePlan:
    """The bottleneck port (toward the receiver: the trimmed headers) and a sender's
    port (toward it: the NACKs), without the whole data frames."""
    hosts = [h.name for h in fabric.hosts]
    return CapturePlan(hosts[:2], "not (udp dst port 4791 and (ip[1] & 0xfc) = 0x68 and "
                       "greater 200)",
                       "trimmed headers, NACKs and SACKs (whole RoCE data frames are left out)")


def bottleneck_counts(dp, telemetry, switch: str, port: int) -> dict:
    """Frames the bottleneck dropped and trimmed, and every drop in the switches."""
    drops = telemetry.drops(PRIORITY_ROCE_DATA)
    return {"drops": drops[f"{switch}:{port}:{PRIORITY_ROCE_DATA}"],
            "trimmed": dp.counters(switch, port, PRIORITY_ROCE_DATA)["trimmed"],
            "all_drops": drops, "t": time.time()}


def run_variant(ctx: RunContext, gpus: GpuAgents, variant: str, receiver: str,
                senders: list[str], base_rtt_ms: float | None = None) -> dict:
    p, net = ctx.params, ctx.net
    recv_if = ctx.fabric.host(receiver).interface()
    net.set_congestion(CongestionParams(ecn=p.ecn, trim=variant == "trim", trim_kb=p.trim_kb))
    before = bottleneck_counts(net.dataplane, ctx.telemetry, recv_if.switch, recv_if.port)
    nbytes = p.flow_kb * 1024
    log.info(f"{variant}: {len(senders)} senders x {p.flow_kb} KB over MRC -> {receiver}")
    t0 = time.time()
    flows = gpus.transfers([(s, receiver, nbytes) for s in senders], "mrc",
                           params={"credit_budget_packets": p.credit_budget_packets,
                                   "cc": p.cc, **({"nscc": {"base_rtt_ms": base_rtt_ms}}
                                                  if base_rtt_ms else {})},
                           timeout_s=traffic_timeout_s(len(senders) * nbytes,
                                                       recv_if.rate_mbps))
    t1 = time.time()
    time.sleep(SETTLE_S)
    after = bottleneck_counts(net.dataplane, ctx.telemetry, recv_if.switch, recv_if.port)
    key = f"{recv_if.switch}:{recv_if.port}:{PRIORITY_ROCE_DATA}"
    elsewhere = {k: n - before["all_drops"][k] for k, n in after["all_drops"].items()
                 if k != key and n - before["all_drops"][k]}
    q = ctx.telemetry.summary(t0, t1).get(key, {})
    sent = [f["counters"] for f in flows]
    got = [f["receiver_counters"] for f in flows]
    ideal_s = len(senders) * nbytes * 8 / (recv_if.rate_mbps * 1e6)
    done = [f["completion_s"] for f in flows if f["completion_s"] is not None]
    return {
        "bottleneck": key,
        "drops_packets": after["drops"] - before["drops"],
        "trimmed_packets": after["trimmed"] - before["trimmed"],
        "drops_elsewhere": elsewhere,
        "counted_unix_s": [round(before["t"], 4), round(after["t"], 4)],
        "retransmitted_packets": sum(c["retransmitted"] for c in sent),
        "timeouts": sum(c["timeouts"] for c in sent),
        "trimmed_received": sum(c["trimmed_received"] for c in got),
        "trim_nacks_sent": sum(c["trim_nacks_sent"] for c in got),
        "trim_nacks_received": sum(c["trim_nacks_received"] for c in sent),
        "trim_resent": sum(c["trim_resent"] for c in sent),
        # from sending a packet that was lost (dropped or trimmed) to resending it
        "resend_delay_ms_mean": round(sum(c["resend_delay_ms_sum"] for c in sent)
                                      / max(1, sum(c["retransmitted"] for c in sent)), 3),
        "resend_delay_ms_max": max(c["resend_delay_ms_max"] for c in sent),
        "srtt_ms": [c["srtt_ms"] for c in sent],   # each sender's round trip, at the end
        "receiver_duplicates": sum(c["duplicate"] for c in got),
        "backlog_bytes_p50": q.get("backlog_bytes_p50", 0),
        "backlog_bytes_p99": q.get("backlog_bytes_p99", 0),
        "backlog_bytes_max": q.get("backlog_bytes_max", 0),
        "completion_s_max": round(max(done), 3) if len(done) == len(flows) else None,
        "ideal_s": round(ideal_s, 3),
        "elapsed_s": round(t1 - t0, 3),
        "all_intact": all(f["intact"] for f in flows),
    }


def run(ctx: RunContext) -> dict:
    p = ctx.params
    if ctx.net.dataplane is None:
        raise LabError("the trimming experiment needs the lab's BPF data path, which is not "
                       "running here (fabriclab doctor says why)")
    hosts = [h.name for h in ctx.fabric.hosts]
    if len(hosts) < p.senders + 1:
        raise UsageError(f"trimming with {p.senders} senders needs {p.senders + 1} hosts; "
                         f"the fabric has {len(hosts)}")
    receiver, senders = hosts[0], hosts[1:p.senders + 1]
    out = {"receiver": receiver, "senders": senders, "flow_bytes": p.flow_kb * 1024}
    try:
        with GpuAgents(ctx.net, hosts=[receiver, *senders]) as gpus:
            if "nscc" in p.cc:      # its base RTT, before any variant loads the fabric
                out["nscc_base_rtt_ms"] = idle_rtt_ms(gpus, senders[0], receiver)
            for variant in p.variant_list:
                m = out[variant] = run_variant(ctx, gpus, variant, receiver, senders,
                                               out.get("nscc_base_rtt_ms"))
                log.info(f"  drops {m['drops_packets']}, trimmed {m['trimmed_packets']}, "
                         f"resent {m['retransmitted_packets']} ({m['timeouts']} by timeout, "
                         f"{m['trim_resent']} at a NACK; {m['resend_delay_ms_mean']:.1f} ms "
                         f"after their first sending on average), done in "
                         f"{m['completion_s_max']} s (ideal {m['ideal_s']} s)")
            out["cpu_bound_hosts"] = gpus.cpu_bound()
        out["starved"] = excuses(starved(out["trim"]) if "trim" in out else [])
    finally:
        ctx.net.set_congestion(CongestionParams())
    return out


def starved(m: dict) -> list[Excuse]:
    """Timeouts under trimming, where every loss is announced: a sender's timer fired
    while the NACK or the SACKs were on their way, which on this fabric (no other loss)
    means a host stalled past the timer's margin: the machine, not trimming. A stall
    decides what was resent and when, never whether the queue trimmed or dropped."""
    if not m["timeouts"]:
        return []
    again = m["trimmed_received"] - m["trim_nacks_sent"]
    return [Excuse("trim", (RESENDS, RESEND_DELAY),
                   f"{m['timeouts']} retransmit timeouts although every loss was trimmed and "
                   f"announced; {m['receiver_duplicates']} resent packets had arrived and "
                   f"{again} trimmed ones were copies of packets that had: the senders' "
                   f"timers fired while the answers were on their way (a host stalled longer "
                   f"than the timer's margin), so this comes from the machine's load, not "
                   f"from trimming")]


def claims(params: Params, m: dict) -> list[Claim]:
    ran = [v for v in params.variant_list if v in m]
    out = [Claim("every message arrived intact, every variant",
                 all(m[v]["all_intact"] for v in ran), {v: m[v]["all_intact"] for v in ran},
                 "all True")]
    if "drop" in m:
        v = m["drop"]
        out.append(Claim("drop: the bottleneck queue overflows and drops",
                         v["drops_packets"] > 0 and v["trimmed_packets"] == 0,
                         {"drops": v["drops_packets"], "trimmed": v["trimmed_packets"]},
                         "drops > 0, trimmed == 0", "packets", rests_on=(DROPS,)))
    if "trim" in m:
        v = m["trim"]
        out += [
            Claim("trim: the bottleneck trims instead of dropping",
                  v["trimmed_packets"] > 0 and v["drops_packets"] == 0,
                  {"trimmed": v["trimmed_packets"], "drops": v["drops_packets"]},
                  "trimmed > 0, drops == 0", "packets", rests_on=(DROPS,)),
            # (a packet whose NACK is overtaken by the SACKs of reorder_packets later ones
            # is resent on that evidence instead: once either way)
            Claim("trim: every trimmed packet is NACKed and resent once, nothing else, "
                  "no timeout",
                  v["trimmed_received"] == v["trim_nacks_sent"] == v["trimmed_packets"]
                  and v["retransmitted_packets"] == v["trimmed_packets"]
                  and v["timeouts"] == 0,
                  {"trimmed": v["trimmed_packets"], "nacks": v["trim_nacks_sent"],
                   "resent": v["retransmitted_packets"], "timeouts": v["timeouts"]},
                  "nacks == resent == trimmed, timeouts == 0", "packets", rests_on=(RESENDS,)),
            Claim(f"trim: a trimmed packet is resent within about a round trip (mean "
                  f"from sending to resending <= {ROUND_TRIPS:g} x the senders' mean "
                  f"smoothed round trip)",
                  0 < v["resend_delay_ms_mean"] <= ROUND_TRIPS * mean(v["srtt_ms"]),
                  {"resend_delay": v["resend_delay_ms_mean"], "srtt": round(mean(v["srtt_ms"]), 3)},
                  f"resend_delay <= {ROUND_TRIPS:g} x srtt", "ms", rests_on=(RESEND_DELAY,)),
        ]
    if "drop" in m and "trim" in m:
        d, t = m["drop"]["resend_delay_ms_mean"], m["trim"]["resend_delay_ms_mean"]
        out.append(Claim("trim: lost packets are resent sooner than where the queue drops "
                         "(mean from sending to resending)", 0 < t < d,
                         {"trim": t, "drop": d}, "trim < drop", "ms",
                         rests_on=(RESEND_DELAY,)))
    return out
