"""A fabric over several machines: the head, and a worker on each other machine.

    on every other machine:  fabriclab cluster worker [--listen ADDR] [--port 6690]
    on the head:             fabriclab verify --machines HEAD,ADDR1,... [--set ...]
                             fabriclab allreduce --machines HEAD,ADDR1,... --values ...
                             fabriclab run incast --machines HEAD,ADDR1,... [--set ...]

The head splits the fabric (topologies/partition.py: a leaf with its GPUs stays on one
machine; only switch-to-switch links cross, each through a VXLAN tunnel of OVS's:
lab/kernel/tunnel.py), builds its own part with the one controller, listening on its
cluster address, then asks each worker to build its part (the same topology from the
same parameters, checked equal there) with its switches connecting to that
controller, and waits until the controller has programmed every machine's switches.
A verify probes every pair: each machine those whose source is its own. A collective
runs a GPU agent in every host: the head starts the other machines' agents through
their workers, which relay each agent's stdin and stdout over a TCP connection of its
own (RemoteProcess), so GpuAgents drives them as it drives the head's. ECN and PFC
are each machine's own, as a switch's are: its BPF data path on its ports (a crossing
link's departures counted at its stub) and its congestion app over its part, configured
by the head (Cluster.set_congestion) and read back (congestion_state); a PFC frame
crosses the tunnel like any frame and is honoured where it arrives. An experiment run
over the machines gets the Cluster as its network: each machine watches its own queues
and captures its own ports, and the head reads them through the workers
(ClusterTelemetry, ClusterCaptures), every time on the head's clock (the workers'
offsets measured at the start: traffic/clock.py). Each machine takes its part down
itself, also when the head's connection drops.

Head and worker speak JSON, a line per message, over TCP: on the head's connection the
head sends {"op": ...} and the worker answers each with {"ok": true, ...} or {"ok":
false, "error": "..."}; a process's connection starts with one such exchange ("attach")
and is a raw pipe after it.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from lab.core.errors import LabError
from lab.fabric import congestion, verify
from lab.fabric.capture import Captures
from lab.fabric.congestion import CongestionParams
from lab.fabric.network import FabricNetwork, MachinePart
from lab.fabric.telemetry import QueueSample, QueueTelemetry, hottest
from lab.kernel.probe import PairResult
from lab.kernel.queues import QueueParams, RedParams
from lab.session import Session
from traffic import clock
from topologies.base import FabricTopo
from topologies.fabric import interface_port
from topologies.partition import Partition, split
from topologies.registry import build_topo

log = logging.getLogger(__name__)

WORKER_PORT = 6690
CONNECT_TIMEOUT_S = 60
BUILD_TIMEOUT_S = 600        # a part of a few hundred hosts under a software CPU
VERIFY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 300
ANSWER_TIMEOUT_S = 120       # anything else: ECN/PFC set and applied, state, counters


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


def _send_line(sock: socket.socket, **msg) -> None:
    sock.sendall(json.dumps(msg).encode() + b"\n")


def _recv_line(sock: socket.socket, timeout_s: float) -> dict | None:
    """One JSON line read a byte at a time: after it the connection is a raw pipe, and
    a buffered reader could have taken the pipe's first bytes with the line."""
    sock.settimeout(timeout_s)
    line = b""
    try:
        while not line.endswith(b"\n"):
            byte = sock.recv(1)
            if not byte:
                return None
            line += byte
    except socket.timeout:
        return None
    finally:
        sock.settimeout(None)
    return json.loads(line)


