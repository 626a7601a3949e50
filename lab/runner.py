"""The experiment runner: parameters in, a results directory out.

An experiment is a module in lab/experiments/ (the contract: lab/experiments/base.py).
The runner splits `--set key=value` between the experiment's and the
topology's parameters, builds the fabric, runs, and writes
    config.json   parameters, topology, rate scale, machine
    fabric.json   the fabric description
    metrics.json  parameters, measurements, claims (lab/results.py: the schema the
                  Python API writes too)
    queues.csv    every switch queue, sampled every few ms (lab/fabric/telemetry.py)
    report.md, report.html   parameters, claims, tables, plots (plots/)
    logs/         controller log
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pkgutil
import platform
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from lab import experiments as experiments_pkg
from lab import results
from lab.cluster import Cluster, ClusterCaptures
from lab.core.errors import LabError, UsageError
from lab.experiments import base as experiment
from lab.experiments.base import RunContext
from lab.fabric import calibrate
from lab.fabric.capture import FILTERS, CapturePlan, Captures
from lab.fabric.capture import resolve as capture_resolve
from lab.fabric.telemetry import QueueTelemetry, render
from lab.kernel.queues import QueueParams
from lab.session import Session
from lab.ssh import Reach
from traffic.samples import WIRESHARK_LUA
from topologies.params import ParamError, key_value, parse_value
from topologies.partition import split
from topologies.registry import TOPOLOGIES, make_params

log = logging.getLogger(__name__)
RESULTS_DIR = Path("results")
LIVE_EVERY_S = 1.0
NOT_EXPERIMENTS = ("base", "common", "waits")   # lab/experiments/ modules that are not one
# what is worth seeing in a capture: CNPs, CE-marked packets, pause frames
CAPTURE_FILTER = "infiniband.bth.opcode == 129 || ip.dsfield.ecn == 3 || macc"


class LiveView:
    """Prints the hottest queues every LIVE_EVERY_S while an experiment runs."""

    def __init__(self, telemetry: QueueTelemetry, enabled: bool):
        self.telemetry, self.enabled = telemetry, enabled
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self) -> "LiveView":
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.enabled:
            self.thread.join(timeout=2)

    def loop(self) -> None:
        previous = {}
        t0 = time.monotonic()
        while not self.stop.wait(LIVE_EVERY_S):
            hot = self.telemetry.hottest(4)
            log.info(f"[live {time.monotonic() - t0:5.1f} s]\n" + render(hot, previous))
            previous = self.telemetry.latest()


def available() -> dict[str, Any]:
    """experiment name -> module."""
    mods = {}
    for info in pkgutil.iter_modules(experiments_pkg.__path__):
        if info.name in NOT_EXPERIMENTS:
            continue
        mod = experiment.check(importlib.import_module(f"lab.experiments.{info.name}"))
        mods[mod.NAME] = mod
    return mods


def load(name: str):
    mods = available()
    if name not in mods:
        raise UsageError(f"unknown experiment {name!r}; choose one of {', '.join(sorted(mods))} "
                         f"(see 'fabriclab list')")
    return mods[name]


def _convert(value: str, ftype, key: str):
    try:
        return parse_value(key, value, ftype)
    except ParamError as e:
        raise UsageError(f"--set {e}") from None


QUEUE_SETTINGS = ("buffer_kb", "control_buffer_kb", "host_buffer_kb", "express_class")
QUEUE_FLAGS = ("express_class",)        # 0 or 1; the others are sizes


def split_settings(mod, settings: list[str], machine_factor: float = 1.0):
    """--set key=value strings -> (experiment params, topology params, queue params).
    machine_factor < 1 (lab/fabric/calibrate.py): the defaults' link rates and message sizes
    are scaled down by it (rate_scale up), what the user sets is kept."""
    exp_fields = {f.name: f for f in dataclasses.fields(mod.Params)}
    exp_values, topo_values, queue_values = {}, {}, {}
    for item in settings:
        try:
            key, value = key_value(item)
        except ParamError as e:
            raise UsageError(str(e)) from None
        if key in exp_fields:
            exp_values[key] = _convert(value, exp_fields[key].type, key)
        elif key in QUEUE_SETTINGS:
            queue_values[key] = _convert(value, int, key)
            if key in QUEUE_FLAGS and queue_values[key] not in (0, 1):
                raise UsageError(f"--set {key} takes 0 or 1")
            if key not in QUEUE_FLAGS and queue_values[key] <= 0:
                raise UsageError(f"--set {key} must be positive")
        else:
            topo_values[key] = value
    if machine_factor < 1:
        exp_values = {**scaled_sizes(mod, exp_values, machine_factor),
                      **scaled_times(mod, exp_values, machine_factor), **exp_values}
    params = mod.Params(**exp_values)
    if hasattr(params, "validate"):
        params.validate()
    if params.topology not in TOPOLOGIES:
        raise UsageError(f"unknown topology {params.topology!r}; choose one of "
                         f"{', '.join(TOPOLOGIES)}")
    topo_fields = {f.name for f in dataclasses.fields(TOPOLOGIES[params.topology].Params)}
    for key in topo_values:
        if key not in topo_fields:
            raise UsageError(f"unknown --set key {key!r}: experiment {mod.NAME} takes "
                             f"{', '.join(exp_fields)}; topology {params.topology} takes "
                             f"{', '.join(sorted(topo_fields))}; the queues take "
                             f"{', '.join(QUEUE_SETTINGS)}")
    # an experiment may suggest a fabric shape; what the user sets wins
    suggested = experiment.topology_defaults(mod, params.topology)
    if machine_factor < 1:
        topo_values = {**scaled_rates(params.topology, suggested, machine_factor), **topo_values}
    topo_values = {**suggested, **topo_values}
    try:
        topo_params = make_params(params.topology, **topo_values)
    except ParamError as e:
        raise UsageError(str(e)) from None
    # an experiment may ask for queues of its own (an express class); what the user sets wins
    queue_values = {**experiment.queue_defaults(mod), **queue_values}
    return params, topo_params, QueueParams(**queue_values)


def scaled_sizes(mod, given: dict, factor: float) -> dict:
    """The experiment's default message sizes, scaled for a slower machine."""
    defaults = {f.name: f.default for f in dataclasses.fields(mod.Params)}
    k = calibrate.size_factor(factor)
    return {name: type(defaults[name])(defaults[name] * k) or 1
            for name in experiment.scaled_sizes(mod) if name not in given}


