"""The GPU agent: one per GPU host, inside its network namespace.

It owns the host's NIC (an AF_PACKET socket on its interface) and runs
collectives on it when the lab asks. Control is JSON lines: commands on stdin,
events on stdout.

    {"cmd": "prepare", "id": 1, "collective": "allreduce", "op": "mean", "transport": "rc", "rank": 0,
     "peers": [{"rank": 1, "ip": ..., "next_hop_mac": ...}, ...], "data": <base64 float32>}
        -> {"event": "ready", "id": 1}
    {"cmd": "start", "id": 1}            -> {"event": "done", "id": 1, "result": <base64>,
                                             "elapsed_s": ..., "counters": {...}}
    {"cmd": "exit"}
"""
from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import sys
import time

import numpy as np

from traffic.collectives import RingAllReduce, Transfers, TreeAllReduce
from traffic.mrc import EXT_BYTES, CreditPool, MrcParams, MrcQP
from traffic.nic import Nic, PacketWire
from traffic.qp import Region
from traffic.rc import RcParams, RcQP
from traffic.roce import Path

TRANSPORTS = {"rc": (RcQP, RcParams), "mrc": (MrcQP, MrcParams)}
ALLREDUCE = {"ring": RingAllReduce, "tree": TreeAllReduce}
REGION_VA = 0x10000000


def qpn_for(collective_id: int, peer_rank: int) -> int:
    """QP numbers are fresh per collective, so late packets of an earlier one
    land on no QP (counted, dropped) rather than confusing a new one."""
    return ((collective_id % 0xFF) + 1) << 16 | 0x100 | peer_rank


class Agent:
    def __init__(self, intf: str, mac: str, ip: str, rate_mbps: float):
        self.mac, self.ip = mac, ip
        self.nic = Nic(PacketWire(intf), rate_mbps, EXT_BYTES)
        self.pending = None

    def emit(self, **event) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    def prepare(self, cmd: dict) -> None:
        cid, rank = cmd["id"], cmd["rank"]
        qp_cls, params_cls = TRANSPORTS[cmd["transport"]]
        given = dict(cmd.get("params", {}))
        if "line_rate_mbps" in {f.name for f in dataclasses.fields(params_cls)}:
            given.setdefault("line_rate_mbps", self.nic.rate_bps / 1e6)
        params = params_cls(**given)
        peers = {p["rank"]: p for p in cmd["peers"]}
        self.nic.qps.clear()
        self.nic.rr.clear()
        qps = {}
        extra = {}
        if getattr(params, "credit_budget_packets", 0):
            extra["credit_pool"] = CreditPool(params.credit_budget_packets)

        def qp_to(peer_rank: int, region: Region):
            if peer_rank not in qps:
                p = peers[peer_rank]
                path = Path(self.mac, p["next_hop_mac"], self.ip, p["ip"])
                qps[peer_rank] = self.nic.add(qp_cls(path, qpn_for(cid, peer_rank),
                                                     qpn_for(cid, rank), region, params,
                                                     **extra))
            return qps[peer_rank]

        if cmd["collective"] == "allreduce":
            n = len(peers) + 1
            data = np.frombuffer(base64.b64decode(cmd["data"]), np.float32)
            cls = ALLREDUCE[cmd.get("algorithm", "ring")]
            region = Region(rkey=cid, buf=bytearray(cls.region_bytes(len(data), n)),
                            base_va=REGION_VA)
            if cls is RingAllReduce:
                right, left = qp_to((rank + 1) % n, region), qp_to((rank - 1) % n, region)
                algo = RingAllReduce(rank, n, data, right, left, region, REGION_VA, cid)
            else:
                tree = [p for p in ((rank - 1) // 2, 2 * rank + 1, 2 * rank + 2)
                        if 0 <= p < n and p != rank]
                algo = TreeAllReduce(rank, n, data, {p: qp_to(p, region) for p in tree},
                                     region, REGION_VA, cid)
        elif cmd["collective"] == "transfers":
            # recv: [{"rank", "bytes", "offset"}]: where each peer's message lands here;
            # send: [{"rank", "bytes", "offset"}]: where ours lands in the peer's region.
            size = max([r["offset"] + r["bytes"] for r in cmd["recv"]] + [1])
            region = Region(rkey=cid, buf=bytearray(size), base_va=REGION_VA)
            recvs = {r["rank"]: (qp_to(r["rank"], region), r["offset"], r["bytes"])
                     for r in cmd["recv"]}
            sends = {s["rank"]: (qp_to(s["rank"], region), s["bytes"], REGION_VA + s["offset"],
                                 cid) for s in cmd["send"]}
            algo = Transfers(rank, sends, recvs, region)
        else:
            raise ValueError(f"unknown collective {cmd['collective']!r}")
        op = cmd.get("op", "sum")
        if op not in ("sum", "mean"):
            raise ValueError(f"unknown reduction {op!r} (sum or mean)")
        self.pending = (cid, algo, op, cmd.get("timeout_s", 60.0))
        self.emit(event="ready", id=cid)

    def start(self, cmd: dict) -> None:
        cid, algo, op, timeout_s = self.pending
        t0, cpu0 = time.monotonic(), time.process_time()
        algo.start(t0)

        def done() -> bool:
            now = time.monotonic()
            for qp in self.nic.qps.values():
                while qp.events:
                    algo.on_event(qp, qp.events.pop(0), now)
            return algo.done()

        ok = self.nic.run_until(done, timeout_s)
        elapsed, cpu_s = time.monotonic() - t0, time.process_time() - cpu0
        # linger briefly so the peers' last ACKs/SACKs we owe them go out
        self.nic.run_until(lambda: False, 0.02)
        self.emit(event="done" if ok else "timeout", id=cid, elapsed_s=elapsed, cpu_s=cpu_s,
                  counters={f"{qp.kind}:{qpn:#x}": qp.counters.as_dict()
                            for qpn, qp in self.nic.qps.items()},
                  evs={f"{qpn:#x}": qp.ev_report() for qpn, qp in self.nic.qps.items()
                       if hasattr(qp, "ev_report")},
                  nic={"malformed": self.nic.malformed, "unknown_qp": self.nic.unknown_qp,
                       "pause_frames_received": self.nic.pause_frames_received,
                       "paused_s": self.nic.paused_s},
                  **algo.report(op))
        self.pending = None

    def serve(self) -> None:
        self.emit(event="hello", ip=self.ip)
        for line in sys.stdin:
            cmd = json.loads(line)
            try:
                if cmd["cmd"] == "prepare":
                    self.prepare(cmd)
                elif cmd["cmd"] == "start":
                    self.start(cmd)
                elif cmd["cmd"] == "exit":
                    return
            except Exception as e:   # report, keep serving: the lab decides what to do
                self.emit(event="error", id=cmd.get("id"), error=f"{type(e).__name__}: {e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--intf", required=True)
    ap.add_argument("--mac", required=True)
    ap.add_argument("--ip", required=True)
    ap.add_argument("--rate-mbps", type=float, required=True)
    a = ap.parse_args()
    Agent(a.intf, a.mac, a.ip, a.rate_mbps).serve()


if __name__ == "__main__":
    main()
