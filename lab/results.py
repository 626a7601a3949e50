"""A run's results directory, in one place: the documents the runner (lab/runner.py)
and the Python API (lab/api.py) both write, with one schema.

    config.json   what was asked: parameters, topology, rate scale, machine
    metrics.json  what happened: the same, the measurements, claims, warnings, timings
    report.md, report.html   (lab/report.py)
Every file is written atomically: a crash never leaves half of one."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from lab import report
from lab.experiments.base import Claim

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"


def write_json_atomic(path: Path, data: dict) -> None:
    """Write to a temporary file, then rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rate_scale(factor: int) -> dict:
    return {"factor": factor, "meaning": f"1 emulated Mb/s stands for {factor} real Mb/s"}


def fabric_facts(net) -> dict:
    """What the running fabric chose (its datapaths, OVS's send buffer)."""
    return {"datapath": net.datapath,
            "congestion_datapath": "bpf" if net.dataplane else
            f"controller sampling ({net.dataplane_missing})",
            "ovs_send_buffer_bytes": net.ovs_send_buffer_bytes}    # userspace datapath


def busiest(summary: dict[str, dict], n: int = 8) -> dict[str, dict]:
    """The queues that held most, over the whole run."""
    top = sorted(summary.items(), key=lambda kv: -kv[1]["backlog_bytes_p99"])[:n]
    return dict(top)


def telemetry_metrics(telemetry) -> dict:
    """metrics.json's `telemetry`: where the looks are, how regular, the busiest queues."""
    return {"csv": "queues.csv", "sampling": telemetry.sampling(),
            "busiest_queues": busiest(telemetry.summary())}


def write(workdir: Path, experiment: str, config: dict, metrics: dict, claims: list[Claim],
          warnings: list[str], timings: dict, started: float) -> dict:
    """metrics.json and the report; `config` holds params, topology, rate_scale and
    fabric_facts(); `started`: time.monotonic() at the start. Returns the document."""
    result = {
        "experiment": experiment,
        "params": config["params"],
        "topology": config["topology"],
        "rate_scale": config["rate_scale"],
        # < 1: the calibration scaled the defaults down for a slow machine
        "machine_factor": config.get("machine_factor", 1.0),
        "datapath": config.get("datapath"),
        "congestion_datapath": config.get("congestion_datapath"),
        "ovs_send_buffer_bytes": config.get("ovs_send_buffer_bytes"),
        "metrics": metrics,
        "claims": [dataclasses.asdict(c) for c in claims],
        "passed": all(c.passed for c in claims),
        "warnings": warnings,
        "timings_s": {**timings, "total_s": time.monotonic() - started},
    }
    write_json_atomic(Path(workdir) / METRICS_FILE, result)
    report.write(Path(workdir), result)
    return result