class RemoteProcess:
    """A process in a host of another machine, as GpuAgents uses a Popen: its stdin and
    stdout are one TCP connection to that machine's worker, which started it there
    (recorded for cleanup there) and relays both; its stderr goes to the worker's log.
    The connection closing is the process ending, either way."""

    def __init__(self, sock: socket.socket, pid: int, machine: int):
        self.sock, self.pid, self.machine = sock, pid, machine
        self.stdin = sock.makefile("w", encoding="utf-8")
        self.stdout = sock              # read raw (os.read on its fileno) by GpuAgents
        self.stderr = io.StringIO(f"(its errors are in machine {machine}'s worker output)")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self.returncode = 0
            except BlockingIOError:
                pass
            except OSError:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Until the connection closes; what the process still wrote is read and dropped
        (else it would hide the close from poll's peek)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            try:
                if self.sock.recv(1 << 16, socket.MSG_DONTWAIT) == b"":
                    self.returncode = 0
                continue
            except BlockingIOError:
                pass
            except OSError:
                self.returncode = 0
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid} on machine {self.machine}",
                                                timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        """The worker sees the connection close and stops the process."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.returncode = -9


# --- a worker -----------------------------------------------------------------------------
def _refuse(conn: socket.socket, why: str) -> None:
    try:
        _send_line(conn, ok=False, error=why)
    except OSError:
        pass
    conn.close()


def relay(conn: socket.socket, proc: subprocess.Popen, host: str) -> None:
    """conn's bytes to proc's stdin, proc's stdout to conn, its stderr to the log; when the
    head closes, the process's stdin closes (a GPU agent exits then) and it is stopped if
    it lingers; when the process ends, the connection closes."""
    def up():
        try:
            while data := conn.recv(1 << 16):
                proc.stdin.write(data)
                proc.stdin.flush()
        except OSError:
            pass
        try:
            proc.stdin.close()
        except OSError:
            pass

    def errors():
        for line in proc.stderr:
            log.warning(f"{host}: {line.decode(errors='replace').rstrip()}")

    threads = [threading.Thread(target=up, daemon=True),
               threading.Thread(target=errors, daemon=True)]
    for t in threads:
        t.start()
    try:
        while data := os.read(proc.stdout.fileno(), 1 << 16):
            conn.sendall(data)
    except OSError:
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
    for t in threads:
        t.join(timeout=5)


class Worker:
    """Serves one head at a time: builds this machine's part when asked, probes from its
    hosts, takes the part down when asked or when the head goes away."""

    def __init__(self, listen_ip: str = "0.0.0.0", port: int = WORKER_PORT):
        self.listen_ip, self.port = listen_ip, port
        self.session: Session | None = None
        self.clock_offset_s = 0.0       # this machine's clock + it = the head's
        self.captures: Captures | None = None

    def serve(self, once: bool = False) -> None:
        with socket.socket() as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((self.listen_ip, self.port))
            server.listen(64)
            log.info(f"cluster worker listening on {self.listen_ip}:{self.port}")
            while True:
                conn, addr = server.accept()
                channel = Channel(conn, f"head {addr[0]}")
                try:
                    first = channel.receive(timeout_s=30)
                except (LabError, ValueError):
                    first = None
                if first is None or first.get("op") == "attach":
                    _refuse(conn, "no head has built a part here")
                    continue
                log.info(f"head {addr[0]} connected")
                done = threading.Event()
                acceptor = threading.Thread(target=self._attachments, args=(server, done),
                                            daemon=True)
                acceptor.start()
                try:
                    self.handle(channel, first)
                finally:
                    done.set()
                    acceptor.join()
                    self.take_down()
                    channel.close()
                    log.info(f"head {addr[0]} is gone; the part is down")
                if once:
                    return

    def _attachments(self, server: socket.socket, done: threading.Event) -> None:
        """While a head is served: its processes' connections, each relayed by a thread of
        its own; anything else is refused."""
        server.settimeout(0.5)
        try:
            while not done.is_set():
                try:
                    conn, _ = server.accept()
                except socket.timeout:
                    continue
                threading.Thread(target=self._attach, args=(conn,), daemon=True).start()
        finally:
            server.settimeout(None)

    def _attach(self, conn: socket.socket) -> None:
        """Start a process in one of this part's hosts and relay its stdin and stdout
        over `conn` until either side ends."""
        conn.settimeout(None)
        msg = _recv_line(conn, 30)
        if msg is None or msg.get("op") != "attach":
            _refuse(conn, "busy: this worker serves another head")
            return
        if self.session is None:
            _refuse(conn, "no part is up here")
            return
        try:
            # its timestamps on the head's clock (traffic/clock.py)
            env = {**os.environ, clock.OFFSET_ENV: repr(self.clock_offset_s)}
            proc = self.session.net.popen(msg["host"], [sys.executable, *msg["args"]],
                                          msg["marker"], msg["kind"], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          env=env)
        except (KeyError, OSError, LabError) as e:
            _refuse(conn, f"could not start the process in {msg.get('host')}: {e}")
            return
        _send_line(conn, ok=True, pid=proc.pid)
        relay(conn, proc, msg["host"])

    def handle(self, channel: Channel, msg: dict | None) -> None:
        while msg is not None:
            op = msg.pop("op", None)
            try:
                reply = getattr(self, f"op_{op}")(**msg) if hasattr(self, f"op_{op}") \
                    else {"ok": False, "error": f"unknown request {op!r}"}
            except LabError as e:
                reply = {"ok": False, "error": str(e)}
            channel.send(**reply)
            if op == "stop":
                return
            msg = channel.receive()

    def op_clock(self) -> dict:
        """This machine's wall clock, for the head to measure how far it is off its own."""
        return {"ok": True, "t": time.time()}

    def op_build(self, kind: str, params: dict, fabric: dict, machines: int,
                 placement: dict, machine: int, addresses: dict, controller: list,
                 network: dict, telemetry: bool, clock_offset_s: float) -> dict:
        """clock_offset_s: what to add to this machine's clock to read the head's."""
        if self.session is not None:
            raise LabError("this worker's part is already up")
        topo = build_topo(kind, **params)
        if topo.fabric.to_dict() != fabric:
            raise LabError("this machine builds a different fabric from the same parameters: "
                           "run the same fabriclab version on every machine")
        part = MachinePart(Partition(topo.fabric, machines, placement), machine,
                           {int(m): ip for m, ip in addresses.items()}, tuple(controller))
        self.clock_offset_s = clock_offset_s
        self.session = Session(topo, f"fabriclab cluster worker, machine {machine}",
                               part=part, telemetry=telemetry,
                               **{**network, "queue_params": queue_params(network["queue_params"])}
                               ).__enter__()
        log.info(f"machine {machine}'s part is up: {self.session.net.fabric.summary()}")
        return {"ok": True, "timings": self.session.net.timings}

    def op_verify(self, tries: int = 3) -> dict:
        if self.session is None:
            raise LabError("this worker has no part up")
        return {"ok": True, "results": _pair_rows(_probe_local(self.session.net, tries))}

    def op_congestion(self, params: dict) -> dict:
        """ECN and PFC on this machine's part: its congestion app, its queues."""
        return {"ok": True, "ecn": congestion.set_congestion(self._net(),
                                                             CongestionParams(**params))}

    def op_state(self) -> dict:
        """This machine's congestion app's state (counters per port and priority...)."""
        return {"ok": True, "state": congestion.read_state(self._net())}

    def op_events(self, since: float) -> dict:
        """This machine's congestion app's events since `since`, on the head's clock."""
        off = self.clock_offset_s
        return {"ok": True, "events": [{**e, "t": e["t"] + off} for e in
                                       congestion.events(self._net(), since - off)]}

    def op_queues(self, prio: int) -> dict:
        """This machine's data path counters of priority `prio`, per switch port."""
        dp = self._net().dataplane
        return {"ok": True, "queues": {} if dp is None else dp.port_counters(prio)}

    def op_honours(self, host: str, on: bool) -> dict:
        """A GPU agent's transport in `host` honours pauses itself (or no longer): as on
        one machine (lab/fabric/gpus.py), its NIC's flag in this machine's data path."""
        net = self._net()
        if net.dataplane is not None:
            net.dataplane.transport_honours_pauses(host, on)
        return {"ok": True}

    # --- this machine's queue telemetry, its times on the head's clock -----------------------
    def op_summary(self, since: float, until: float) -> dict:
        off = self.clock_offset_s
        return {"ok": True, "summary": self._telemetry().summary(since - off, until - off)}

    def op_drops(self, prio: int) -> dict:
        return {"ok": True, "drops": self._telemetry().drops(prio)}

    def op_kernel_counts(self) -> dict:
        return {"ok": True, "counts": self._rows(self._telemetry().kernel_counts())}

    def op_latest(self) -> dict:
        return {"ok": True, "latest": self._rows(self._telemetry().latest())}

    def op_telemetry_stop(self) -> dict:
        """Stops this machine's telemetry; its looks as CSV text (times as they are: the
        head shifts them) and how regular they were."""
        tel = self._telemetry()
        tel.stop()
        csv = tel.csv_path.read_text() if tel.csv_path and tel.csv_path.exists() else ""
        return {"ok": True, "csv": csv, "sampling": tel.sampling(),
                "error": str(tel.error) if tel.error else None}

    def _rows(self, samples: dict[str, QueueSample]) -> dict[str, list]:
        return {k: [q.t + self.clock_offset_s, *dataclasses.astuple(q)[1:]]
                for k, q in samples.items()}

    def _telemetry(self) -> QueueTelemetry:
        if self.session is None or self.session.telemetry is None:
            raise LabError("this worker's part has no queue telemetry (the head asked for "
                           "none when it built it)")
        return self.session.telemetry

    # --- captures on this machine's switch ports -------------------------------------------
    def op_capture_start(self, intfs: list[str], max_mb: float, snaplen: int,
                         tcpdump_filter: str | None) -> dict:
        if self.captures is not None:
            raise LabError("captures are already running here")
        self.captures = Captures(self._net().fabric, intfs, self.session.workdir / "captures",
                                 max_mb, snaplen, tcpdump_filter).__enter__()
        return {"ok": True}

    def op_capture_stop(self) -> dict:
        """Stops the captures; each pcap's bytes (base64) and what tcpdump said of it."""
        caps, self.captures = self.captures, None
        if caps is None:
            raise LabError("no captures are running here")
        caps.__exit__(None, None, None)
        out = {}
        for intf in caps.intfs:
            path = caps.path(intf)
            out[intf] = {"pcap": base64.b64encode(path.read_bytes()).decode()
                         if path.exists() else None,
                         "dropped": caps.dropped.get(intf),
                         "reached_cap": caps.reached_cap.get(intf, False)}
            path.unlink(missing_ok=True)
        return {"ok": True, "captures": out}

    def _net(self) -> FabricNetwork:
        if self.session is None:
            raise LabError("this worker has no part up")
        return self.session.net

    def op_stop(self) -> dict:
        timings = self.take_down()
        return {"ok": True, "timings": timings}

    def take_down(self) -> dict:
        if self.captures is not None:
            self.captures.__exit__(None, None, None)
            self.captures = None
        if self.session is None:
            return {}
        try:
            self.session.__exit__(None, None, None)
            return self.session.net.timings
        finally:
            self.session = None


