"""The lab as a Python library, for your own experiments.

    from lab.api import Lab

    with Lab("leaf-spine", spines=2, leaves=2, hosts_per_leaf=2, out="results/mine") as lab:
        r = lab.allreduce([0.7, 0.9, 0.6, 0.8])          # one value per GPU host
        lab.check("every host holds 0.75", r["agree"], r["per_host"], "0.75")
        lab.congestion(ecn="auto")                        # ECN marking on every switch port
        flows = lab.incast("g0", 200_000)                 # every other host sends 200 KB to g0
        lab.record("incast", {"drops": lab.drops(), "ce_marks": lab.ce_marks()})
    # out/ now holds metrics.json, queues.csv, report.md and report.html

A Lab is one fabric (Mininet + OVS + the os-ken controller, queues on every port)
with queue telemetry running from start to end. Traffic methods start the GPU
agents, run one collective on real RoCE v2 packets and return what it measured.
`check` records a claim; the report shows the claims, what you `record`ed, and
the same plots an experiment gets. Nothing outlives the `with` block. The lab says
what it does through `logging` (logger "lab"): `lab.core.console.attach()` prints it
as the CLI does (or configure logging your way).
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from lab import results
from lab.core.errors import LabError
from lab.experiments.base import Claim
from lab.fabric import collective
from lab.fabric.congestion import CongestionParams
from lab.fabric.gpus import GpuAgents
from lab.fabric.network import FabricNetwork
from lab.fabric.telemetry import QueueTelemetry
from lab.kernel.queues import QueueParams
from lab.session import Session
from topologies.params import ParamError
from topologies.registry import build_topo

# A later set of agents starts its collective ids past the earlier ones', so a late
# packet of an earlier collective never lands on a new QP (agent.qpn_for).
COLLECTIVE_IDS_PER_CALL = 8


class Lab:
    def __init__(self, topology: str = "leaf-spine", out: str | Path | None = None,
                 queues: QueueParams | None = None, name: str = "script",
                 **topology_params):
        """topology: leaf-spine | rack | fat-tree, shaped by topology_params (e.g.
        spines=2, hosts_per_leaf=4, host_rate_mbps=100); out: where the results and the
        report go (default: a temporary directory, removed at the end)."""
        try:
            self.topo = build_topo(topology, **topology_params)
        except ParamError as e:
            raise LabError(str(e)) from None
        self.name, self.topology = name, topology
        self.queues = queues or QueueParams()
        self.out = Path(out) if out else None
        self.workdir: Path | None = self.out
        self.claims: list[Claim] = []
        self.metrics: dict[str, Any] = {}
        self.warnings: list[str] = []
        self.net: FabricNetwork | None = None
        self.telemetry: QueueTelemetry | None = None
        self._session = Session(self.topo, f"lab.api {name}", self.out, telemetry=True,
                                queue_params=self.queues)
        self._next_collective = 1
        self._t0 = 0.0
        # MRC's EV events: every EV state change of transfers() lands in ev_events as it
        # happens; an ev_controller (anything with on_event(host, event) -> [(host, EV,
        # why)], e.g. lab/fabric/evs.py's EvController) may deny EVs in the running transfer
        self.ev_events: list[dict] = []
        self.ev_controller = None

    # --- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "Lab":
        self._t0 = time.monotonic()
        self._session.__enter__()
        self.net, self.telemetry = self._session.net, self._session.telemetry
        self.workdir = self._session.workdir
        return self

    def __exit__(self, *exc) -> None:
        self.telemetry.stop()
        self.metrics["telemetry"] = results.telemetry_metrics(self.telemetry)
        self._session.__exit__(*exc)
        if self.out is not None:
            self.write_report()

    # --- the fabric ---------------------------------------------------------------------
    @property
    def fabric(self):
        """The fabric's description: hosts, switches, links, addresses (topologies/fabric.py)."""
        return self.topo.fabric

    @property
    def hosts(self) -> list[str]:
        return [h.name for h in self.fabric.hosts]

    def _agents(self, hosts: list[str] | None = None) -> GpuAgents:
        if self.net is None:
            raise LabError("the lab is not running: use it inside `with Lab(...) as lab:`")
        agents = GpuAgents(self.net, hosts, first_collective_id=self._next_collective)
        self._next_collective += COLLECTIVE_IDS_PER_CALL
        return agents

    def _note_cpu(self, busy: list[str]) -> None:
        if busy:
            self.warnings.append(f"hosts {', '.join(busy)} were CPU-bound: timings there are "
                                 f"not faithful; lower the link rates")

    # --- traffic ------------------------------------------------------------------------
    def allreduce(self, values: list[float] | list[np.ndarray], transport: str = "rc",
                  algorithm: str = "ring") -> dict:
        """All-reduce (mean) one value or tensor per GPU host, in host order; every
        result is checked against numpy. Returns time, nccl-tests figures, "agree",
        and "per_host": what each host gave and holds (for scalar values)."""
        tensors = [np.atleast_1d(np.asarray(v, np.float32)) for v in values]
        if len(tensors) > len(self.hosts):
            raise LabError(f"{len(tensors)} values but the fabric has {len(self.hosts)} "
                           f"GPU hosts")
        if self.net is None:
            raise LabError("the lab is not running: use it inside `with Lab(...) as lab:`")
        m = collective.run(self.net, tensors, transport, algorithm=algorithm,
                              first_collective_id=self._next_collective)
        self._next_collective += COLLECTIVE_IDS_PER_CALL
        self._note_cpu(m["cpu_bound_hosts"])
        return m

    def reduce_scatter(self, tensors: list[np.ndarray], transport: str = "rc") -> dict:
        """Ring reduce-scatter, one tensor per GPU host in host order: host r ends with
        chunk r of the sum (checked against numpy: "agree"); nccl-tests' busbw."""
        return self._ring("reduce_scatter", tensors, transport)

    def all_gather(self, tensors: list[np.ndarray], transport: str = "rc") -> dict:
        """Ring all-gather: host r gives chunk r of its tensor, every host ends with all."""
        return self._ring("all_gather", tensors, transport)

    def broadcast(self, tensors: list[np.ndarray], root: int = 0, transport: str = "rc") -> dict:
        """Ring broadcast (pipelined in pieces): every host ends with host `root`'s tensor."""
        return self._ring("broadcast", tensors, transport, root)

    def _ring(self, kind: str, tensors: list[np.ndarray], transport: str, root: int = 0) -> dict:
        if self.net is None:
            raise LabError("the lab is not running: use it inside `with Lab(...) as lab:`")
        tensors = [np.atleast_1d(np.asarray(t, np.float32)) for t in tensors]
        if len(tensors) > len(self.hosts):
            raise LabError(f"{len(tensors)} tensors but the fabric has {len(self.hosts)} "
                           f"GPU hosts")
        m = collective.run_ring(self.net, kind, tensors, transport, root,
                                first_collective_id=self._next_collective)
        self._next_collective += COLLECTIVE_IDS_PER_CALL
        self._note_cpu(m["cpu_bound_hosts"])
        return m

    def transfers(self, flows: list[tuple[str, str, int]], transport: str = "rc",
                  params: dict | None = None, timeout_s: float = 120.0) -> list[dict]:
        """One message per (src, dst, bytes), all at once. Per flow: completion_s,
        intact (the receiver's CRC-32 matches the sender's), counters, rate samples."""
        with self._agents() as agents:
            agents.ev_controller = self.ev_controller
            out = agents.transfers(flows, transport, params, timeout_s)
            self.ev_events += agents.ev_events
            self._note_cpu(agents.cpu_bound())
        return out

    def incast(self, root: str, nbytes: int, transport: str = "rc",
               params: dict | None = None) -> list[dict]:
        """Every other GPU host sends `nbytes` to `root` at once."""
        return self.transfers([(h, root, nbytes) for h in self.hosts if h != root],
                              transport, params)

    def alltoall(self, nbytes: int, transport: str = "rc",
                 params: dict | None = None) -> list[dict]:
        """Every GPU host sends `nbytes` to every other at once."""
        return self.transfers([(a, b, nbytes) for a in self.hosts for b in self.hosts
                               if a != b], transport, params)

    def pipeline_step(self, stages: list[str], nbytes: int, transport: str = "rc",
                      backward: bool = False, params: dict | None = None) -> dict:
        """One step of pipeline parallelism: each stage's activations (`nbytes`) to the
        next stage at once, or with `backward` each stage's gradients to the one before.
        Per flow as transfers() ("flows"), and nccl-tests' sendrecv figures."""
        pairs = list(zip(stages[1:], stages)) if backward else list(zip(stages, stages[1:]))
        flows = self.transfers([(a, b, nbytes) for a, b in pairs], transport, params)
        return {"flows": flows, **collective.p2p_figures(flows, "sendrecv")}

    def alltoallv(self, nbytes: dict[str, dict[str, int]], transport: str = "rc",
                  params: dict | None = None) -> dict:
        """All-to-all with unequal sizes (MoE token dispatch): nbytes[src][dst] from
        each host to each other at once (0 or absent: nothing); every message's CRC-32
        checked end to end ("intact", and per flow in "flows"); nccl-tests' alltoall
        figures (S: the largest rank's send buffer)."""
        flows = [(a, b, n) for a, row in nbytes.items() for b, n in row.items()
                 if a != b and n > 0]
        unknown = {h for f in flows for h in f[:2]} - set(self.hosts)
        if unknown:
            raise LabError(f"alltoallv names hosts the fabric does not have: {sorted(unknown)}")
        done = self.transfers(flows, transport, params)
        return {"flows": done, **collective.p2p_figures(done, "alltoall")}

    # --- congestion ---------------------------------------------------------------------
    def congestion(self, **settings) -> str:
        """ECN and PFC on every switch port, e.g. congestion(ecn="auto", pfc=True,
        xoff_kb=8); the fields of lab.congestion.CongestionParams. Returns the ECN
        mode in use (auto -> red where the kernel has sch_red, else controller)."""
        if self.net is None:
            raise LabError("the lab is not running: use it inside `with Lab(...) as lab:`")
        fields = {f.name for f in dataclasses.fields(CongestionParams)}
        unknown = set(settings) - fields
        if unknown:
            raise LabError(f"unknown congestion setting(s) {sorted(unknown)}; "
                           f"known: {', '.join(sorted(fields))}")
        return self.net.set_congestion(CongestionParams(**settings))

    # --- measurements -------------------------------------------------------------------
    def queue_stats(self, since: float = 0.0) -> dict[str, dict]:
        """Per "switch:port:priority" that carried traffic since `since` (time.time()):
        packets sent, drops, CE marks, backlog p50/p99/max, time paused."""
        return self.telemetry.summary(since) if self.telemetry else {}

    def drops(self, since: float = 0.0) -> int:
        """Packets the switch queues dropped (kernel counters)."""
        return sum(q["drops_packets"] for q in self.queue_stats(since).values())

    def ce_marks(self, since: float = 0.0) -> int:
        """Packets marked CE by the switch queues (kernel RED or the controller)."""
        return sum(q["ce_marked_packets"] for q in self.queue_stats(since).values())

    def pfc_counters(self) -> dict:
        """The controller's PFC and ECN counters per switch port and priority."""
        return self.net.congestion_state().get("counters", {}) if self.net else {}

    # --- claims and the report ----------------------------------------------------------
    def record(self, section: str, values: dict) -> None:
        """Keep measurements for the report (a section = a row of its table)."""
        self.metrics[section] = values

    def check(self, name: str, passed: bool, measured: Any, expected: str,
              unit: str = "") -> bool:
        """A claim checked from a measurement; shown with its verdict in the report (the
        unit, e.g. "packets", after every number measured)."""
        self.claims.append(Claim(name, bool(passed), measured, expected, unit))
        return bool(passed)

    def write_report(self) -> Path:
        """metrics.json, report.md and report.html in the lab's directory."""
        config = {"params": {}, "topology": {"kind": self.topology,
                                             **dataclasses.asdict(self.topo.params)},
                  "rate_scale": results.rate_scale(self.topo.params.rate_scale),
                  **(results.fabric_facts(self.net) if self.net else {})}
        results.write(self.workdir, self.name, config, self.metrics, self.claims,
                      self.warnings, {}, self._t0)
        return self.workdir / "report.html"
