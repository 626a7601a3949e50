"""A fabric over several machines: the head, and a worker on each other machine.

    on every other machine:  fabriclab cluster worker [--listen ADDR] [--port 6690]
    on the head:             fabriclab cluster verify --machines HEAD,ADDR1,... [--set ...]

The head splits the fabric (topologies/partition.py: a leaf with its GPUs stays on one
machine; only switch-to-switch links cross, each through a VXLAN tunnel of OVS's:
lab/kernel/tunnel.py), builds its own part with the one controller, listening on its
cluster address, then asks each worker to build its part (the same topology from the
same parameters, checked equal there) with its switches connecting to that
controller, and waits until the controller has programmed every machine's switches.
A verify probes every pair: each machine those whose source is its own. Each machine
takes its part down itself, also when the head's connection drops.

Head and worker speak JSON, a line per message, over TCP: the head sends
{"op": ...}; the worker answers each with {"ok": true, ...} or {"ok": false,
"error": "..."}.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

from lab.core.errors import LabError
from lab.fabric import verify
from lab.fabric.network import FabricNetwork, MachinePart
from lab.kernel.probe import PairResult
from lab.session import Session
from topologies.base import FabricTopo
from topologies.partition import Partition, split
from topologies.registry import build_topo

log = logging.getLogger(__name__)

WORKER_PORT = 6690
CONNECT_TIMEOUT_S = 60
BUILD_TIMEOUT_S = 600        # a part of a few hundred hosts under a software CPU
VERIFY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 300


# --- the wire -----------------------------------------------------------------------------
class Channel:
    """One TCP connection carrying a JSON object per line, both ways."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self.file = sock.makefile("rwb")

    def send(self, **msg) -> None:
        self.file.write(json.dumps(msg).encode() + b"\n")
        self.file.flush()

    def receive(self, timeout_s: float | None = None) -> dict | None:
        """The next message; None when the other side closed the connection."""
        self.sock.settimeout(timeout_s)
        try:
            line = self.file.readline()
        except socket.timeout:
            raise LabError(f"{self.peer} did not answer within {timeout_s:.0f} s") from None
        return json.loads(line) if line else None

    def ask(self, timeout_s: float, **msg) -> dict:
        self.send(**msg)
        reply = self.receive(timeout_s)
        if reply is None:
            raise LabError(f"{self.peer} closed the connection (see its worker's output)")
        if not reply.get("ok"):
            raise LabError(f"{self.peer}: {reply.get('error', 'failed')}")
        return reply

    def close(self) -> None:
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass


def _pair_results(rows: list[list]) -> list[PairResult]:
    return [PairResult(*row) for row in rows]


def _pair_rows(results: list[PairResult]) -> list[list]:
    return [[r.src, r.dst, r.dst_ip, r.rtt_ms, r.hops] for r in results]


# --- a worker -----------------------------------------------------------------------------
class Worker:
    """Serves one head at a time: builds this machine's part when asked, probes from its
    hosts, takes the part down when asked or when the head goes away."""

    def __init__(self, listen_ip: str = "0.0.0.0", port: int = WORKER_PORT):
        self.listen_ip, self.port = listen_ip, port
        self.session: Session | None = None

    def serve(self, once: bool = False) -> None:
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((self.listen_ip, self.port))
            server.listen(1)
            log.info(f"cluster worker listening on {self.listen_ip}:{self.port}")
            while True:
                conn, addr = server.accept()
                log.info(f"head {addr[0]} connected")
                channel = Channel(conn, f"head {addr[0]}")
                try:
                    self.handle(channel)
                finally:
                    self.take_down()
                    channel.close()
                    log.info(f"head {addr[0]} is gone; the part is down")
                if once:
                    return

    def handle(self, channel: Channel) -> None:
        while True:
            msg = channel.receive()
            if msg is None:
                return
            op = msg.pop("op", None)
            try:
                reply = getattr(self, f"op_{op}")(**msg) if hasattr(self, f"op_{op}") \
                    else {"ok": False, "error": f"unknown request {op!r}"}
            except LabError as e:
                reply = {"ok": False, "error": str(e)}
            channel.send(**reply)
            if op == "stop":
                return

    def op_build(self, kind: str, params: dict, fabric: dict, machines: int,
                 placement: dict, machine: int, addresses: dict, controller: list) -> dict:
        if self.session is not None:
            raise LabError("this worker's part is already up")
        topo = build_topo(kind, **params)
        if topo.fabric.to_dict() != fabric:
            raise LabError("this machine builds a different fabric from the same parameters: "
                           "run the same fabriclab version on every machine")
        part = MachinePart(Partition(topo.fabric, machines, placement), machine,
                           {int(m): ip for m, ip in addresses.items()}, tuple(controller))
        self.session = Session(topo, f"fabriclab cluster worker, machine {machine}",
                               part=part).__enter__()
        log.info(f"machine {machine}'s part is up: {self.session.net.fabric.summary()}")
        return {"ok": True, "timings": self.session.net.timings}

    def op_verify(self, tries: int = 3) -> dict:
        if self.session is None:
            raise LabError("this worker has no part up")
        return {"ok": True, "results": _pair_rows(_probe_local(self.session.net, tries))}

    def op_stop(self) -> dict:
        timings = self.take_down()
        return {"ok": True, "timings": timings}

    def take_down(self) -> dict:
        if self.session is None:
            return {}
        try:
            self.session.__exit__(None, None, None)
            return self.session.net.timings
        finally:
            self.session = None


