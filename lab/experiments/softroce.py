"""Soft-RoCE against the lab's RC: the same transfer, the same path, the same loss.

One host writes `messages` x `message_kb` to another across the fabric (leaf,
spine, leaf; 10 Mb/s links), first with the lab's RC emulation (traffic/rc.py,
in the hosts' namespaces), then with the kernel's real RoCE, rxe, driven by
perftest's ib_write_bw (the hosts' interfaces moved to the root namespace, where
Debian 12's rxe works: lab/fabric/rxe.py). Each at every `loss_percents` rate:
nftables drops that share of the RoCE frames arriving at the receiver, counting
each drop (lab/kernel/impair.py), for both alike.

Both are measured the same way, on the wire: a capture at the sender's leaf port
(data out, ACKs/NAKs back), decoded by traffic/roce.py with every ICRC checked.
Retransmitted = data frames whose PSN had already been sent; goodput = delivered
payload over first data frame to last ACK. The tools' own figures ride along
(the lab's counters and CRC check; ib_write_bw's bandwidth and rxe's hw_counters).

The lab's RC is set up like the rxe QP: the same retransmit timeout (the QP's `-u`
exponent), the same packets in flight (ib_write_bw's `tx_depth` WRITEs outstanding,
of `message_kb` each), an ACK per message as rxe asks for one at each message's last
packet, no DCQCN (rxe has none). The window is small on purpose: with perftest's
default (128 WRITEs; rxe then caps its QP at 128 unacknowledged packets), 3% loss
made rxe exceed its retry count (IBV_WC_RETRY_EXC_ERR, measured): every go-back-N
round resends up to 128 packets, and a round rarely gets through unscathed.
Needs rdma_rxe: the lab VM or the Vagrant VM.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from lab.core.errors import UsageError
from lab.experiments.base import Claim, RunContext
from lab.fabric.gpus import GpuAgents
from lab.fabric.rxe import (Capture, RxeHosts, counter_delta, hw_counters, ib_write_bw,
                          pcap_frames, qp_timeout_ms, require_soft_roce, roce_flow_stats)
from lab.kernel.impair import RandomLoss
from topologies.fabric import interface_name

log = logging.getLogger(__name__)
NAME = "softroce"
DESCRIPTION = ("the same transfer by real RoCE (rxe) and by the lab's RC, clean and under "
               "loss: goodput and retransmissions side by side")
# two hosts on different leaves, so the path crosses the fabric; 10 Mb/s keeps a
# software CPU (the lab VM under TCG) well ahead of the line rate
TOPOLOGY_DEFAULTS = {"leaf-spine": {"spines": 1, "leaves": 2, "hosts_per_leaf": 1,
                                    "host_rate_mbps": 10.0, "fabric_rate_mbps": 10.0,
                                    "rate_scale": 10000}}
MTU_BYTES = 1024


@dataclass
class Params:
    topology: str = "leaf-spine"
    loss_percents: str = "0,1,3"
    message_kb: int = 4           # one RDMA WRITE (ib_write_bw -s)
    messages: int = 80            # ib_write_bw -n: 320 KB in all by default
    tx_depth: int = 4             # WRITEs outstanding (ib_write_bw -t): 16 packets in flight
    # the QP's ACK timeout, 4.096 us * 2^exp (134 ms), for both: under a software CPU
    # perftest's default (14, 67 ms) fired without loss now and then
    qp_timeout_exp: int = 15
    transfer_timeout_s: float = 300.0

    def validate(self) -> None:
        if not self.loss_list or any(not 0 <= x <= 10 for x in self.loss_list):
            raise UsageError(f"loss_percents must be comma-separated rates in [0, 10], got "
                             f"{self.loss_percents!r}")
        if self.message_kb <= 0 or self.messages <= 0 or self.tx_depth <= 0:
            raise UsageError("message_kb, messages and tx_depth must be positive")
        if not 8 <= self.qp_timeout_exp <= 20:
            raise UsageError(f"qp_timeout_exp must be in [8, 20], got {self.qp_timeout_exp}")
        # at once, before any fabric is built
        require_soft_roce("the softroce experiment")

    @property
    def loss_list(self) -> list[float]:
        try:
            return sorted({float(x) for x in self.loss_percents.split(",") if x.strip()})
        except ValueError:
            raise UsageError(f"loss_percents: not numbers: {self.loss_percents!r}") from None

    @property
    def total_bytes(self) -> int:
        return self.message_kb * 1024 * self.messages

    @property
    def message_packets(self) -> int:
        return -(-self.message_kb * 1024 // MTU_BYTES)

    def lab_rc(self) -> dict:
        return {"window_packets": self.tx_depth * self.message_packets,
                "ack_every_packets": self.message_packets,
                "rto_ms": qp_timeout_ms(self.qp_timeout_exp), "dcqcn": False,
                "mtu_bytes": MTU_BYTES}


def key(loss: float) -> str:
    return f"loss_{loss:g}pct"


def wire(stats, lost: int) -> dict:
    s = stats.summary()
    s["lost_packets"] = lost
    s["retransmitted_per_lost"] = round(stats.retransmitted / lost, 2) if lost else None
    return s


def sender_port(ctx: RunContext, host: str) -> str:
    i = ctx.fabric.host(host).interface()
    return interface_name(i.switch, i.port)


def lab_rc_run(ctx: RunContext, gpus: GpuAgents, src, dst, loss: float) -> dict:
    p = ctx.params
    pcap = ctx.workdir / "captures" / f"lab-rc-{key(loss)}.pcap"
    with Capture(sender_port(ctx, src.name), pcap, "udp port 4791") as cap, \
            RandomLoss(ctx.net.host_pid(dst.name), dst.interface().name, loss) as drop:
        [flow] = gpus.transfers([(src.name, dst.name, p.total_bytes)], "rc",
                                params=p.lab_rc(), timeout_s=p.transfer_timeout_s)
        lost = drop.dropped()
    m = wire(roce_flow_stats(pcap_frames(pcap), src.ip), lost)
    m.update(intact=flow["intact"], pcap=str(pcap.relative_to(ctx.workdir)),
             capture_kernel_drops=cap.kernel_drops,
             own={"completion_s": round(flow["completion_s"], 3),
                  "goodput_mbps": round(p.total_bytes * 8 / flow["completion_s"] / 1e6, 3),
                  "retransmitted": flow["counters"]["retransmitted"],
                  "timeouts": flow["counters"]["timeouts"],
                  "receiver_naks": flow["receiver_counters"]["naks_sent"],
                  "receiver_duplicates": flow["receiver_counters"]["duplicate"]})
    return m


def rxe_run(ctx: RunContext, rxe: RxeHosts, src, dst, loss: float) -> dict:
    p = ctx.params
    s, d = rxe[src.name], rxe[dst.name]
    pcap = ctx.workdir / "captures" / f"rxe-{key(loss)}.pcap"
    before = {h.name: hw_counters(h.device) for h in (s, d)}
    # the receiver's interface is in the root namespace now: nft runs in ours
    with Capture(sender_port(ctx, src.name), pcap, "udp port 4791") as cap, \
            RandomLoss(os.getpid(), d.intf.name, loss) as drop:
        bw = ib_write_bw(server=d, client=s, size_bytes=p.message_kb * 1024,
                         iterations=p.messages, qp_timeout_exp=p.qp_timeout_exp,
                         tx_depth=p.tx_depth, timeout_s=p.transfer_timeout_s)
        lost = drop.dropped()
    m = wire(roce_flow_stats(pcap_frames(pcap), s.ip), lost)
    m.update(completed=True, pcap=str(pcap.relative_to(ctx.workdir)),
             capture_kernel_drops=cap.kernel_drops,
             own={"ib_write_bw_average_mbps": round(bw.bw_gbps * 1000, 3),
                  "sender_hw_counters": counter_delta(hw_counters(s.device), before[s.name]),
                  "receiver_hw_counters": counter_delta(hw_counters(d.device),
                                                        before[d.name])})
    return m


def side_by_side(lab: dict, rxe: dict) -> list[dict]:
    rows = []
    for k in lab:
        a, b = lab[k], rxe[k]
        ratio = (lambda x, y: round(x / y, 2) if x and y else None)
        rows.append({"loss": k,
                     "goodput_mbps": {"lab_rc": a["goodput_mbps"], "rxe": b["goodput_mbps"]},
                     "retransmitted": {"lab_rc": a["retransmitted"], "rxe": b["retransmitted"]},
                     "lost": {"lab_rc": a["lost_packets"], "rxe": b["lost_packets"]},
                     "retransmitted_per_lost": {"lab_rc": a["retransmitted_per_lost"],
                                                "rxe": b["retransmitted_per_lost"]},
                     "goodput_lab_over_rxe": ratio(a["goodput_mbps"], b["goodput_mbps"]),
                     "retx_per_lost_lab_over_rxe": ratio(a["retransmitted_per_lost"],
                                                         b["retransmitted_per_lost"])})
    return rows


def run(ctx: RunContext) -> dict:
    p = ctx.params
    src, dst = ctx.fabric.hosts[0], ctx.fabric.hosts[-1]
    out = {"src": src.name, "dst": dst.name, "transfer_bytes": p.total_bytes,
           "loss_point": f"nftables, RoCE frames arriving on {dst.interface().name}",
           "capture_point": f"{sender_port(ctx, src.name)} (the sender's leaf port)",
           "lab_rc_params": p.lab_rc(), "lab_rc": {}, "rxe": {}}
    with GpuAgents(ctx.net, [src.name, dst.name]) as gpus:
        # One unmeasured message first: the path's first packets wait for OVS to set up
        # its datapath flows (and the agents for their first run); under the lab VM's
        # software CPU that outlasted the RTO, and the 0% run counted 44 spurious resends.
        gpus.transfers([(src.name, dst.name, p.message_kb * 1024)], "rc", params=p.lab_rc(),
                       timeout_s=p.transfer_timeout_s)
        for loss in p.loss_list:
            m = out["lab_rc"][key(loss)] = lab_rc_run(ctx, gpus, src, dst, loss)
            log.info(f"lab RC, {loss:g}% loss: {m['lost_packets']} lost, "
                     f"{m['retransmitted']} retransmitted, {m['goodput_mbps']} Mb/s")
        out["cpu_bound_hosts"] = gpus.cpu_bound()
    with RxeHosts(ctx.net, [src.name, dst.name]) as rxe:
        for loss in p.loss_list:
            m = out["rxe"][key(loss)] = rxe_run(ctx, rxe, src, dst, loss)
            log.info(f"rxe,    {loss:g}% loss: {m['lost_packets']} lost, "
                     f"{m['retransmitted']} retransmitted, {m['goodput_mbps']} Mb/s")
    out["side_by_side"] = side_by_side(out["lab_rc"], out["rxe"])
    return out


def claims(params: Params, m: dict) -> list[Claim]:
    losses = [key(x) for x in params.loss_list]
    lossy = [k for x, k in zip(params.loss_list, losses) if x > 0]
    lo, hi = losses[0], losses[-1]
    out = [Claim("the lab's RC delivered every transfer intact (CRC-32 end to end)",
                 all(m["lab_rc"][k]["intact"] for k in losses),
                 {k: m["lab_rc"][k]["intact"] for k in losses}, "all True"),
           Claim("every frame both sent parsed as RoCE v2 with a correct ICRC",
                 all(m[t][k]["malformed"] == 0 for t in ("lab_rc", "rxe") for k in losses),
                 {t: sum(m[t][k]["malformed"] for k in losses) for t in ("lab_rc", "rxe")},
                 "0 malformed", "malformed")]
    whole = params.messages * params.message_packets
    out.append(Claim("the captures hold every packet of every transfer (the counts are exact)",
                     all(m[t][k]["distinct_psns"] == whole for t in ("lab_rc", "rxe")
                         for k in losses),
                     {t: [m[t][k]["distinct_psns"] for k in losses] for t in ("lab_rc", "rxe")},
                     f"{whole} PSNs each", "PSNs"))
    if lossy:
        out.append(Claim("the link lost packets at every nonzero loss rate, for both",
                         all(m[t][k]["lost_packets"] > 0 for t in ("lab_rc", "rxe") for k in lossy),
                         {t: [m[t][k]["lost_packets"] for k in lossy] for t in ("lab_rc", "rxe")},
                         "> 0 each", "packets"))
        out.append(Claim("go-back-N in both: each resends more than it lost (lossy runs)",
                         all(m[t][k]["retransmitted"] > m[t][k]["lost_packets"]
                             for t in ("lab_rc", "rxe") for k in lossy),
                         {t: [m[t][k]["retransmitted_per_lost"] for k in lossy]
                          for t in ("lab_rc", "rxe")}, "retransmitted / lost > 1"))
    if len(losses) > 1:
        out.append(Claim(f"retransmissions grow with loss, for both ({lo} -> {hi})",
                         all(m[t][hi]["retransmitted"] > m[t][lo]["retransmitted"]
                             for t in ("lab_rc", "rxe")),
                         {t: [m[t][k]["retransmitted"] for k in losses]
                          for t in ("lab_rc", "rxe")}, f"{hi} > {lo}, each", "packets"))
    return out