def scaled_times(mod, given: dict, factor: float) -> dict:
    """The experiment's default times (a failure's start, a flap's period), stretched as
    its traffic is on a slower machine: the failure meets the traffic as at the
    defaults (a flap of 400 ms over an all-reduce 3.1x longer at x0.08 flapped ~3x as
    often per transfer, and RC's all-reduce outlasted its limit)."""
    defaults = {f.name: f.default for f in dataclasses.fields(mod.Params)}
    k = calibrate.time_stretch(factor)
    return {name: type(defaults[name])(defaults[name] * k)
            for name in experiment.scaled_times(mod) if name not in given}


def scaled_rates(topology: str, suggested: dict, factor: float) -> dict:
    """The suggested (else the topology's default) link rates times `factor`, and the
    rate scale divided by it: a link still stands for the same real rate."""
    defaults = {f.name: f.default for f in dataclasses.fields(TOPOLOGIES[topology].Params)}
    out = {name: float(suggested.get(name, default)) * factor
           for name, default in defaults.items() if name.endswith("_rate_mbps")}
    out["rate_scale"] = int(round(float(suggested.get("rate_scale",
                                                      defaults["rate_scale"])) / factor))
    return out


def run(name: str, settings: list[str], out: Path | None = None,
        capture: list[str] | None = None,
        live: bool = False, controller_runtime: str = "os-ken",
        capture_mb: float = 20.0, capture_snaplen: int = 0,
        use_dataplane: bool = True, machines: list[str] | None = None,
        reach: Reach = Reach()) -> tuple[Path, dict]:
    """capture: switch ports to record (lab/fabric/capture.py), each up to capture_mb, or
    ["auto"]: the ports the experiment finds worth it (its capture_plan), capture_mb in
    all; live: print the hottest queues every second while the experiment runs;
    use_dataplane False: ECN and PFC by the controller's sampling, as where BPF cannot run;
    machines: the fabric over these machines (this one first, then each other's ssh
    target, where the head starts a worker: lab/cluster.py), every result gathered here;
    reach: how ssh reaches them (lab/ssh.py)."""
    t0 = time.monotonic()
    mod = load(name)
    if machines and not experiment.across_machines(mod):
        able = sorted(n for n, m in available().items() if experiment.across_machines(m))
        raise UsageError(f"{name} does not run across machines yet; these do: "
                         f"{', '.join(able)}")
    calibration = calibrate.load()      # None: uncalibrated, the defaults as they are
    busy = experiment.busy_ends(mod)
    factor = calibration.factor_for(busy) if calibration else 1.0
    params, topo_params, queue_params = split_settings(mod, settings, factor)
    if factor < 1:
        log.info(f"this machine's GPU hosts keep up with {calibration.keep_up_mbps:g} "
                 f"Mb/s, {calibration.busy_keep_up_mbps:g} with "
                 f"{2 * calibrate.BUSY_PAIRS} busy (fabriclab calibrate); {name} keeps "
                 f"{busy} flow ends busy: default link rates x{factor:.2f}, message sizes "
                 f"x{calibrate.size_factor(factor):.2f}, times of its events "
                 f"x{calibrate.time_stretch(factor):.2f}, rate scale / {factor:.2f}, "
                 f"queue sampling / {factor:.2f}")
    topo = TOPOLOGIES[params.topology](topo_params)
    if machines:
        try:
            split(topo.fabric, len(machines))
        except ParamError as e:
            raise UsageError(f"{e}: give the fabric more leaves (e.g. --set leaves=4)") from None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    workdir = Path(out) if out else RESULTS_DIR / f"{name}-{stamp}"
    workdir.mkdir(parents=True, exist_ok=True)
    config = {
        "experiment": name,
        "params": dataclasses.asdict(params),
        "topology": {"kind": params.topology, **dataclasses.asdict(topo_params)},
        "rate_scale": results.rate_scale(topo_params.rate_scale),
        "fabric": topo.fabric.summary(),
        "queues": dataclasses.asdict(queue_params),
        "controller_runtime": controller_runtime,
        "machine_factor": factor,
        "machine": {"host": platform.node(), "kernel": platform.release(),
                    "cpus": os.cpu_count()},
        "started": stamp,
    }
    results.write_json_atomic(workdir / results.CONFIG_FILE, config)
    network = {"telemetry": True, "queue_params": queue_params, "machine_factor": factor,
               "controller_runtime": controller_runtime, "use_dataplane": use_dataplane}
    label = f"fabriclab run {name}"
    with (Cluster(topo, machines, workdir, reach, label=label,
                  **network) if machines
          else Session(topo, label, workdir, **network)) as session:
        # an experiment drives a FabricNetwork, or a Cluster of them (the same interface)
        net = session if machines else session.net
        telemetry = session.telemetry
        config.update(results.fabric_facts(net))
        if machines:
            config["machines"] = {"addresses": session.addresses,
                                  "placement": session.partition.placement,
                                  "clock_offsets_ms": {m: round(o * 1e3, 3) for m, o in
                                                       session.clock_offsets_s.items()}}
        results.write_json_atomic(workdir / results.CONFIG_FILE, config)
        log.info(f"fabric ready in {net.timings['ready_s']:.1f} s; running {name}")
        plan = CapturePlan(capture or [])
        if plan.ports == ["auto"]:
            plan = experiment.capture_plan(mod, net.fabric, params)
            capture_mb /= max(1, len({i for spec in plan.ports
                                      for i in capture_resolve(net.fabric, spec)}))
        captures = (partial(ClusterCaptures, net) if machines else partial(Captures, net.fabric))(
            plan.ports, workdir / "captures", capture_mb, capture_snaplen, plan.tcpdump_filter)
        with captures, LiveView(telemetry, enabled=live):
            metrics = mod.run(RunContext(net, params, workdir, telemetry))
        telemetry.stop()
        if plan.ports:
            metrics["captures"] = {
                "ports": captures.summary(),
                "keeps": plan.keeps, "snaplen": capture_snaplen or None,
                "filters": FILTERS,
                "open_with": f"wireshark -X lua_script:{WIRESHARK_LUA} FILE.pcap",
                "display_filter": CAPTURE_FILTER}
        metrics["telemetry"] = results.telemetry_metrics(telemetry)
        if telemetry.error:
            log.warning(f"queue telemetry stopped: {telemetry.error}")
    timings = dict(net.timings)
    claims = experiment.name_starved(mod.claims(params, metrics), metrics)
    warnings = []
    if metrics.get("cpu_bound_hosts"):
        remedy = ("run `fabriclab calibrate` once so the defaults fit this machine"
                  if calibration is None else
                  f"this machine is calibrated for the {busy} flow ends {name} keeps busy "
                  f"at its defaults, but this run needs lower rates still")
        warnings.append(f"hosts {', '.join(metrics['cpu_bound_hosts'])} were CPU-bound: their "
                        f"NICs could not keep up, so timings there are not faithful; lower "
                        f"the link rates (--set host_rate_mbps=...); {remedy}")
        log.warning(warnings[-1])
    for e in metrics.get("starved", []):    # a mechanism the machine's load defeated
        warnings.append(f"{e['variant']}: {e['why']}")
        log.warning(warnings[-1])
    result = results.write(workdir, name, config, metrics, claims, warnings, timings, t0)
    return workdir, result


