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
import json
import sys
import time

import numpy as np

from traffic.collectives import RingAllReduce
from traffic.mrc import EXT_BYTES, MrcParams, MrcQP
from traffic.nic import Nic, PacketWire
from traffic.qp import Region
from traffic.rc import RcParams, RcQP
from traffic.roce import Path

TRANSPORTS = {"rc": (RcQP, RcParams), "mrc": (MrcQP, MrcParams)}
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
        n = len(cmd["peers"]) + 1
        data = np.frombuffer(base64.b64decode(cmd["data"]), np.float32)
        qp_cls, params_cls = TRANSPORTS[cmd["transport"]]
        params = params_cls(**cmd.get("params", {}))
        peers = {p["rank"]: p for p in cmd["peers"]}
        self.nic.qps.clear()
        self.nic.rr.clear()
        region = Region(rkey=cid, buf=bytearray(RingAllReduce.region_bytes(len(data), n)),
                        base_va=REGION_VA)

        def qp_to(peer_rank: int, rx_region):
            p = peers[peer_rank]
            path = Path(self.mac, p["next_hop_mac"], self.ip, p["ip"])
            return self.nic.add(qp_cls(path, qpn_for(cid, peer_rank), qpn_for(cid, rank),
                                       rx_region, params))

        if cmd["collective"] != "allreduce":
            raise ValueError(f"unknown collective {cmd['collective']!r}")
        right_rank, left_rank = (rank + 1) % n, (rank - 1) % n
        right = qp_to(right_rank, region if right_rank == left_rank else None)
        left = right if right_rank == left_rank else qp_to(left_rank, region)
        algo = RingAllReduce(rank, n, data, right, left, region, REGION_VA, cid)
        op = cmd.get("op", "sum")
        if op not in ("sum", "mean"):
            raise ValueError(f"unknown reduction {op!r} (sum or mean)")
        self.pending = (cid, algo, op, cmd.get("timeout_s", 60.0))
        self.emit(event="ready", id=cid)

    def start(self, cmd: dict) -> None:
        cid, algo, op, timeout_s = self.pending
        t0 = time.monotonic()
        algo.start()

        def done() -> bool:
            for qp in self.nic.qps.values():
                while qp.events:
                    algo.on_event(qp, qp.events.pop(0))
            return algo.done()

        ok = self.nic.run_until(done, timeout_s)
        elapsed = time.monotonic() - t0
        # linger briefly so the peers' last ACKs/SACKs we owe them go out
        self.nic.run_until(lambda: False, 0.02)
        result = algo.buf / algo.n if op == "mean" else algo.buf
        self.emit(event="done" if ok else "timeout", id=cid, elapsed_s=elapsed,
                  result=base64.b64encode(result.astype(np.float32).tobytes()).decode(),
                  counters={f"{qp.kind}:{qpn:#x}": qp.counters.as_dict()
                            for qpn, qp in self.nic.qps.items()},
                  nic={"malformed": self.nic.malformed, "unknown_qp": self.nic.unknown_qp})
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
