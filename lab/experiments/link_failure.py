"""A spine uplink fails in the middle of an all-reduce: RC stalls, MRC keeps going.

A ring all-reduce of `allreduce_kb` per GPU over four GPU hosts, two on each of two
leaves joined by four spines (workload=allreduce), or one long transfer from a host
on leaf 0 to a host on leaf 1 (workload=transfer); once by RC and once by MRC (one
explicit entropy value per spine). After `fail_after_s` the leaf-0 uplink carrying
the most traffic goes down (its veth, so both switches see the port drop). The
controller reroutes around it after `reroute_delay_ms`, the convergence time of the
routing it stands for.
  RC   its one UDP source port pins each QP to one spine: the QP on the lost spine
       loses everything it sends until the reroute, and then waits for its
       retransmit timer; in a ring every GPU soon waits for that one flow
  MRC  the packets on the dead entropy value are lost, selectively resent on the
       others, and the dead EV is retired; it never stops. Its EV changes go to the
       lab's EV controller as they happen (lab/fabric/evs.py): with ev_policy=deny it
       denies the EV of the failed link on the hosts of that leaf, and MRC stops
       probing it (with ev_policy=watch the EV stays assumed bad and is probed on)
Stall: the longest time after the failure in which the bytes delivered (summed over
every receiving QP) did not grow. Then the link comes back, and the routes with it,
before the next variant.

Gray failures (`failure`), where the link never stays down, so routing that watches
link state sees nothing, or sees it come and go:
  degrade     the link's rate drops to `degrade_to` of itself, both ways, until the
              work is done: RC's QP pinned to it crawls, its go-back-N resending into
              the slow port's full queue; MRC's packets on that EV wait in it, the
              others go on over the other spines
  flap        down for half of every `flap_period_ms`, up for the other half: each
              down is a link-down event; the controller reroutes after its delay
  burst-loss  every RoCE frame the leaf sends on it dropped for `burst_ms` of every
              `burst_every_ms` (counted): RC goes back N after each burst, MRC resends
              what was lost and retires the EV
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from lab.core.errors import LabError, UsageError
from lab.experiments.base import Claim, RunContext
from lab.experiments.common import (allreduce_delivery, stall_s, traffic_timeout_s,
                                    tx_bytes)
from lab.fabric import events
from lab.fabric.evs import EvController
from lab.fabric.gpus import GpuAgents, explicit_evs
from lab.kernel import queues
from lab.kernel.impair import BurstLoss, Flap, set_link
from topologies.fabric import interface_name

log = logging.getLogger(__name__)
NAME = "link-failure"
DESCRIPTION = "a spine uplink goes down mid all-reduce: RC stalls until rerouted, MRC retires the EV"
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 4, "leaves": 2, "hosts_per_leaf": 2,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 10.0,
                                    "rate_scale": 10000}}
STALL_RATIO = 0.5           # MRC's stall under half of RC's
WINDOW_S = 0.2              # the uplinks' traffic is read over this long before the failure
WORKLOADS = ("allreduce", "transfer")
EV_POLICIES = ("deny", "watch")
FAILURES = ("down", "degrade", "flap", "burst-loss")
SETTLE_GRACE_S = 0.5        # a link event reaches the controller's log within this
GRAY_RATIO = 0.5            # gray failures: MRC's completion (or resends) under half RC's

SCALED_SIZES = ("allreduce_kb", "flow_kb")   # shrink with the link rates on a slow machine (calibrate.py)
# ...and the failure's times stretch as the traffic does (runner.scaled_times)
SCALED_TIMES = ("fail_after_s", "reroute_delay_ms", "flap_period_ms", "burst_ms",
                "burst_every_ms")
# flow ends busy at once at the defaults (a ring over 4) (calibrate.py)
BUSY_ENDS = 8

@dataclass
class Params:
    topology: str = "leaf-spine"
    workload: str = "allreduce"   # allreduce (ring over 2 GPUs per leaf) | transfer (one flow)
    allreduce_kb: int = 1024      # per GPU, workload=allreduce
    flow_kb: int = 2000           # workload=transfer
    fail_after_s: float = 0.6
    reroute_delay_ms: float = 1500.0
    ev_policy: str = "deny"       # the EV controller: deny (EVs of failed links) | watch
    failure: str = "down"         # down | degrade | flap | burst-loss (gray failures)
    degrade_to: float = 0.25      # failure=degrade: the link's rate, as a share of its own
    # (at 0.1, RC's QP took 79 s: go-back-N timeouts behind the slow port's full queue)
    flap_period_ms: float = 400.0  # failure=flap: down half of it, up the other half
    burst_ms: float = 40.0        # failure=burst-loss: each burst drops every RoCE frame
    burst_every_ms: float = 200.0  # ...and one starts this often

    def validate(self) -> None:
        if self.failure not in FAILURES:
            raise UsageError(f"failure must be one of {', '.join(FAILURES)}, "
                             f"got {self.failure!r}")
        if not 0 < self.degrade_to < 1 or self.flap_period_ms <= 0 or \
                not 0 < self.burst_ms < self.burst_every_ms:
            raise UsageError("need 0 < degrade_to < 1, flap_period_ms > 0 and "
                             "0 < burst_ms < burst_every_ms")
        if self.topology != "leaf-spine":
            raise UsageError("link-failure needs topology=leaf-spine")
        if self.workload not in WORKLOADS:
            raise UsageError(f"workload must be one of {', '.join(WORKLOADS)}, "
                             f"got {self.workload!r}")
        if self.ev_policy not in EV_POLICIES:
            raise UsageError(f"ev_policy must be one of {', '.join(EV_POLICIES)}, "
                             f"got {self.ev_policy!r}")
        if min(self.flow_kb, self.allreduce_kb) <= 0 or self.fail_after_s <= WINDOW_S \
                or self.reroute_delay_ms < 0:
            raise UsageError(f"need flow_kb and allreduce_kb > 0, fail_after_s > {WINDOW_S}, "
                             f"reroute_delay_ms >= 0")


def uplinks(ctx: RunContext, leaf: str) -> list[str]:
    spines = {s.name for s in ctx.fabric.switches if s.role == "spine"}
    return [interface_name(leaf, p) for p, (peer, _) in
            sorted(ctx.fabric.switch_ports(leaf).items()) if peer in spines]


class Failure:
    """What happens to the failed link (Params.failure), from start() until stop()."""

    def __init__(self, ctx: RunContext, intf: str):
        p = ctx.params
        self.kind, self.intf, self.ctx = p.failure, intf, ctx
        link = next(ln for ln in ctx.fabric.links
                    if intf in (interface_name(ln.a, ln.a_port), interface_name(ln.b, ln.b_port)))
        self.ends = [interface_name(link.a, link.a_port), interface_name(link.b, link.b_port)]
        self.rate_mbps = link.rate_mbps
        self.repeating = Flap(intf, p.flap_period_ms / 1000) if self.kind == "flap" else \
            BurstLoss(intf, p.burst_ms / 1000, p.burst_every_ms / 1000) \
            if self.kind == "burst-loss" else None

    def start(self) -> None:
        if self.kind == "down":
            set_link(self.intf, up=False)
        elif self.kind == "degrade":
            for end in self.ends:
                queues.set_rate(end, self.rate_mbps * self.ctx.params.degrade_to,
                                self.ctx.net.queue_params)
        else:
            self.repeating.start()

    def stop(self) -> dict:
        """The link whole again; what the failure did (flaps, frames dropped)."""
        if self.kind == "down":
            set_link(self.intf, up=True)
            return {}
        if self.kind == "degrade":
            for end in self.ends:
                queues.set_rate(end, self.rate_mbps, self.ctx.net.queue_params)
            return {"degraded_to_mbps": round(self.rate_mbps * self.ctx.params.degrade_to, 3)}
        self.repeating.stop()
        if self.kind == "flap":
            return {"flaps": self.repeating.cycles}
        return {"bursts": self.repeating.cycles, "burst_dropped": self.repeating.lost}

    @property
    def link_goes_down(self) -> bool:
        return self.kind in ("down", "flap")


def wait_reroute(ctx: RunContext, since: float, timeout_s: float) -> float | None:
    """When the controller finished rerouting after `since` (its event log), or None."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        done = [e["t"] for e in events.read(ctx.workdir / "routing-events.jsonl", since)
                if e["event"] == "rerouted"]
        if done:
            return done[0]
        time.sleep(0.05)
    return None


