"""One running fabric, assembled one way for the runner, the Python API, the CLI and
the benches:

    with Session(topo, "fabriclab verify") as s:     # the lock, a directory, the fabric
        s.net ...                                    # lab/fabric/network.py
    with Session(topo, "fabriclab run incast", workdir, telemetry=True, ...) as s:
        s.telemetry ...                              # lab/fabric/telemetry.py

The run lock (one lab run at a time: lab/core/state.py) is taken first and released
last; the directory is the one given, or a temporary one removed at the end; the
fabric network gets every other keyword (queue_params, verbose, controller_runtime,
machine_factor, use_dataplane). If anything fails on the way up,
what was built is taken down again."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from controllers import protocol
from lab.core.state import RunLock
from lab.fabric.network import FabricNetwork
from lab.fabric.telemetry import QueueTelemetry
from topologies.base import FabricTopo

TELEMETRY_INTERVAL_MS = 5.0


class Session:
    def __init__(self, topo: FabricTopo, label: str, workdir: Path | None = None,
                 telemetry: bool = False, **network):
        self.topo, self.label, self.network = topo, label, network
        self.workdir: Path | None = Path(workdir) if workdir is not None else None
        self.want_telemetry = telemetry
        self.net: FabricNetwork | None = None
        self.telemetry: QueueTelemetry | None = None
        self._lock: RunLock | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> "Session":
        self._lock = RunLock(self.label)
        self._lock.__enter__()
        try:
            if self.workdir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="fabriclab-")
                self.workdir = Path(self._tmp.name)
            self.workdir.mkdir(parents=True, exist_ok=True)
            self.net = FabricNetwork(self.topo, self.workdir, **self.network).__enter__()
            if self.want_telemetry:
                self.telemetry = QueueTelemetry(
                    self.net.fabric, self.workdir / "queues.csv", TELEMETRY_INTERVAL_MS,
                    controller_state=self.net.controller.workdir / protocol.STATE_FILE,
                    dp=self.net.dataplane)
                self.telemetry.start()
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.telemetry is not None:
                self.telemetry.stop()
            if self.net is not None:
                self.net.__exit__(*exc)
        finally:
            if self._tmp is not None:
                self._tmp.cleanup()
            if self._lock is not None:
                self._lock.__exit__(*exc)