def queue_params(d: dict) -> QueueParams:
    """QueueParams back from its JSON (dataclasses.asdict): DSCP keys are ints again."""
    return QueueParams(**{**d, "dscp_priority": {int(k): v for k, v in d["dscp_priority"].items()},
                          "red": RedParams(**d["red"]) if d.get("red") else None})


def _probe_local(net: FabricNetwork, tries: int) -> list[PairResult]:
    """The pairs whose source is on this machine, probed here, over the whole fabric."""
    pids = {h.name: net.host_pid(h.name) for h in net.fabric.hosts}
    return verify.measure(net.part.partition.fabric, pids, tries=tries, sources=set(pids)).results


# --- the head -------------------------------------------------------------------------------
CLOCK_TRIES = 8              # the worker's clock read this often; the quickest answer counts


class _ClusterDataplane:
    """GpuAgents' view of a cluster's data paths: a host's NIC flag is set on its machine."""

    def __init__(self, cluster: "Cluster"):
        self.cluster = cluster

    def transport_honours_pauses(self, host: str, on: bool) -> None:
        self.cluster.honours(host, on)


class Cluster:
    """The head's view: its own part (`head`) and a channel to each worker. It offers
    what an experiment uses of a fabric (lab/experiments/base.py), over all machines:

        with Cluster(topo, ["10.0.0.1", "10.0.0.2"]) as c:
            c.verify().lines()
        with Cluster(topo, machines, workdir, telemetry=True, queue_params=q) as c:
            c.set_congestion(...); c.telemetry.summary(t0, t1)    # lab/runner.py

    network: what each machine's FabricNetwork gets (queue_params, machine_factor,
    use_dataplane); telemetry: every machine watches its queues (ClusterTelemetry)."""

    def __init__(self, topo: FabricTopo, addresses: list[str], workdir: Path | None = None,
                 worker_port: int = WORKER_PORT, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 controller_runtime: str = "os-ken", label: str = "fabriclab cluster (head)",
                 telemetry: bool = False, **network):
        if len(addresses) < 2:
            raise LabError("a cluster needs at least two machines (--machines HEAD,OTHER,...)")
        self.topo, self.addresses, self.worker_port = topo, addresses, worker_port
        self.connect_timeout_s = connect_timeout_s
        self.controller_runtime, self.label = controller_runtime, label
        self.want_telemetry, self.network = telemetry, network
        self.partition = split(topo.fabric, len(addresses))
        self.workdir = workdir
        self.channels: dict[int, Channel] = {}
        self.lock = threading.Lock()        # one request at a time on the channels
        self.session: Session | None = None
        self.telemetry: ClusterTelemetry | None = None
        self.clock_offsets_s: dict[int, float] = {}   # worker's clock minus the head's
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
            self.clock_offsets_s[m] = self._clock_offset(self.channels[m])
            log.info(f"machine {m}'s clock is {self.clock_offsets_s[m] * 1e3:+.1f} ms off "
                     f"this one's: what it reports is shifted by that")
        addresses = dict(enumerate(self.addresses))
        self.session = Session(self.topo, self.label, self.workdir,
                               telemetry=self.want_telemetry,
                               part=MachinePart(self.partition, 0, addresses, None),
                               controller_runtime=self.controller_runtime,
                               **self.network).__enter__()
        self.timings["head_part_s"] = time.monotonic() - t0
        controller = [self.addresses[0], self.head.controller.port]
        network = {"queue_params": dataclasses.asdict(self.head.queue_params),
                   "machine_factor": self.head.machine_factor,
                   "use_dataplane": self.head.use_dataplane}
        build = {"kind": self.topo.kind, "params": self.topo.fabric.params,
                 "fabric": self.topo.fabric.to_dict(), "machines": len(self.addresses),
                 "placement": self.partition.placement, "addresses": addresses,
                 "controller": controller, "network": network,
                 "telemetry": self.want_telemetry}
        t1 = time.monotonic()
        for m, channel in self.channels.items():      # they build at once
            channel.send(op="build", machine=m, clock_offset_s=-self.clock_offsets_s[m],
                         **build)
        for channel in self.channels.values():
            self._answer(channel, "could not build its part", BUILD_TIMEOUT_S)
        self.timings["worker_parts_s"] = time.monotonic() - t1
        t1 = time.monotonic()
        fabric = self.partition.fabric
        self.head.controller.wait_programmed(timeout_s=90 + 0.2 * len(fabric.switches))
        self.head.controller.enable_rerouting()
        self.timings["programming_s"] = time.monotonic() - t1
        self.timings["ready_s"] = time.monotonic() - t0
        if self.want_telemetry:
            self.telemetry = ClusterTelemetry(self, self.session.telemetry)

    @staticmethod
    def _clock_offset(channel: Channel) -> float:
        """How far the worker's wall clock is ahead of this one's (s): its reading against
        the middle of the round trip, from the quickest of CLOCK_TRIES (a machine's clock
        is set on its own; two lab VMs booted from their RTC differ by up to a second)."""
        best = None
        for _ in range(CLOCK_TRIES):
            t0 = time.time()
            t = channel.ask(ANSWER_TIMEOUT_S, op="clock")["t"]
            t1 = time.time()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, t - (t0 + t1) / 2)
        return best[1]

    @property
    def head(self) -> FabricNetwork:
        """The head's own part (with the controller)."""
        return self.session.net

    # --- what an experiment uses of a network (GpuAgents, the runner's facts) ---------------
    @property
    def fabric(self):
        return self.partition.fabric

    @property
    def dataplane(self):
        """What GpuAgents asks of a data path: each machine has its own (its queues, the
        crossing links' departures counted at their stubs); None where the head has none
        (then neither have the others: the same kernel features are needed)."""
        return None if self.head.dataplane is None else _ClusterDataplane(self)

    queue_params = property(lambda self: self.head.queue_params)
    machine_factor = property(lambda self: self.head.machine_factor)
    datapath = property(lambda self: self.head.datapath)
    dataplane_missing = property(lambda self: self.head.dataplane_missing)
    ovs_send_buffer_bytes = property(lambda self: self.head.ovs_send_buffer_bytes)

    def ask_all(self, what: str, timeout_s: float = ANSWER_TIMEOUT_S, **msg) -> dict[int, dict]:
        """Every worker's answer to one request, sent to all at once."""
        with self.lock:
            for channel in self.channels.values():
                channel.send(**msg)
            return {m: self._answer(channel, what, timeout_s)
                    for m, channel in self.channels.items()}

    def set_congestion(self, params: CongestionParams) -> str:
        """ECN and PFC on every machine, each by its own congestion app over its part
        (a PFC frame crossing to another machine is honoured there, as it arrives);
        returns the ECN mode, the same everywhere."""
        if self.head.dataplane is None and (params.pfc or params.ecn not in ("off", "red")):
            raise LabError("ECN and PFC across machines need the BPF data path on every "
                           f"machine ({self.head.dataplane_missing}): without it the "
                           "congestion app samples the queues and marks through OpenFlow, "
                           "and the other machines' switches answer the head's controller")
        modes = {0: congestion.set_congestion(self.head, params)}
        modes.update({m: r["ecn"] for m, r in self.ask_all(
            "could not set ECN and PFC", op="congestion",
            params=dataclasses.asdict(params)).items()})
        if len(set(modes.values())) > 1:
            raise LabError(f"the machines resolved ECN mode {params.ecn!r} differently "
                           f"({modes}): give one explicitly (ecn=bpf, red or controller)")
        return modes[0]

    def congestion_state(self) -> dict:
        """The head's congestion state (its app's sampling, reaction, watchdog), with the
        counters and headroom of every machine's ports together (each port is one
        machine's), and each machine's whole state by its index."""
        states = {0: congestion.read_state(self.head)}
        states.update({m: r["state"] for m, r in self.ask_all(
            "could not read its congestion state", op="state").items()})
        merged = dict(states[0])
        for key in ("counters", "headroom"):
            merged[key] = {k: v for state in states.values()
                           for k, v in state.get(key, {}).items()}
        return {**merged, "machines": states}

    def congestion_events(self, since: float = 0.0) -> list[dict]:
        """Every machine's congestion events since `since`, on the head's clock, in order."""
        evs = congestion.events(self.head, since)
        for r in self.ask_all("could not read its congestion events", op="events",
                              since=since).values():
            evs += r["events"]
        return sorted(evs, key=lambda e: e["t"])

    def honours(self, host: str, on: bool) -> None:
        machine = self.partition.placement[host]
        if machine == 0:
            self.head.dataplane.transport_honours_pauses(host, on)
        else:
            with self.lock:
                channel = self.channels[machine]
                channel.send(op="honours", host=host, on=on)
                self._answer(channel, f"could not flag {host}'s NIC")

    @staticmethod
    def _answer(channel: Channel, what: str, timeout_s: float = ANSWER_TIMEOUT_S) -> dict:
        """The worker's answer to the request just sent; its error, said, if it failed."""
        reply = channel.receive(timeout_s)
        if reply is None or not reply.get("ok"):
            raise LabError(f"{channel.peer} {what}: "
                           f"{(reply or {}).get('error', 'the connection closed')}")
        return reply

    def start_agent(self, host: str, args: list[str], profile: str | None = None):
        """A GPU agent in `host`: forked by the head's spawner, or started by the worker
        of the machine that has the host."""
        if self.partition.placement[host] == 0:
            return self.head.start_agent(host, args, profile)
        command = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else []),
                   "-m", "traffic.agent", *args]
        return self.popen(host, command, "traffic.agent " + " ".join(args[:2]), "gpu-agent")

    def popen(self, host: str, args: list[str], marker: str, kind: str, **kw):
        """A process in `host`, on whichever machine has it: here, a Popen; on another
        machine, a RemoteProcess its worker relays (stdin and stdout as pipes; its
        times on this machine's clock: traffic/clock.py)."""
        machine = self.partition.placement[host]
        if machine == 0:
            return self.head.popen(host, args, marker, kind, **kw)
        if args[0] != sys.executable:
            raise LabError(f"only Python processes of the lab run on other machines, not {args[0]}")
        sock = socket.create_connection((self.addresses[machine], self.worker_port), timeout=10)
        _send_line(sock, op="attach", host=host, args=args[1:], marker=marker, kind=kind)
        reply = _recv_line(sock, 60)
        if reply is None or not reply.get("ok"):
            sock.close()
            raise LabError(f"machine {machine} could not start a process in {host}: "
                           f"{(reply or {}).get('error', 'no answer')}")
        return RemoteProcess(sock, reply["pid"], machine)

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

    def machine_of_port(self, intf: str) -> int:
        """The machine whose switch has this port ("fl-lf0-eth2")."""
        return self.partition.placement[interface_port(intf)[0]]

    def verify(self, tries: int = 3) -> verify.Reachability:
        """Every pair of the whole fabric, probed from its source's machine."""
        with self.lock:
            for channel in self.channels.values():
                channel.send(op="verify", tries=tries)
            results = {(r.src, r.dst, r.dst_ip): r for r in _probe_local(self.head, tries)}
            for channel in self.channels.values():
                reply = self._answer(channel, "could not probe", VERIFY_TIMEOUT_S)
                results.update({(r.src, r.dst, r.dst_ip): r
                                for r in _pair_results(reply["results"])})
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