def settle_routes(ctx: RunContext, since: float, t_up: float) -> None:
    """Wait for the routes to be whole again after the link came up for good at `t_up`:
    the controller reroutes `reroute_delay_ms` after every link event, so after a flap
    the reroutes of earlier events still come; the one after the last event leaves every
    route in place. (The last event is logged a little after the link comes up: it is
    looked for until SETTLE_GRACE_S after t_up.)"""
    delay = ctx.params.reroute_delay_ms / 1000
    deadline = time.time() + delay + 5
    while time.time() < deadline:
        seen = events.read(ctx.workdir / "routing-events.jsonl", since)
        last = max((e["t"] for e in seen if e["event"] in ("link_down", "link_up")),
                   default=since)
        if time.time() > t_up + SETTLE_GRACE_S and any(
                e["event"] == "rerouted" and e["t"] >= last + delay - 0.05 for e in seen):
            return
        time.sleep(0.05)
    raise LabError(f"the routes were not whole again {delay + 5:.1f} s after the link "
                   f"came back (routing-events.jsonl)")


def time_limit_s(ctx: RunContext, gpus: GpuAgents) -> float:
    """How long the workload may take: a ring all-reduce sends each GPU's vector out
    twice, nearly (reduce-scatter, then all-gather), through one GPU's link; a flow
    pinned to the failed link gets only what the failure leaves of its rate (on a slow
    machine, where the minimum limit no longer covers it, RC's QP crawling through a
    degraded link outlasted a limit sized for the whole rate)."""
    p = ctx.params
    nbytes = 2 * p.allreduce_kb * 1024 if p.workload == "allreduce" else p.flow_kb * 1024
    left = {"degrade": p.degrade_to, "flap": 0.5,
            "burst-loss": 1 - p.burst_ms / p.burst_every_ms}.get(p.failure, 1.0)
    return traffic_timeout_s(nbytes, gpus.hosts[0].interface().rate_mbps * left)


