"""The GPU agent: one per GPU host, inside its network namespace.

It owns the host's NICs (raw AF_PACKET sockets on its scale-out interface and,
on rack fabrics, its scale-up interface) and runs collectives on them when the
lab asks. Control is JSON lines: commands on stdin, events on stdout.

    {"cmd": "prepare", "id": 1, "collective": "allreduce", "algorithm": "ring",
     "op": "mean", "transport": "rc", "rank": 0, "data": <base64 float32>,
     "peers": [{"rank": 1, "ip": ..., "next_hop_mac": ..., "rack": 0}, ...]}
        -> {"event": "ready", "id": 1}
    {"cmd": "start", "id": 1}
        -> {"event": "done", "id": 1, "result": <base64>, "elapsed_s": ..., "counters": ...}
    {"cmd": "exit"}

On a multi-plane fabric the scale-out NIC has a port per plane (--plane) and each peer
lists its "planes" ([{"ip", "next_hop_mac"}] for planes 1, 2, ...): MRC QPs spray over
every plane, RC QPs keep to plane 0.
("collective": "transfers" takes "send" and "recv" lists instead of "data". "network":
"scale-up" runs a ring collective or transfers over the scale-up NIC: the peers are then
GPUs of this rack, with "up_ip" and "up_mac". The peers are the collective's group, which
may be a few of the lab's GPUs: several groups run at once, each its own collective.)
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import select
import sys
import time

import numpy as np

from traffic import clock
from traffic.collectives import (HierarchicalAllReduce, RingAllGather, RingAllReduce,
                                  RingBroadcast, RingReduceScatter, Transfers, TreeAllReduce)
from traffic.mrc import DATA_OVERHEAD_BYTES, EXT_BYTES, CreditPool, MrcParams, MrcQP
from traffic.nic import Nic, PacketWire, drive
from traffic.qp import Region
from traffic.rc import RcParams, RcQP
from traffic.rccc import Rccc, RcccParams
from traffic.roce import Path

TRANSPORTS = {"rc": (RcQP, RcParams), "mrc": (MrcQP, MrcParams)}
REGION_VA = 0x10000000


RATE_SAMPLE_S = 0.01
RING_COLLECTIVES = ("reduce_scatter", "all_gather", "broadcast")
BROADCAST_PIECES = 8        # a broadcast's buffer in this many messages: the ring pipelines
# how long an aborted collective's last frames may take to leave the NIC (one frame waits
# for room in a full FIFO; a pause could hold it longer, and then it is lost)
ABORT_FLUSH_S = 0.5
# A NIC paused as its collective ends waits this long for the resume before it reports:
# the switch resumes a port as the port's last frames leave its queue, which is as they
# reach the receiver, so that resume races the last acknowledgement (and it belongs to
# this collective's traffic: its count, its pause log).
RESUME_WAIT_S = 1.0


class Stopped(Exception):
    """The lab ended the running collective early (a "stop" command): it ends as one out
    of time does, its QPs aborted, and reports what it did."""


def qpn_for(collective_id: int, peer_rank: int) -> int:
    """QP numbers are fresh per collective, so late packets of an earlier one
    land on no QP (counted, dropped) rather than confusing a new one."""
    return ((collective_id % 0xFF) + 1) << 16 | 0x100 | peer_rank


class Agent:
    """A GPU host: its scale-out NIC and, on rack fabrics, its scale-up NIC."""

    def __init__(self, nics: dict[str, tuple[str, str, str, float]], rack: int = 0,
                 planes: list[tuple[str, str, str, float]] = ()):
        """nics: network -> (interface, MAC, IP, rate); planes: a multi-plane fabric's
        planes 1, 2, ...: more ports of the scale-out NIC, each (interface, MAC, IP, rate)."""
        self.rack = rack
        self.addr = {net: (mac, ip) for net, (_, mac, ip, _) in nics.items()}
        self.nics = {net: Nic(PacketWire(intf, ip), rate, EXT_BYTES)
                     for net, (intf, _, ip, rate) in nics.items()}
        self.nic = self.nics["scale-out"]
        self.plane_addr = [(mac, ip) for _, mac, ip, _ in planes]
        for intf, mac, ip, rate in planes:
            self.nic.add_plane(PacketWire(intf, ip), rate, mac, self.addr["scale-out"][0])
        self.pending = None
        self.inbox = b""       # what stdin brought that no one has taken yet

    def emit(self, **event) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    def prepare(self, cmd: dict) -> None:
        cid, rank = cmd["id"], cmd["rank"]
        qp_cls, params_cls = TRANSPORTS[cmd["transport"]]
        given = dict(cmd.get("params", {}))
        paced = "line_rate_mbps" in {f.name for f in dataclasses.fields(params_cls)}
        # each NIC's QPs are paced at that NIC's rate (a scale-up QP held to the
        # scale-out rate made the hierarchical all-reduce's fast phases 10x slow)
        params_of = {net: params_cls(**({"line_rate_mbps": nic.rate_bps / 1e6, **given}
                                         if paced else given))
                     for net, nic in self.nics.items()}
        params = params_of["scale-out"]
        peers = {p["rank"]: p for p in cmd["peers"]}
        # the ring collectives' NIC: scale-up only among GPUs of one rack (the lab decides)
        network = cmd.get("network", "scale-out")
        if network not in self.nics:
            raise ValueError(f"no {network} NIC on this host (rack fabrics have scale-up)")
        for nic in self.nics.values():
            nic.qps.clear()
            nic.rr.clear()
        qps = {}
        # a receiver's credit, shared by the QPs it receives on, per NIC (its link's rate)
        extra = {net: {} for net in self.nics}
        for net, nic in self.nics.items():
            if "rccc" in getattr(params, "cc", ""):
                extra[net]["rccc"] = Rccc(RcccParams(**params.rccc), nic.rate_bps / 1e6,
                                          DATA_OVERHEAD_BYTES + params.mtu_bytes)
            elif getattr(params, "credit_budget_packets", 0):
                extra[net]["credit_pool"] = CreditPool(params.credit_budget_packets,
                                                       line_rate_mbps=nic.rate_bps / 1e6)

        def qp_to(peer_rank: int, region: Region, network: str = "scale-out"):
            if (network, peer_rank) not in qps:
                p = peers[peer_rank]
                mac, ip = self.addr[network]
                path = Path(mac, p["next_hop_mac"], ip, p["ip"]) if network == "scale-out" \
                    else Path(mac, p["up_mac"], ip, p["up_ip"])
                # MRC sprays over every plane; RC keeps to plane 0's path
                planes = {"planes": tuple(Path(m, pp["next_hop_mac"], i, pp["ip"]) for (m, i), pp
                                          in zip(self.plane_addr, p.get("planes", ())))} \
                    if network == "scale-out" and qp_cls is MrcQP and self.plane_addr else {}
                qps[network, peer_rank] = self.nics[network].add(
                    qp_cls(path, qpn_for(cid, peer_rank), qpn_for(cid, rank), region,
                           params_of[network], **extra[network], **planes))
            return qps[network, peer_rank]

        if cmd["collective"] == "allreduce":
            data = np.frombuffer(base64.b64decode(cmd["data"]), np.float32).copy()
            algo = self._allreduce(cmd.get("algorithm", "ring"), cid, rank, peers, data, qp_to,
                                   network)
        elif cmd["collective"] in RING_COLLECTIVES:
            data = np.frombuffer(base64.b64decode(cmd["data"]), np.float32).copy()
            algo = self._ring(cmd["collective"], cid, rank, len(peers) + 1, data, qp_to,
                              cmd.get("root", 0), network)
        elif cmd["collective"] == "transfers":
            # recv: [{"rank", "bytes", "offset"}]: where each peer's message lands here;
            # send: [{"rank", "bytes", "offset"}]: where ours lands in the peer's region.
            size = max([r["offset"] + r["bytes"] for r in cmd["recv"]] + [1])
            region = Region(rkey=cid, buf=bytearray(size), base_va=REGION_VA)
            recvs = {r["rank"]: (qp_to(r["rank"], region, network), r["offset"], r["bytes"])
                     for r in cmd["recv"]}
            sends = {s["rank"]: (qp_to(s["rank"], region, network), s["bytes"],
                                 REGION_VA + s["offset"], cid) for s in cmd["send"]}
            algo = Transfers(rank, sends, recvs, region)
        else:
            raise ValueError(f"unknown collective {cmd['collective']!r}")
        op = cmd.get("op", "sum")
        if op not in ("sum", "mean"):
            raise ValueError(f"unknown reduction {op!r} (sum or mean)")
        self.pending = (cid, algo, op, cmd.get("timeout_s", 60.0))
        self.emit(event="ready", id=cid)

    def _allreduce(self, algorithm: str, cid: int, rank: int, peers: dict, data, qp_to,
                   network: str = "scale-out"):
        n = len(peers) + 1

        def region(nbytes: int) -> Region:
            return Region(rkey=cid, buf=bytearray(nbytes), base_va=REGION_VA)

        if algorithm == "ring":
            r = region(RingAllReduce.region_bytes(len(data), n))
            return RingAllReduce(rank, n, data, qp_to((rank + 1) % n, r, network),
                                 qp_to((rank - 1) % n, r, network), r, REGION_VA, cid)
        if algorithm == "tree":
            r = region(TreeAllReduce.region_bytes(len(data), n))
            tree = [p for p in ((rank - 1) // 2, 2 * rank + 1, 2 * rank + 2)
                    if 0 <= p < n and p != rank]
            return TreeAllReduce(rank, n, data, {p: qp_to(p, r) for p in tree}, r,
                                 REGION_VA, cid)
        if algorithm == "hier":
            if "scale-up" not in self.nics:
                raise ValueError("hierarchical all-reduce needs a scale-up NIC (rack topology)")
            racks_of = {rank: self.rack, **{p: peers[p]["rack"] for p in peers}}
            racks = sorted(set(racks_of.values()))
            members = sorted(p for p, k in racks_of.items() if k == self.rack)
            local, g = members.index(rank), len(members)
            # the GPUs of my local rank, one per rack, in rack order
            column = [sorted(p for p, k in racks_of.items() if k == rk)[local] for rk in racks]
            k, nr = racks.index(self.rack), len(racks)
            up_bytes, out_bytes = HierarchicalAllReduce.region_bytes(len(data), g, nr)
            ru, ro = region(up_bytes), region(out_bytes)
            up = (qp_to(members[(local + 1) % g], ru, "scale-up") if g > 1 else None,
                  qp_to(members[(local - 1) % g], ru, "scale-up") if g > 1 else None, ru)
            out = (qp_to(column[(k + 1) % nr], ro) if nr > 1 else None,
                   qp_to(column[(k - 1) % nr], ro) if nr > 1 else None, ro)
            return HierarchicalAllReduce(local, g, k, nr, data, up, out, REGION_VA, cid)
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")

    @staticmethod
    def _ring(kind: str, cid: int, rank: int, n: int, data, qp_to, root: int, network: str):
        """Reduce-scatter, all-gather or broadcast over the ring of ranks."""
        if kind == "broadcast":
            size = RingBroadcast.region_bytes(len(data), BROADCAST_PIECES)
        else:
            size = RingAllReduce.region_bytes(len(data), n)
        r = Region(rkey=cid, buf=bytearray(size), base_va=REGION_VA)
        right, left = qp_to((rank + 1) % n, r, network), qp_to((rank - 1) % n, r, network)
        if kind == "broadcast":
            return RingBroadcast(rank, n, root, data, right, left, r, REGION_VA, cid,
                                 BROADCAST_PIECES)
        cls = RingReduceScatter if kind == "reduce_scatter" else RingAllGather
        return cls(rank, n, data, right, left, r, REGION_VA, cid)

    def start(self, cmd: dict) -> None:
        cid, algo, op, timeout_s = self.pending
        # the pause frames of this collective: the NIC's counters run for the agent's life
        self.nic.pause_log.clear()
        pauses0, paused0_s = self.nic.pause_frames_received, list(self.nic.paused_s)
        t0, cpu0 = time.monotonic(), time.process_time()
        algo.start(t0)
        nics = list(self.nics.values())

        # per-QP packets sent, sampled for the lab's per-flow rate telemetry
        samples = {"t": [], "sent": {f"{qpn:#x}": [] for nic in nics for qpn in nic.qps},
                   "delivered": {f"{qpn:#x}": [] for nic in nics for qpn in nic.qps}}
        next_sample = 0.0

        def done() -> bool:
            nonlocal next_sample
            now = time.monotonic()
            if now >= next_sample:
                next_sample = now + RATE_SAMPLE_S
                self._during(cid, nics, now)
                samples["t"].append(round(clock.now(), 4))
                for nic in nics:
                    for qpn, qp in nic.qps.items():
                        samples["sent"][f"{qpn:#x}"].append(qp.counters.sent)
                        samples["delivered"][f"{qpn:#x}"].append(qp.counters.bytes_delivered)
            for nic in nics:
                for qp in nic.qps.values():
                    while qp.events:
                        algo.on_event(qp, qp.events.pop(0), now)
            return algo.done()

        try:
            ok, stopped = drive(nics, done, timeout_s, wake_fds=(sys.stdin.fileno(),)), False
        except Stopped:
            ok, stopped = False, True
        try:
            self._during(cid, nics, time.monotonic())     # the last EV changes, reported too
        except Stopped:           # the lab's stop, sent again as the collective ended
            pass
        elapsed = time.monotonic() - t0
        if ok:
            drive(nics, lambda: not any(n.paused_now(time.monotonic()) for n in nics),
                  RESUME_WAIT_S)
        cpu_s = time.process_time() - cpu0
        counters, evs = {}, {}
        for net, nic in self.nics.items():
            prefix = "" if net == "scale-out" else "up:"
            for qpn, qp in nic.qps.items():
                counters[f"{qp.kind}:{prefix}{qpn:#x}"] = qp.counters.as_dict()
                if hasattr(qp, "ev_report"):
                    # each EV's history counts ms from its QP's first packet: when that
                    # was, on the lab's clock (None: the QP sent nothing)
                    started = None if qp.t0 is None else \
                        round(clock.now() - (time.monotonic() - qp.t0), 4)
                    evs[f"{prefix}{qpn:#x}"] = [{**ev, "qp_started_unix": started}
                                                for ev in qp.ev_report()]
        if not ok:      # out of time or stopped: its QPs stop here, what they counted goes out
            for nic in nics:
                nic.abort()
            drive(nics, lambda: all(n.flushed() for n in nics), ABORT_FLUSH_S)
        self.emit(event="done" if ok else "stopped" if stopped else "timeout", id=cid,
                  elapsed_s=elapsed, cpu_s=cpu_s, counters=counters, evs=evs,
                  rate_samples=samples,
                  nic={"malformed": sum(n.malformed for n in nics),
                       "unknown_qp": sum(n.unknown_qp for n in nics),
                       "pause_frames_received": self.nic.pause_frames_received - pauses0,
                       "paused_s": [a - b for a, b in zip(self.nic.paused_s, paused0_s)],
                       "pause_log": self.nic.pause_log},
                  **algo.report(op))
        self.pending = None

    def _during(self, cid: int, nics: list, now: float) -> None:
        """While a collective runs, every RATE_SAMPLE_S: each MRC QP's EV state changes
        go out (an "ev" event: the lab's EV controller watches them), and what the lab
        said meanwhile is read: "deny_ev" is done at once (every QP of the collective
        stops using that EV), "stop" ends the collective (Stopped); any other command
        waits for the collective to end."""
        for nic in nics:
            for qpn, qp in nic.qps.items():
                changes = getattr(qp, "ev_events", None)     # MRC's only
                for ev, plane, state, why in changes or ():
                    self.emit(event="ev", id=cid, qp=f"{qpn:#x}", peer=qp.peer_ip, ev=ev,
                              plane=plane, state=state, why=why, t=round(clock.now(), 4))
                if changes:
                    changes.clear()
        if not select.select([sys.stdin.fileno()], [], [], 0)[0]:
            return
        chunk = os.read(sys.stdin.fileno(), 1 << 16)
        self.inbox += chunk
        lines, self.inbox = self.inbox.rsplit(b"\n", 1) if b"\n" in self.inbox \
            else (b"", self.inbox)
        kept, stop = [], False
        for line in lines.split(b"\n"):
            cmd = json.loads(line) if line.strip() else None
            if cmd and cmd.get("cmd") == "deny_ev":
                for nic in nics:
                    for qp in nic.qps.values():
                        plane = cmd.get("plane", 0)
                        if hasattr(qp, "deny_ev") and any(e.port == cmd["ev"] and e.plane == plane
                                                          for e in qp.evs):
                            try:
                                qp.deny_ev(cmd["ev"], now, cmd.get("why", "denied"), plane)
                            except ValueError as e:     # the last one not denied: kept
                                self.emit(event="warning", id=cid, warning=str(e))
            elif cmd and cmd.get("cmd") == "stop":
                stop = True
            elif line.strip():
                kept.append(line)
        self.inbox = b"".join(ln + b"\n" for ln in kept) + self.inbox
        if stop:
            raise Stopped

    def commands(self):
        """Command lines from stdin. After a collective, while no command is there,
        the NICs keep running, as a NIC does for its QPs: a peer whose last ACK was
        lost retransmits after this side is done, and must still get its answer
        (else it waits out its timeout). Between prepare and start they do not: what
        a faster peer sends waits in the socket for the collective to take it."""
        fd = sys.stdin.fileno()
        nics = list(self.nics.values())

        def command_waiting() -> bool:
            for nic in nics:            # nobody collects a finished collective's events
                for qp in nic.qps.values():
                    qp.events.clear()
            return bool(select.select([fd], [], [], 0)[0])

        while True:
            while b"\n" not in self.inbox:
                if self.pending is None:
                    drive(nics, command_waiting, float("inf"), wake_fds=(fd,))
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return
                self.inbox += chunk
            line, self.inbox = self.inbox.split(b"\n", 1)
            if line.strip():
                yield line

    def serve(self) -> None:
        self.emit(event="hello", ip=self.addr["scale-out"][1])
        for line in self.commands():
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "prepare":
                    self.prepare(cmd)
                elif cmd["cmd"] == "start":
                    self.start(cmd)
                elif cmd["cmd"] == "stop":   # for a collective that has ended already
                    continue
                elif cmd["cmd"] == "exit":
                    return
            except Exception as e:   # report, keep serving: the lab decides what to do
                self.emit(event="error", id=cmd.get("id"), error=f"{type(e).__name__}: {e}")


def parser() -> argparse.ArgumentParser:
    """An agent's command line (a cluster's worker checks a head's request with it)."""
    ap = argparse.ArgumentParser(prog="traffic.agent")
    ap.add_argument("--intf", required=True)
    ap.add_argument("--mac", required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--rate-mbps", type=float, required=True)
    ap.add_argument("--rack", type=int, default=0)
    ap.add_argument("--up", nargs=4, metavar=("INTF", "MAC", "IP", "RATE_MBPS"),
                    help="the scale-up NIC, on rack fabrics")
    ap.add_argument("--plane", nargs=4, action="append", default=[],
                    metavar=("INTF", "MAC", "IP", "RATE_MBPS"),
                    help="the scale-out NIC's port on the next plane (multi-plane fabrics)")
    return ap


def main() -> None:
    a = parser().parse_args()
    nics = {"scale-out": (a.intf, a.mac, a.ip, a.rate_mbps)}
    if a.up:
        nics["scale-up"] = (a.up[0], a.up[1], a.up[2], float(a.up[3]))
    Agent(nics, a.rack, [(i, m, ip, float(r)) for i, m, ip, r in a.plane]).serve()


if __name__ == "__main__":
    main()