class ClusterTelemetry:
    """Every machine's queue telemetry, read as one (QueueTelemetry's reading side):
    each port's queues are one machine's, their times on the head's clock. stop()
    gathers the other machines' looks into the head's queues.csv."""

    def __init__(self, cluster: Cluster, head: QueueTelemetry):
        self.cluster, self.head = cluster, head
        self.machines: dict[int, dict] = {}     # per worker: its sampling, once stopped
        self.error: str | Exception | None = None

    def _merged(self, mine: dict, what: str, key: str, **request) -> dict:
        """This machine's answer updated with every worker's (each port is one machine's)."""
        for r in self.cluster.ask_all(what, **request).values():
            mine.update(r[key])
        return mine

    def summary(self, since: float = 0.0, until: float = float("inf")) -> dict[str, dict]:
        return self._merged(self.head.summary(since, until), "could not summarise its queues",
                            "summary", op="summary", since=since,
                            until=min(until, 1e12))      # (JSON has no infinity)

    def drops(self, prio: int) -> dict[str, int]:
        return self._merged(self.head.drops(prio), "could not count its drops", "drops",
                            op="drops", prio=prio)

    def port_counters(self, prio: int) -> dict[str, dict]:
        return self._merged(self.head.port_counters(prio), "could not read its data path",
                            "queues", op="queues", prio=prio)

    def _samples(self, op: str, key: str, mine: dict[str, QueueSample]) -> dict[str, QueueSample]:
        rows = self._merged({}, "could not read its queues", key, op=op)
        return {**mine, **{k: QueueSample(*row) for k, row in rows.items()}}

    def kernel_counts(self) -> dict[str, QueueSample]:
        return self._samples("kernel_counts", "counts", self.head.kernel_counts())

    def latest(self) -> dict[str, QueueSample]:
        return self._samples("latest", "latest", self.head.latest())

    def hottest(self, n: int = 8) -> list[tuple[str, QueueSample]]:
        return hottest(self.latest(), n)

    def sampling(self) -> dict:
        return {**self.head.sampling(), "machines": self.machines}

    def stop(self) -> None:
        """Every machine's telemetry stopped; the workers' looks added to the head's CSV
        (their times shifted to the head's clock), all in time order."""
        self.head.stop()
        self.error = self.head.error
        if self.machines or not self.cluster.channels:
            return
        rows = []
        for m, r in self.cluster.ask_all("could not stop its telemetry",
                                         op="telemetry_stop").items():
            self.machines[m] = r["sampling"]
            self.error = self.error or (r["error"] and f"machine {m}: {r['error']}")
            off = -self.cluster.clock_offsets_s[m]
            for line in r["csv"].splitlines()[1:]:
                t, rest = line.split(",", 1)
                rows.append((float(t) + off, rest))
        path = self.head.csv_path
        if path is None or not rows:
            return
        lines = path.read_text().splitlines()
        rows += [(float(t), rest) for t, rest in (ln.split(",", 1) for ln in lines[1:])]
        rows.sort(key=lambda r: r[0])
        path.write_text("\n".join([lines[0], *(f"{t:.6f},{rest}" for t, rest in rows)]) + "\n")