def transfer(ctx: RunContext, gpus: GpuAgents, transport: str, params: dict | None) -> dict:
    src, dst = gpus.hosts[0].name, gpus.hosts[-1].name
    [f] = gpus.transfers([(src, dst, ctx.params.flow_kb * 1024)], transport, params=params,
                         timeout_s=time_limit_s(ctx, gpus))
    return {"delivery": f["receiver_samples"], "completion_s": f["completion_s"],
            "retransmitted_packets": f["counters"]["retransmitted"],
            "timeouts": f["counters"]["timeouts"], "evs": [f["evs"] or []],
            "intact": f["intact"]}


def allreduce(ctx: RunContext, gpus: GpuAgents, transport: str, params: dict | None) -> dict:
    return allreduce_delivery(gpus, ctx.params.allreduce_kb, transport,
                              time_limit_s(ctx, gpus), params)


def run_variant(ctx: RunContext, gpus: GpuAgents, transport: str, leaf: str) -> dict:
    p = ctx.params
    links = uplinks(ctx, leaf)
    params = {"evs": explicit_evs(ctx.fabric, gpus.hosts[0])} if transport == "mrc" else None
    work = allreduce if p.workload == "allreduce" else transfer
    controller = EvController(ctx.fabric, ctx.workdir, [h.name for h in gpus.hosts])
    gpus.ev_controller = controller if p.ev_policy == "deny" else None
    seen = len(gpus.ev_events)
    result: dict = {}
    flow = threading.Thread(target=lambda: result.update(work(ctx, gpus, transport, params)))
    t0 = time.time()
    flow.start()
    time.sleep(p.fail_after_s - WINDOW_S)
    before = [tx_bytes(i) for i in links]
    time.sleep(WINDOW_S)
    load = [tx_bytes(i) - b for i, b in zip(links, before)]
    failed = links[max(range(len(links)), key=load.__getitem__)]
    failure = Failure(ctx, failed)
    t_fail = time.time()
    failure.start()
    log.info(f"  {failed}: {p.failure} at {t_fail - t0:.2f} s (uplink bytes in the last "
             f"{WINDOW_S:.1f} s: {load})")
    # the failure lasts as long as the work (whose own time limit ends it first)
    flow.join(timeout=time_limit_s(ctx, gpus) + 60)
    if failure.kind == "down":
        rerouted = wait_reroute(ctx, t_fail, p.reroute_delay_ms / 1000 + 5)
    t_up = time.time()
    did = failure.stop()
    routing = events.read(ctx.workdir / "routing-events.jsonl", t_fail)
    if failure.kind != "down":
        rerouted = next((e["t"] for e in routing
                         if e["event"] == "rerouted" and e["t"] < t_up), None)
    if failure.link_goes_down:
        settle_routes(ctx, t_fail, t_up)
    if not result:
        raise LabError(f"the {transport} {p.workload} did not finish")
    return {"failed_link": failed, "failure": failure.kind, **did,
            "failed_at_s": round(t_fail - t0, 3),
            "uplink_bytes_before": load,
            "link_down_events": sum(e["event"] == "link_down" for e in routing
                                    if e["t"] < t_up),
            "rerouted_after_s": round(rerouted - t_fail, 3) if rerouted else None,
            "stall_s": stall_s(result["delivery"], t_fail),
            "completion_s": round(result["completion_s"], 3),
            "retransmitted_packets": result["retransmitted_packets"],
            "timeouts": result["timeouts"],
            "evs_retired": sum(1 for evs in result["evs"] for ev in evs if ev["retirements"]),
            # every EV state change (MRC: good, assumed_bad, probing, denied) of the QPs
            # that sent data (a ring's receiving QPs take the controller's denials too),
            # in the order they came: ms since the variant started (failed_at_s's clock),
            # which QP, which EV, why
            "ev_changes": sorted(({"t_ms": round((ev["qp_started_unix"] - t0) * 1e3 + t, 3),
                                   "qp": i, "ev": hex(ev["port"]), "state": state, "why": why}
                                  for i, evs in enumerate(result["evs"]) for ev in evs
                                  if ev["qp_started_unix"] is not None
                                  for t, state, why in ev.get("history", [])),
                                 key=lambda c: c["t_ms"]),
            "ev_events": len(gpus.ev_events) - seen,      # reported as they happened
            "ev_denials": controller.decisions,
            "intact": result["intact"]}


