"""The lab's side of the GPU agents: start one per host, drive collectives.

Each agent (traffic/agent.py) runs inside its host's namespace, started through
Mininet (mnexec), recorded by PID for cleanup, and spoken to over JSON lines.
"""
from __future__ import annotations

import base64
import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

from lab import state
from lab.errors import LabError
from lab.network import FabricNetwork
from topologies.fabric import Fabric, Host


def next_hop_mac(fabric: Fabric, src: Host, dst: Host, network: str) -> str:
    """The MAC a frame from src to dst is addressed to: the peer in the same subnet,
    else the gateway (the leaf routes it, rewriting MACs hop by hop)."""
    s, d = src.interface(network), dst.interface(network)
    subnet = fabric.subnet_of(s.ip)
    if fabric.subnet_of(d.ip) is subnet or subnet.gateway_mac is None:
        return d.mac
    return subnet.gateway_mac


@dataclass
class CollectiveResult:
    results: list[np.ndarray]
    elapsed_s: list[float]
    counters: list[dict]
    nic: list[dict]

    @property
    def time_s(self) -> float:
        return max(self.elapsed_s)


class GpuAgents:
    def __init__(self, net: FabricNetwork, hosts: list[str] | None = None,
                 network: str = "scale-out"):
        self.net, self.fabric, self.network = net, net.fabric, network
        self.hosts = [net.fabric.host(h) for h in (hosts or [h.name for h in net.fabric.hosts])]
        self.procs: dict[str, subprocess.Popen] = {}
        self.next_id = 1
        for h in self.hosts:
            intf = h.interface(network)
            args = [sys.executable, "-m", "traffic.agent", "--intf", intf.name, "--mac", intf.mac,
                    "--ip", intf.ip, "--rate-mbps", str(intf.rate_mbps)]
            proc = net.mininet[h.name].popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE, text=True, bufsize=1)
            state.record_process(proc.pid, f"--intf {intf.name}", "gpu-agent")
            self.procs[h.name] = proc
        for h in self.hosts:
            self._expect(h.name, "hello", timeout_s=30)

    def _send(self, host: str, **cmd) -> None:
        self.procs[host].stdin.write(json.dumps(cmd) + "\n")
        self.procs[host].stdin.flush()

    def _expect(self, host: str, event: str, timeout_s: float) -> dict:
        proc = self.procs[host]
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line:
            try:
                proc.wait(timeout=2)
                err = proc.stderr.read()
            except subprocess.TimeoutExpired:
                err = ""
            raise LabError(f"GPU agent on {host} did not answer ({event}): "
                           f"{err.strip().splitlines()[-1] if err.strip() else 'no output'}")
        msg = json.loads(line)
        if msg.get("event") == "error":
            raise LabError(f"GPU agent on {host}: {msg['error']}")
        if msg.get("event") != event:
            raise LabError(f"GPU agent on {host}: expected {event}, got {msg.get('event')}")
        return msg

    def allreduce(self, data: list[np.ndarray], transport: str = "rc", op: str = "sum",
                  params: dict | None = None, timeout_s: float = 120.0) -> CollectiveResult:
        if len(data) != len(self.hosts):
            raise LabError(f"{len(data)} tensors for {len(self.hosts)} GPU hosts")
        cid = self.next_id
        self.next_id += 1
        for rank, h in enumerate(self.hosts):
            peers = [{"rank": r, "ip": p.interface(self.network).ip,
                      "next_hop_mac": next_hop_mac(self.fabric, h, p, self.network)}
                     for r, p in enumerate(self.hosts) if p is not h]
            self._send(h.name, cmd="prepare", id=cid, collective="allreduce", op=op,
                       transport=transport, rank=rank, peers=peers, params=params or {},
                       timeout_s=timeout_s,
                       data=base64.b64encode(data[rank].astype(np.float32).tobytes()).decode())
        for h in self.hosts:
            self._expect(h.name, "ready", timeout_s=30)
        for h in self.hosts:
            self._send(h.name, cmd="start", id=cid)
        done = [self._expect(h.name, "done", timeout_s + 10) for h in self.hosts]
        return CollectiveResult(
            results=[np.frombuffer(base64.b64decode(d["result"]), np.float32) for d in done],
            elapsed_s=[d["elapsed_s"] for d in done],
            counters=[d["counters"] for d in done], nic=[d["nic"] for d in done])

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    self._send(name, cmd="exit")
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "GpuAgents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
