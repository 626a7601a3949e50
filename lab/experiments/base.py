"""What an experiment is (the runner, lab/runner.py, drives it): a module in
lab/experiments/ with
    NAME, DESCRIPTION
    TOPOLOGY_DEFAULTS      optional: {topology: {param: value}}, the fabric it suggests
    SCALED_SIZES           optional: Params fields (message sizes) that shrink with the
                           link rates on a machine too slow for the defaults
                           (lab/fabric/calibrate.py)
    Params                 a dataclass (its `topology` field picks the fabric)
    run(ctx) -> dict       drives the fabric (ctx: a RunContext), returns measurements
    claims(params, metrics) -> list[Claim]   physical claims checked from them
    capture_plan(fabric, params)   optional: what to capture (lab/fabric/capture.py)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lab.fabric.network import FabricNetwork
from lab.fabric.telemetry import QueueTelemetry


@dataclass
class Claim:
    name: str
    passed: bool
    measured: Any
    expected: str
    unit: str = ""      # of every number in measured, for the report (lab/readable.py)


@dataclass
class RunContext:
    """What an experiment's run() gets."""
    net: FabricNetwork
    params: Any
    workdir: Path
    progress: Callable[[str], None]
    telemetry: QueueTelemetry

    @property
    def fabric(self):
        return self.net.fabric