def run(ctx: RunContext) -> dict:
    p = ctx.params
    by_leaf: dict[str, list[str]] = {}
    for h in ctx.fabric.hosts:
        by_leaf.setdefault(h.interface().switch, []).append(h.name)
    leaf, other = sorted(by_leaf)[:2]
    if p.workload == "allreduce":
        if len(by_leaf[leaf]) < 2 or len(by_leaf[other]) < 2:
            raise UsageError("workload=allreduce needs 2 GPU hosts on each of two leaves "
                             "(hosts_per_leaf >= 2)")
        hosts = [*by_leaf[leaf][:2], *by_leaf[other][:2]]    # the ring crosses each way once
        what = f"ring all-reduce of {p.allreduce_kb} KB per GPU over {', '.join(hosts)}"
    else:
        hosts = [by_leaf[leaf][0], by_leaf[other][-1]]
        what = f"{p.flow_kb} KB {hosts[0]} -> {hosts[1]}"
    ctx.net.controller.enable_rerouting(p.reroute_delay_ms)
    out: dict = {"workload": p.workload, "hosts": hosts}
    with GpuAgents(ctx.net, hosts=hosts) as gpus:
        for transport in ("rc", "mrc"):
            log.info(f"{transport}: {what}; an uplink of {leaf} fails after "
                     f"{p.fail_after_s} s, rerouted after {p.reroute_delay_ms:.0f} ms")
            m = out[transport] = run_variant(ctx, gpus, transport, leaf)
            log.info(f"  stall {m['stall_s']:.2f} s, done in {m['completion_s']:.2f} s, "
                     f"{m['retransmitted_packets']} retransmitted, {m['timeouts']} timeouts")
            for (qp, ev), changes in group_by_ev(m["ev_changes"]).items():
                probes = sum(c["why"] == "probe sent" for c in changes)
                log.info(f"    QP {qp} EV {ev}: {changes[0]['state']} at "
                         f"{changes[0]['t_ms'] / 1e3:.2f} s ({changes[0]['why']}), then "
                         f"{probes} probes, {changes[-1]['state']} at the end")
        out["cpu_bound_hosts"] = gpus.cpu_bound()
    return out


def group_by_ev(changes: list[dict]) -> dict[tuple[int, str], list[dict]]:
    """An EV's state changes, per (QP, EV), in time order."""
    out: dict[tuple[int, str], list[dict]] = {}
    for c in changes:
        out.setdefault((c["qp"], c["ev"]), []).append(c)
    return out


