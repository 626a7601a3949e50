"""Why did the GPU wait? A step's communication time split into causes, from what its
collectives measured (training-step, training-job).

For each communication phase (an all-reduce, a round of messages) the lab knows its
time on the lab's clock (wall), the agents' time from start to the last GPU done
(elapsed), the time its bytes need on free links (wire: the alpha-beta bandwidth term),
and what the GPUs' NICs and transports counted: PFC pauses, retransmissions and the
waits for their timers, CNPs, EV retirements. The wall time splits into, in this order,
each part at most what is left of it:
  agents          the lab's own cost of a phase (commands to the agents and back:
                  wall - elapsed); a real launch costs microseconds
  wire            the bytes' time on the links: no fabric does better
  paused          the longest PFC held a GPU's NIC paused
  retransmission  the waits for retransmit timers (timeout_wait_ms) and the resent
                  frames' time on the wire, at the GPU that lost most
  slow_path       the rest: longer than the bytes need on free links for none of the
                  above: queueing behind other traffic, a rate DCQCN lowered (CNPs say
                  so), a path shared with another flow (an ECMP collision), a host
                  short of CPU
Pure: the experiments hand it numbers, it hands back numbers.
"""
from __future__ import annotations

from lab.experiments.common import FRAME_BYTES

CAUSES = ("agents", "wire", "paused", "retransmission", "slow_path")
EVIDENCE = ("pause_frames", "cnps", "retransmitted", "timeouts", "ev_retirements")


def evidence(counters: list[dict], nics: list[dict], evs: list[dict],
             rate_mbps: float) -> dict:
    """What a phase's GPUs counted: per GPU, its QPs' counters ({qp: counters}), its NIC's
    figures (paused_s per priority, pause_frames_received) and its MRC QPs' EVs ({qp:
    [ev, ...]}); the times are the worst GPU's, the counts the sums."""
    per_gpu = [list(c.values()) for c in counters]
    return {
        "paused_s": round(max((max(n.get("paused_s") or [0.0]) for n in nics), default=0.0), 4),
        "timeout_wait_s": round(max((sum(q.get("timeout_wait_ms", 0.0) for q in qs)
                                     for qs in per_gpu), default=0.0) / 1e3, 4),
        "resent_wire_s": round(max((sum(q.get("retransmitted", 0) for q in qs)
                                    for qs in per_gpu), default=0)
                               * FRAME_BYTES * 8 / (rate_mbps * 1e6), 4),
        "pause_frames": sum(n.get("pause_frames_received", 0) for n in nics),
        "cnps": sum(q.get("cnps_received", 0) for qs in per_gpu for q in qs),
        "retransmitted": sum(q.get("retransmitted", 0) for qs in per_gpu for q in qs),
        "timeouts": sum(q.get("timeouts", 0) for qs in per_gpu for q in qs),
        "ev_retirements": sum(ev.get("retirements", 0) for per in evs
                              for qp in per.values() for ev in (qp or ())),
    }


def flows_evidence(flows: list[dict], rate_mbps: float) -> dict:
    """evidence() for a round of messages (GpuAgents.transfers' flows): each sender's QPs
    and NIC."""
    by_src: dict[str, tuple[dict, dict, dict]] = {}
    for i, f in enumerate(flows):
        counters, nic, evs = by_src.setdefault(f["src"], ({}, f["sender_nic"], {}))
        counters[i] = f["counters"]
        if f.get("evs"):
            evs[i] = f["evs"]
    return evidence([c for c, _, _ in by_src.values()], [n for _, n, _ in by_src.values()],
                    [e for _, _, e in by_src.values()], rate_mbps)


def split(wall_s: float, elapsed_s: float, wire_s: float, ev: dict) -> dict[str, float]:
    """A phase's wall time by cause (CAUSES, in that order, each at most what is left)."""
    parts = (("agents", wall_s - elapsed_s), ("wire", wire_s), ("paused", ev["paused_s"]),
             ("retransmission", ev["timeout_wait_s"] + ev["resent_wire_s"]))
    left, out = wall_s, {}
    for cause, seconds in parts:
        take = min(max(0.0, seconds), max(0.0, left))
        out[cause] = round(take, 4)
        left -= take
    out["slow_path"] = round(max(0.0, left), 4)
    return out


def total(phases: list[dict]) -> dict:
    """A step's causes and evidence: its phases' summed (phases without: compute)."""
    out = {c: 0.0 for c in CAUSES}
    seen = {k: 0 for k in EVIDENCE}
    for ph in phases:
        for c in CAUSES:
            out[c] += ph.get("causes", {}).get(c, 0.0)
        for k in EVIDENCE:
            seen[k] += ph.get("evidence", {}).get(k, 0)
    causes = {c: round(v, 4) for c, v in out.items()}
    return {"causes": causes, "evidence": seen, "main": main_cause(causes)}


def mean_causes(steps: list[dict]) -> dict[str, float]:
    """Seconds per step by cause, over a variant's steps (each with `wait_causes`)."""
    return {c: round(sum(s["wait_causes"][c] for s in steps) / len(steps), 4)
            for c in CAUSES} if steps else {}


def main_cause(causes: dict[str, float]) -> str:
    """The cause beyond the wire and the agents that took longest ("none": no time
    went to any)."""
    beyond = {c: causes.get(c, 0.0) for c in ("paused", "retransmission", "slow_path")}
    best = max(beyond, key=beyond.get)
    return best if beyond[best] > 0 else "none"