def _probe_local(net: FabricNetwork, tries: int) -> list[PairResult]:
    """The pairs whose source is on this machine, probed here, over the whole fabric."""
    pids = {h.name: net.host_pid(h.name) for h in net.fabric.hosts}
    return verify.measure(net.part.partition.fabric, pids, tries=tries, sources=set(pids)).results


# --- the head -------------------------------------------------------------------------------
class Cluster:
    """The head's view: its own part and a channel to each worker.

        with Cluster(topo, ["10.0.0.1", "10.0.0.2"]) as c:
            c.verify().lines()
    """

    def __init__(self, topo: FabricTopo, addresses: list[str], workdir: Path | None = None,
                 worker_port: int = WORKER_PORT, connect_timeout_s: float = CONNECT_TIMEOUT_S):
        if len(addresses) < 2:
            raise LabError("a cluster needs at least two machines (--machines HEAD,OTHER,...)")
        self.topo, self.addresses, self.worker_port = topo, addresses, worker_port
        self.connect_timeout_s = connect_timeout_s
        self.partition = split(topo.fabric, len(addresses))
        self.workdir = workdir
        self.channels: dict[int, Channel] = {}
        self.session: Session | None = None
        self.timings: dict[str, float] = {}

    def __enter__(self) -> "Cluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.monotonic()
        log.info(f"{self.topo.fabric.summary()} over {len(self.addresses)} machines: "
                 f"{self.partition.summary()}")
        for m, ip in enumerate(self.addresses[1:], start=1):   # every worker there first
            self.channels[m] = Channel(self._connect(ip), f"machine {m} ({ip})")
        addresses = dict(enumerate(self.addresses))
        self.session = Session(self.topo, "fabriclab cluster (head)", self.workdir,
                               part=MachinePart(self.partition, 0, addresses, None)).__enter__()
        self.timings["head_part_s"] = time.monotonic() - t0
        controller = [self.addresses[0], self.net.controller.port]
        build = {"kind": self.topo.kind, "params": self.topo.fabric.params,
                 "fabric": self.topo.fabric.to_dict(), "machines": len(self.addresses),
                 "placement": self.partition.placement, "addresses": addresses,
                 "controller": controller}
        t1 = time.monotonic()
        for m, channel in self.channels.items():      # they build at once
            channel.send(op="build", machine=m, **build)
        for m, channel in self.channels.items():
            reply = channel.receive(BUILD_TIMEOUT_S)
            if reply is None or not reply.get("ok"):
                raise LabError(f"{channel.peer} could not build its part: "
                               f"{(reply or {}).get('error', 'the connection closed')}")
        self.timings["worker_parts_s"] = time.monotonic() - t1
        t1 = time.monotonic()
        fabric = self.partition.fabric
        self.net.controller.wait_programmed(timeout_s=90 + 0.2 * len(fabric.switches))
        self.net.controller.enable_rerouting()
        self.timings["programming_s"] = time.monotonic() - t1
        self.timings["ready_s"] = time.monotonic() - t0

    @property
    def net(self) -> FabricNetwork:
        """The head's own part (with the controller)."""
        return self.session.net

    def _connect(self, ip: str) -> socket.socket:
        """The worker at `ip`, waited for: machines started together have their workers
        listening at different times."""
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            try:
                return socket.create_connection((ip, self.worker_port), timeout=5)
            except OSError as e:
                if time.monotonic() > deadline:
                    raise LabError(f"no cluster worker at {ip}:{self.worker_port} within "
                                   f"{self.connect_timeout_s:g} s ({e}); start one there: "
                                   f"fabriclab cluster worker") from None
                time.sleep(1)

    def verify(self, tries: int = 3) -> verify.Reachability:
        """Every pair of the whole fabric, probed from its source's machine."""
        for channel in self.channels.values():
            channel.send(op="verify", tries=tries)
        results = {(r.src, r.dst, r.dst_ip): r for r in _probe_local(self.net, tries)}
        for channel in self.channels.values():
            reply = channel.receive(VERIFY_TIMEOUT_S)
            if reply is None or not reply.get("ok"):
                raise LabError(f"{channel.peer} could not probe: "
                               f"{(reply or {}).get('error', 'the connection closed')}")
            results.update({(r.src, r.dst, r.dst_ip): r for r in _pair_results(reply["results"])})
        pairs = verify.pairs_to_probe(self.partition.fabric)
        return verify.Reachability(pairs, [results.get((p.src, p.dst, p.dst_ip),
                                                       PairResult(p.src, p.dst, p.dst_ip))
                                           for p in pairs])

    def stop(self) -> None:
        t0 = time.monotonic()
        try:
            if self.session is not None and self.session.net.controller is not None:
                self.session.net.controller.stop()   # first: links going down would reroute
            for channel in self.channels.values():
                try:
                    channel.ask(STOP_TIMEOUT_S, op="stop")
                except (LabError, OSError) as e:
                    log.warning(f"{channel.peer} did not take its part down cleanly ({e})")
                channel.close()
            self.channels = {}
        finally:
            try:
                if self.session is not None:
                    self.session.__exit__(None, None, None)
                    self.session = None
            finally:
                self.timings["teardown_s"] = time.monotonic() - t0