def claims(params: Params, m: dict) -> list[Claim]:
    rc, mrc = m["rc"], m["mrc"]
    out = [Claim("both runs deliver every byte intact (all-reduce: every GPU holds the mean)",
                 rc["intact"] and mrc["intact"],
                 {"rc": rc["intact"], "mrc": mrc["intact"]}, "both True")]
    stall = Claim(f"MRC's stall is far shorter than RC's (< {STALL_RATIO:.0%})",
                  mrc["stall_s"] < STALL_RATIO * rc["stall_s"],
                  f"mrc {mrc['stall_s']} s", f"< {STALL_RATIO} x rc {rc['stall_s']} s",
                  timing=True)
    if params.failure == "down":
        return out + [
            Claim("the controller rerouted around the failed link",
                  rc["rerouted_after_s"] is not None and mrc["rerouted_after_s"] is not None,
                  {"rc": rc["rerouted_after_s"], "mrc": mrc["rerouted_after_s"]},
                  "seconds, both", "s"),
            stall] + ([denial_claim(mrc)] if params.ev_policy == "deny" else [])
    if params.failure == "flap":
        downs = {"rc": rc["link_down_events"], "mrc": mrc["link_down_events"]}
        # RC's pinned QP loses what it sends in every down and waits out its timer; MRC
        # retires the EV and probes it back between downs (measured, 4 runs: MRC done in
        # 0.64-0.81 of RC's time)
        return out + [Claim("the routing saw the link go down again and again (it flapped)",
                            min(downs.values()) >= 2, downs, ">= 2 link-down events, both"),
                      Claim("MRC finishes sooner than RC (RC's QP stays pinned to the "
                            "flapping link)", mrc["completion_s"] < rc["completion_s"],
                            f"mrc {mrc['completion_s']} s", f"< rc {rc['completion_s']} s",
                            timing=True)]
    # a gray failure the routing cannot see: the link stays up
    seen = {v: {"link_down_events": x["link_down_events"],
                "rerouted": x["rerouted_after_s"] is not None}
            for v, x in (("rc", rc), ("mrc", mrc))}
    out.append(Claim(f"the routing saw nothing ({params.failure}: the link never went down), "
                     f"so it rerouted nothing",
                     all(x["link_down_events"] == 0 and not x["rerouted"] for x in seen.values()),
                     seen, "no link-down event, no reroute"))
    if params.failure == "degrade":
        out.append(Claim(f"MRC steers around the slow link: done in under {GRAY_RATIO} of RC's "
                         f"time (RC's QP stays pinned to it)",
                         mrc["completion_s"] < GRAY_RATIO * rc["completion_s"],
                         f"mrc {mrc['completion_s']} s",
                         f"< {GRAY_RATIO} x rc {rc['completion_s']} s", timing=True))
    else:       # burst-loss: each burst costs RC a window, MRC what was lost
        out.append(Claim(f"MRC resends under {GRAY_RATIO} of what RC resends (selective "
                         f"repeat against go-back-N after every burst)",
                         mrc["retransmitted_packets"] < GRAY_RATIO * rc["retransmitted_packets"],
                         f"mrc {mrc['retransmitted_packets']}",
                         f"< {GRAY_RATIO} x rc {rc['retransmitted_packets']}", "packets"))
    return out


def denial_claim(mrc: dict) -> Claim:
    """The EV controller heard MRC's EVs go bad, denied the failed link's, and MRC sent
    nothing on a denied EV after (no probe: denied EVs are never probed)."""
    denied = {(c["qp"], c["ev"]): c["t_ms"] for c in mrc["ev_changes"] if c["state"] == "denied"}
    after = sum(1 for c in mrc["ev_changes"] if (c["qp"], c["ev"]) in denied
                and c["t_ms"] > denied[c["qp"], c["ev"]] and c["why"] == "probe sent")
    return Claim("the EV controller denied the failed link's EV, and MRC probed it no more",
                 bool(mrc["ev_denials"]) and bool(denied) and after == 0,
                 {"denials": len(mrc["ev_denials"]), "qps_denied": len(denied),
                  "probes_after": after}, "denials > 0, probes after == 0")