class ClusterCaptures(Captures):
    """Captures on every machine: each port's tcpdump runs on the machine with its switch;
    at the end the other machines' pcaps are copied into this one's directory, so the
    summary (tshark's counts) and the files are the head's."""

    def __init__(self, cluster: Cluster, specs: list[str], outdir: Path, max_mb: float = 20.0,
                 snaplen: int = 0, tcpdump_filter: str | None = None):
        super().__init__(cluster.fabric, specs, outdir, max_mb, snaplen, tcpdump_filter)
        self.cluster, self.max_mb = cluster, max_mb
        self.elsewhere = {m: [i for i in self.intfs if cluster.machine_of_port(i) == m]
                          for m in cluster.channels}
        self.here = [i for i in self.intfs if cluster.machine_of_port(i) == 0]

    def __enter__(self) -> "ClusterCaptures":
        with self.cluster.lock:
            for m, intfs in self.elsewhere.items():
                self.cluster.channels[m].send(op="capture_start", intfs=intfs,
                                              max_mb=self.max_mb, snaplen=self.snaplen,
                                              tcpdump_filter=self.tcpdump_filter)
            for m in self.elsewhere:
                self.cluster._answer(self.cluster.channels[m], "could not start its captures")
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for r in self.cluster.ask_all("could not stop its captures", op="capture_stop").values():
            for intf, c in r["captures"].items():
                if c["pcap"] is not None:
                    self.path(intf).write_bytes(base64.b64decode(c["pcap"]))
                self.dropped[intf], self.reached_cap[intf] = c["dropped"], c["reached_cap"]
