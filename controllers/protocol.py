"""The congestion protocol between the lab and the controller's congestion app: its
files, its schema, and how each side reads and writes them, in one place that both
import (the lab: lab/fabric/congestion.py; the app: controllers/congestion.py).

In the run's directory:
    congestion.json           the lab's configuration (CongestionConfig); a new one has
                              a higher `version`, and the app reloads it on change
    congestion-state.json     the app's state: the `version` it applied, counters per
                              "device:port" and priority, gates, reaction times
    congestion-events.jsonl   xoff/xon, gates, marking, watchdog, with timestamps
Every write is atomic (a temporary file, then a rename): a reader never sees half.
The app writes its state and new events every STATE_EVERY_S, and at once when it
applies a new configuration; a reader that needs what the app knows now waits for a
state written after it asked (read_state(..., written_after=t)).
Pure: no os-ken, no kernel; a field added here is added on both sides at once.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

CONFIG_FILE = "congestion.json"
STATE_FILE = "congestion-state.json"
EVENTS_FILE = "congestion-events.jsonl"
FILES = (CONFIG_FILE, STATE_FILE, EVENTS_FILE)
ECN_APPLIED = ("bpf", "red", "controller", "off")     # what `ecn` can say once resolved
# The app's state and new events go out this often: each write is ~0.3 ms of the app's
# CPU on the busy machine (10 a second were a quarter of it in the PFC incast)
STATE_EVERY_S = 0.25


@dataclass
class CongestionConfig:
    version: int = 0
    ecn: str = "off"                 # one of ECN_APPLIED (red: the kernel marks)
    kmin_bytes: int = 0
    kmax_bytes: int = 0
    pmax: float = 0.0
    red_wlog: int = 0                # RED's EWMA weight 2^-wlog (ecn "bpf")
    pfc: bool = False
    lossless: dict = field(default_factory=dict)     # priority (str) -> [xoff, xon] bytes
    pause_quanta: int = 0xFFFF
    pfc_response_ms: float = 1.0     # the data path's PFC headroom is sized for this
    pfc_alpha: float = 1.0           # its dynamic threshold: alpha x the free buffer
    sample_ms: float = 2.0           # the sampling period where the app samples the queues
    watchdog_ms: float = 500.0
    queue: dict = field(default_factory=dict)        # lab/kernel/queues.py QueueParams, as a dict
    host_pids: dict = field(default_factory=dict)    # GPU host -> a process in its namespace
    dataplane: bool = False          # the per-packet BPF data path is attached
    trim_bytes: int = 0              # RoCE data past this backlog is trimmed (0: dropped)
    trim_dscp: int = 0               # ...and its headers sent on with this DSCP

    @property
    def thresholds(self) -> dict[int, tuple[int, int]]:
        """Lossless priority -> (XOFF, XON) in bytes, when PFC is on."""
        return {int(p): (x[0], x[1]) for p, x in self.lossless.items()} if self.pfc else {}

    @property
    def sampling(self) -> bool:
        """The app samples the queues: marking or PFC without the data path."""
        return self.ecn == "controller" or (self.pfc and not self.dataplane)

    @property
    def realtime(self) -> bool:
        """The app must react at once: it samples, or handles the data path's signals."""
        return self.sampling or (self.dataplane and (self.pfc or self.ecn == "bpf"))

    def write(self, workdir: Path) -> None:
        _write_atomic(Path(workdir) / CONFIG_FILE, json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> "CongestionConfig":
        known = {f.name for f in fields(cls)}
        data = json.loads(Path(path).read_text())
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: fields this app does not know: {sorted(unknown)} "
                             f"(the lab and the controller are of different versions)")
        return cls(**data)


def write_state(workdir: Path, state: dict) -> None:
    _write_atomic(Path(workdir) / STATE_FILE, json.dumps(state))


def read_state(workdir: Path, written_after: float | None = None,
               timeout_s: float = 5.0) -> dict:
    """The app's state ({} before its first write). written_after (wall clock): one
    written after then, and the events it had by then, waited for (at most
    timeout_s: then TimeoutError; the app writes every STATE_EVERY_S)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            state = json.loads((Path(workdir) / STATE_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            state = {}
        if written_after is None or state.get("t", 0.0) > written_after:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"the congestion app wrote no state in {timeout_s:.0f} s")
        time.sleep(min(0.02, STATE_EVERY_S / 4))


def discard_unfinished_writes(workdir: Path) -> None:
    """Remove the temporary copies a write cut short left behind: the lab stops the app
    with a signal, which can land between writing a file's copy and renaming it (seen
    once, in the lab VM's slower CPU: a run left `.congestion-state.json.tmp`). Called
    once the app has exited, so nothing writes them any more."""
    for name in FILES:
        _unfinished(Path(workdir) / name).unlink(missing_ok=True)


def _unfinished(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _write_atomic(path: Path, text: str) -> None:
    tmp = _unfinished(path)
    tmp.write_text(text)
    os.replace(tmp, path)
