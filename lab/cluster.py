"""A fabric over several machines: the head, and a worker on each other machine.

    on the head:  fabriclab verify --machines HEAD,[USER@]ADDR1,... [--set ...]
                  fabriclab allreduce --machines HEAD,[USER@]ADDR1,... --values ...
                  fabriclab run incast --machines HEAD,[USER@]ADDR1,... [--set ...]

The head starts a worker on every other machine over ssh (lab/ssh.py: the user's keys
and known_hosts; the worker speaks on its stdin and stdout, and nothing listens). It
splits the fabric (topologies/partition.py: a leaf with its GPUs stays on one machine;
only switch-to-switch links cross, each through a VXLAN tunnel of OVS's:
lab/kernel/tunnel.py), builds its own part with the one controller, listening on its
loopback, then asks each worker to build its part (the same topology from the same
parameters, checked equal there) with its switches connecting to that controller
through the worker's ssh connection (a port forwarded to the head's loopback), and waits
until the controller has programmed every machine's switches.
A verify probes every pair: each machine those whose source is its own. A collective
runs a GPU agent in every host: the head has the other machines' agents started by
their workers, each agent's stdin and stdout a stream of the worker's channel
(RemoteProcess), so GpuAgents drives them as it drives the head's. A worker starts
nothing else for the head: the lab's agent module, its arguments checked as the agent
parses them (agent_args), in a host of its part. ECN and PFC
are each machine's own, as a switch's are: its BPF data path on its ports (a crossing
link's departures counted at its stub) and its congestion app over its part, configured
by the head (Cluster.set_congestion) and read back (congestion_state); a PFC frame
crosses the tunnel like any frame and is honoured where it arrives. An experiment run
over the machines gets the Cluster as its network: each machine watches its own queues
and captures its own ports, and the head reads them through the workers
(ClusterTelemetry, ClusterCaptures), every time on the head's clock (the workers'
offsets measured at the start: traffic/clock.py). Each machine takes its part down
itself, also when the head's connection drops.

On a worker's channel the head sends {"op": ...} and the worker answers each with
{"ok": true, ...} or {"ok": false, "error": "..."}, one at a time.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import inspect
import io
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from lab import ssh
from lab.core.errors import LabError
from lab.fabric import congestion, verify
from lab.fabric.capture import Captures
from lab.fabric.congestion import CongestionParams
from lab.fabric.controller import free_port
from lab.fabric.network import FabricNetwork, MachinePart
from lab.fabric.telemetry import QueueSample, QueueTelemetry, hottest
from lab.kernel.probe import PairResult
from lab.kernel.queues import QueueParams, RedParams
from lab.session import Session
from lab.ssh import RemoteProcess
from traffic import agent, clock
from topologies.base import FabricTopo
from topologies.fabric import interface_port
from topologies.partition import Partition, split
from topologies.registry import build_topo

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 600        # a part of a few hundred hosts under a software CPU
VERIFY_TIMEOUT_S = 600
STOP_TIMEOUT_S = 300
ANSWER_TIMEOUT_S = 120       # anything else: ECN/PFC set and applied, state, counters


# --- the wire (lab/ssh.py carries it) ----------------------------------------------------
def _pair_results(rows: list[list]) -> list[PairResult]:
    return [PairResult(*row) for row in rows]


def _pair_rows(results: list[PairResult]) -> list[list]:
    return [[r.src, r.dst, r.dst_ip, r.rtt_ms, r.hops] for r in results]


# --- a worker -----------------------------------------------------------------------------
AGENT_MODULE = "traffic.agent"
AGENT_STOP_S = 5             # an agent whose stdin closed has this long to exit


def agent_args(args) -> list[str]:
    """The arguments of a GPU agent the head asks for, checked as the agent itself would
    parse them: the only process a worker starts for a head is the lab's agent module,
    never an argument vector as it came."""
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise LabError("a GPU agent's arguments are a list of strings")
    try:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            agent.parser().parse_args(args)
    except SystemExit:
        why = (said.getvalue().strip().splitlines() or ["refused"])[-1]
        raise LabError(f"not a GPU agent's arguments ({why})") from None
    return args


class Worker:
    """Serves the head that started it over ssh, on its stdin and stdout (lab/ssh.py):
    builds this machine's part when asked, probes from its hosts, starts GPU agents in
    them, and takes the part down when asked or when the head goes away (its stdin
    ends). It listens on nothing."""

    def __init__(self):
        self.session: Session | None = None
        self.clock_offset_s = 0.0       # this machine's clock + it = the head's
        self.captures: Captures | None = None
        self.channel: ssh.Channel | None = None

    def serve(self, channel: ssh.Channel) -> None:
        self.channel = channel
        channel.send(ok=True, worker=True, pid=os.getpid())
        try:
            self.handle(channel.receive())
        finally:
            self.take_down()
            log.info("the head is done or gone; the part is down")

    def handle(self, msg: dict | None) -> None:
        while msg is not None:
            op = msg.pop("op", None)
            handler = getattr(self, f"op_{op}", None)
            try:
                if handler is None:
                    raise LabError(f"unknown request {op!r}")
                try:            # the request's fields checked before anything runs
                    inspect.signature(handler).bind(**msg)
                except TypeError as e:
                    raise LabError(f"request {op!r}: {e}") from None
                reply = handler(**msg)
            except LabError as e:
                reply = {"ok": False, "error": str(e)}
            self.channel.send(**reply)
            if op == "stop":
                return
            msg = self.channel.receive()

    def op_attach(self, host: str, args: list, stream: int) -> dict:
        """A GPU agent in one of this part's hosts, its stdin and stdout the channel's
        stream `stream`; checked first: a host of this part, an agent's arguments."""
        args = agent_args(args)
        net = self._net()
        if host not in {h.name for h in net.fabric.hosts}:
            raise LabError(f"{host} is not a host of this machine's part")
        # its timestamps on the head's clock (traffic/clock.py)
        env = {**os.environ, clock.OFFSET_ENV: repr(self.clock_offset_s)}
        try:
            proc = net.popen(host, [sys.executable, "-m", AGENT_MODULE, *args],
                             f"{AGENT_MODULE} {' '.join(args[:2])}", "gpu-agent",
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env=env)
        except OSError as e:
            raise LabError(f"could not start a GPU agent in {host}: {e}") from None
        self._relay(stream, proc, host)
        return {"ok": True, "pid": proc.pid}

    def _relay(self, sid: int, proc: subprocess.Popen, host: str) -> None:
        """What the head sends on the stream goes to the agent's stdin; when the head
        ends the stream its stdin closes (an agent exits then) and it is stopped if it
        lingers. Its stdout goes back on the stream, ended when the agent ends; its
        stderr to this worker's log."""
        def write(data: bytes) -> None:
            proc.stdin.write(data)
            proc.stdin.flush()

        def close() -> None:
            proc.stdin.close()
            try:
                proc.wait(timeout=AGENT_STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()

        def errors() -> None:
            for line in proc.stderr:
                log.warning(f"{host}: {line.decode(errors='replace').rstrip()}")
        self.channel.sink(sid, write, close)
        self.channel.pump(sid, lambda: os.read(proc.stdout.fileno(), 1 << 16), proc.wait)
        threading.Thread(target=errors, daemon=True).start()

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

    def op_verify(self, tries: int = 3, per_host: int | None = None) -> dict:
        return {"ok": True, "results": _pair_rows(_probe_local(self._net(), tries, per_host))}

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


def _probe_local(net: FabricNetwork, tries: int, per_host: int | None) -> list[PairResult]:
    """The pairs whose source is on this machine, probed here, over the whole fabric."""
    pids = {h.name: net.host_pid(h.name) for h in net.fabric.hosts}
    return verify.measure(net.part.partition.fabric, pids, tries=tries, per_host=per_host,
                          sources=set(pids)).results


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

    def __init__(self, topo: FabricTopo, machines: list[str], workdir: Path | None = None,
                 reach: ssh.Reach = ssh.Reach(), controller_runtime: str = "os-ken",
                 label: str = "fabriclab cluster (head)", telemetry: bool = False, **network):
        """machines: this machine's address, then each other's ssh target,
        `[user@]address` (lab/ssh.py: each address is also where its tunnels go)."""
        if len(machines) < 2:
            raise LabError("a cluster needs at least two machines (--machines HEAD,OTHER,...)")
        self.topo, self.machines, self.reach = topo, machines, reach
        self.addresses = [ssh.address(m) for m in machines]
        self.controller_runtime, self.label = controller_runtime, label
        self.want_telemetry, self.network = telemetry, network
        self.partition = split(topo.fabric, len(machines))
        self.workdir = workdir
        self.connections: dict[int, ssh.WorkerConnection] = {}
        self.channels: dict[int, ssh.Channel] = {}
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
        # The head's controller listens on its loopback; each worker's ssh connection
        # carries its switches' connections to it (ssh -R, the same port there).
        controller_port = free_port()
        for m, target in enumerate(self.machines[1:], start=1):   # every worker first
            self.connections[m] = ssh.WorkerConnection(m, target, self.reach, controller_port)
            self.channels[m] = self.connections[m].channel
            self.clock_offsets_s[m] = self._clock_offset(self.channels[m])
            log.info(f"machine {m}'s clock is {self.clock_offsets_s[m] * 1e3:+.1f} ms off "
                     f"this one's: what it reports is shifted by that")
        addresses = dict(enumerate(self.addresses))
        self.session = Session(self.topo, self.label, self.workdir,
                               telemetry=self.want_telemetry,
                               part=MachinePart(self.partition, 0, addresses, None,
                                                controller_port),
                               controller_runtime=self.controller_runtime,
                               **self.network).__enter__()
        self.timings["head_part_s"] = time.monotonic() - t0
        controller = ["127.0.0.1", controller_port]
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
    def _clock_offset(channel: ssh.Channel) -> float:
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
    def _answer(channel: ssh.Channel, what: str, timeout_s: float = ANSWER_TIMEOUT_S) -> dict:
        """The worker's answer to the request just sent; its error, said, if it failed."""
        reply = channel.receive(timeout_s)
        if reply is None or not reply.get("ok"):
            raise LabError(f"{channel.peer} {what}: "
                           f"{(reply or {}).get('error', 'the connection closed')}")
        return reply

    def start_agent(self, host: str, args: list[str], profile: str | None = None):
        """A GPU agent in `host`: forked by the head's spawner, or started by the worker
        of the machine that has the host (a RemoteProcess: its stdin and stdout a stream
        of that worker's channel; its times on this machine's clock: traffic/clock.py)."""
        machine = self.partition.placement[host]
        if machine == 0:
            return self.head.start_agent(host, args, profile)
        if profile:
            log.warning(f"{host} is on machine {machine}: only this machine's agents are "
                        f"profiled")
        connection = self.connections[machine]
        with self.lock:
            sid, sock = connection.open_stream()
            try:
                reply = connection.channel.ask(ANSWER_TIMEOUT_S, op="attach", host=host,
                                               args=args, stream=sid)
            except LabError as e:
                sock.close()
                raise LabError(f"machine {machine} could not start {host}'s GPU agent: {e}"
                               ) from None
        return RemoteProcess(sock, reply["pid"], machine)

    def popen(self, host: str, args: list[str], marker: str, kind: str, **kw):
        """A process in `host`, which must be on this machine: on the others a worker
        starts GPU agents only (start_agent)."""
        machine = self.partition.placement[host]
        if machine != 0:
            raise LabError(f"{host} is on machine {machine}, where only GPU agents run "
                           f"(not {' '.join(args[:3])})")
        return self.head.popen(host, args, marker, kind, **kw)

    def machine_of_port(self, intf: str) -> int:
        """The machine whose switch has this port ("fl-lf0-eth2")."""
        return self.partition.placement[interface_port(intf)[0]]

    def verify(self, tries: int = 3, per_host: int | None = None) -> verify.Reachability:
        """Every pair of the whole fabric (or `per_host` random destinations of each
        host, the same sample on every machine), probed from its source's machine."""
        with self.lock:
            for channel in self.channels.values():
                channel.send(op="verify", tries=tries, per_host=per_host)
            results = {(r.src, r.dst, r.dst_ip): r
                       for r in _probe_local(self.head, tries, per_host)}
            for channel in self.channels.values():
                reply = self._answer(channel, "could not probe", VERIFY_TIMEOUT_S)
                results.update({(r.src, r.dst, r.dst_ip): r
                                for r in _pair_results(reply["results"])})
        pairs = verify.planned(self.partition.fabric, per_host)
        return verify.Reachability(pairs, [results.get((p.src, p.dst, p.dst_ip),
                                                       PairResult(p.src, p.dst, p.dst_ip))
                                           for p in pairs])

    def stop(self) -> None:
        t0 = time.monotonic()
        try:
            if self.session is not None and self.session.net.controller is not None:
                self.session.net.controller.stop()   # first: links going down would reroute
            for m, connection in self.connections.items():
                try:
                    connection.channel.ask(STOP_TIMEOUT_S, op="stop")
                except (LabError, OSError) as e:
                    log.warning(f"{connection.peer} did not take its part down cleanly ({e})")
                connection.close(STOP_TIMEOUT_S)
            self.connections, self.channels = {}, {}
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