def repeat(name: str, settings: list[str], n: int, out: Path | None = None,
           **run_args) -> tuple[Path, dict]:
    """Run an experiment n times (OUT/run-1..n); each claim's pass rate, in repeat.json.
    A run that fails outright counts against every claim."""
    out = Path(out) if out else RESULTS_DIR / f"{name}-x{n}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    held: dict[str, int] = {}
    runs = []
    for i in range(1, n + 1):
        log.info(f"run {i} of {n}")
        try:
            _, result = run(name, settings, out / f"run-{i}", **run_args)
        except LabError as e:
            runs.append({"run": i, "error": str(e)})
            log.info(f"run {i} failed: {e}")
            continue
        runs.append({"run": i, "passed": result["passed"],
                     "failed": [c["name"] for c in result["claims"] if not c["passed"]],
                     "warnings": result["warnings"]})
        for c in result["claims"]:
            held[c["name"]] = held.get(c["name"], 0) + bool(c["passed"])
        log.info(f"run {i}: {sum(c['passed'] for c in result['claims'])}/"
                 f"{len(result['claims'])} claims held")
    summary = {"experiment": name, "settings": settings, "runs": n,
               "claims": {c: {"held": k, "runs": n, "rate": round(k / n, 3)}
                          for c, k in held.items()},
               "all_held": bool(held) and all(k == n for k in held.values())
               and all("error" not in r for r in runs),
               "each_run": runs}
    results.write_json_atomic(out / "repeat.json", summary)
    return out, summary


def render_repeat(summary: dict) -> str:
    lines = [f"{summary['experiment']}: {summary['runs']} runs"]
    for name, c in summary["claims"].items():
        lines.append(f"  {c['held']:3}/{c['runs']}  {name}")
    for r in summary["each_run"]:
        if "error" in r:
            lines.append(f"  run {r['run']} failed: {r['error']}")
    return "\n".join(lines)
