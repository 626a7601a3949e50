"""What an experiment is (the runner, lab/runner.py, drives it): a module in
lab/experiments/ with
    NAME, DESCRIPTION
    TOPOLOGY_DEFAULTS      optional: {topology: {param: value}}, the fabric it suggests
    QUEUE_DEFAULTS         optional: {queue setting: value} the experiment needs
                           (lab/kernel/queues.py QueueParams, e.g. express_class)
    SCALED_SIZES           optional: Params fields (message sizes) that shrink with the
                           link rates on a machine too slow for the defaults
                           (lab/fabric/calibrate.py)
    SCALED_TIMES           optional: Params fields (when and how often something happens
                           to the traffic: a failure's start, a flap's period) that
                           stretch as long as the traffic does there (time_stretch)
    Params                 a dataclass (its `topology` field picks the fabric)
    run(ctx) -> dict       drives the fabric (ctx: a RunContext), returns measurements;
                           says what it does through logging.getLogger(__name__)
    claims(params, metrics) -> list[Claim]   physical claims checked from them
    capture_plan(fabric, params)   optional: what to capture (lab/fabric/capture.py)
    ACROSS_MACHINES        optional, True: it runs on a fabric over several machines
                           (`fabriclab run NAME --machines ...`): ctx.net is then a
                           lab/cluster.py Cluster and ctx.telemetry its ClusterTelemetry,
                           so it uses only what both offer: fabric, queue_params,
                           machine_factor, dataplane (is it None), popen (GpuAgents),
                           set_congestion, congestion_state, congestion_events; and of
                           the telemetry summary, drops, port_counters, kernel_counts
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lab.core.errors import LabError
from lab.fabric.capture import CapturePlan
from lab.fabric.network import FabricNetwork
from lab.fabric.telemetry import QueueTelemetry
from topologies.fabric import Fabric

REQUIRED = ("NAME", "DESCRIPTION", "Params", "run", "claims")


# What a claim's verdict rests on, and what a starved mechanism decides (Excuse): the
# words both sides use, so that an excuse fits only the claims it can explain.
DROPS = "drops"                # frames a switch queue dropped
RESENDS = "resends"            # what a transport resent, its timeouts, its NAKs
RESEND_DELAY = "resend_delay"  # how long a lost packet waited to be resent
COMPLETION = "completion"      # when the flows finished


@dataclass
class Claim:
    name: str
    passed: bool
    measured: Any
    expected: str
    unit: str = ""      # of every number in measured, for the report (lab/readable.py)
    # A claim on timings (rates, stalls, speedups), which the emulation keeps only while
    # its GPU hosts keep up: where they were CPU-bound, a miss is the machine's.
    timing: bool = False
    # Why the machine's load, not the lab, decided this failed claim (name_starved).
    starved: str | None = None
    # The quantities its verdict rests on (DROPS, RESENDS, ...): an Excuse of its
    # variant explains a miss only if it decides every one of them. () : none can.
    rests_on: tuple[str, ...] = ()


@dataclass(frozen=True)
class Excuse:
    """The machine's load defeated a mechanism in one variant (the claim names' part
    before ':'), deciding these quantities: it explains that variant's failed claims
    that rest on nothing else, and no other claim. In metrics as a dict ("starved")."""
    variant: str
    decides: tuple[str, ...]
    why: str

    def fits(self, claim: Claim) -> bool:
        return (claim.name.split(":")[0] == self.variant and bool(claim.rests_on)
                and set(claim.rests_on) <= set(self.decides))


def name_starved(claims: list[Claim], metrics: dict) -> list[Claim]:
    """The claims, each failed one that the machine's load decided saying why: an Excuse
    the experiment found (metrics' "starved") that fits it, or, for a timing claim, a
    run whose hosts were CPU-bound. A run on a slow machine holds its claims or names
    what starved (issue 13, item 5); the claim still counts as failed."""
    excuses = [Excuse(e["variant"], tuple(e["decides"]), e["why"])
               for e in metrics.get("starved", [])]
    busy = metrics.get("cpu_bound_hosts") or []
    out = []
    for c in claims:
        why = None
        if not c.passed:
            why = next((e.why for e in excuses if e.fits(c)), None) or (
                f"hosts {', '.join(busy)} were CPU-bound: timings there are not faithful"
                if c.timing and busy else None)
        out.append(dataclasses.replace(c, starved=why))
    return out


def excuses(found: list[Excuse]) -> list[dict]:
    """Excuses as metrics hold them ("starved")."""
    return [dataclasses.asdict(e) for e in found]


@dataclass
class RunContext:
    """What an experiment's run() gets (net: a Cluster across machines)."""
    net: FabricNetwork
    params: Any
    workdir: Path
    telemetry: QueueTelemetry

    @property
    def fabric(self):
        return self.net.fabric


def check(mod: ModuleType) -> ModuleType:
    """The module, if it holds what an experiment must (above); else LabError naming
    what it lacks."""
    missing = [a for a in REQUIRED if not hasattr(mod, a)]
    if not missing and not (dataclasses.is_dataclass(mod.Params) and "topology" in
                            {f.name for f in dataclasses.fields(mod.Params)}):
        missing = ["a Params dataclass with a `topology` field"]
    if missing:
        raise LabError(f"{mod.__name__} is not an experiment: it has no "
                       f"{', '.join(missing)} (see lab/experiments/base.py)")
    return mod


def topology_defaults(mod: ModuleType, topology: str) -> dict:
    """The fabric shape the experiment suggests on this topology ({}: none)."""
    return getattr(mod, "TOPOLOGY_DEFAULTS", {}).get(topology, {})


def queue_defaults(mod: ModuleType) -> dict:
    """The switch queues the experiment asks for ({}: the lab's defaults)."""
    return dict(getattr(mod, "QUEUE_DEFAULTS", {}))


def scaled_sizes(mod: ModuleType) -> tuple[str, ...]:
    """The Params fields that shrink with the link rates on a slow machine."""
    return tuple(getattr(mod, "SCALED_SIZES", ()))


def scaled_times(mod: ModuleType) -> tuple[str, ...]:
    """The Params fields that stretch with the traffic's duration on a slow machine."""
    return tuple(getattr(mod, "SCALED_TIMES", ()))


def across_machines(mod: ModuleType) -> bool:
    """Whether it runs on a fabric over several machines (ACROSS_MACHINES)."""
    return bool(getattr(mod, "ACROSS_MACHINES", False))


def busy_ends(mod: ModuleType) -> int:
    """How many flow ends the experiment keeps busy at once at its defaults, counted as
    the calibration counts them: a host sending at line rate is one, receiving one
    more, per NIC port (a ring's host two; on two planes four). A pair, if it says
    nothing. What its rates scale by on a slower machine (calibrate.factor_for)."""
    return int(getattr(mod, "BUSY_ENDS", 2))


def capture_plan(mod: ModuleType, fabric: Fabric, params) -> CapturePlan:
    """What the experiment finds worth capturing (nothing, if it says nothing)."""
    plan = getattr(mod, "capture_plan", None)
    return plan(fabric, params) if plan else CapturePlan([])
