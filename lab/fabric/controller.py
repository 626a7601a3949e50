"""The controller process: started by the lab on loopback, stopped by PID."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from controllers import protocol
from lab.core import state
from lab.core.errors import LabError
from lab.fabric import ryu
from topologies.fabric import Fabric

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port(ip: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


RUNTIMES = ("os-ken", "ryu")
CONGESTION_APP = "controllers.congestion"


class Controller:
    """The controller apps (controllers/) for one fabric, on os-ken or on Ryu."""

    def __init__(self, fabric: Fabric, workdir: Path, runtime: str = "os-ken",
                 local_fabric: Fabric | None = None, apps: list[str] | None = None,
                 port: int | None = None):
        """It listens on loopback, on `port` (default: a free one); the other machines of
        a cluster reach it through ssh (lab/ssh.py). local_fabric: a fabric across machines: this machine's part, whose ECN and PFC
        the congestion app handles (each machine runs its own: its queues, its data
        path); apps: which of controllers/ (default: the router and the congestion app;
        another machine of a cluster runs the congestion app alone)."""
        if runtime not in RUNTIMES:
            raise LabError(f"unknown controller runtime {runtime!r}; choose one of "
                           f"{', '.join(RUNTIMES)}")
        self.runtime = runtime
        self.fabric = fabric
        self.workdir = Path(workdir)
        self.listen_ip = "127.0.0.1"
        self.port = port or free_port(self.listen_ip)
        self.fabric_file = self.workdir / "fabric.json"
        self.local_fabric = local_fabric
        self.local_fabric_file = self.workdir / "fabric-local.json"
        self.apps = apps
        self.status_file = self.workdir / "controller.status"
        self.congestion_file = self.workdir / protocol.CONFIG_FILE
        self.routing_file = self.workdir / "routing.json"     # read by fabric_router
        self.log_file = self.workdir / "logs" / "controller.log"
        self.proc: subprocess.Popen | None = None

    def launch(self) -> None:
        """Start the process; wait_listening() waits for its port. In between the lab
        builds the network: the interpreter and its apps take seconds to load on a
        software CPU (the fresh-machine VM), time the build can use."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.fabric.save(self.fabric_file)
        if self.local_fabric is not None:
            self.local_fabric.save(self.local_fabric_file)
        self.status_file.write_text("")
        for name in (*protocol.FILES, "routing.json", "routing-events.jsonl"):
            (self.workdir / name).unlink(missing_ok=True)   # a fresh run's files only
        marker = f"--status {self.status_file}"
        interpreter = sys.executable if self.runtime == "os-ken" else str(ryu.ensure())
        cmd = [interpreter, "-m", "controllers.launch", "--port", str(self.port),
               "--listen-host", self.listen_ip,
               "--fabric", str(self.fabric_file), "--status", str(self.status_file),
               "--congestion", str(self.congestion_file), "--runtime", self.runtime]
        if self.local_fabric is not None:
            cmd += ["--congestion-fabric", str(self.local_fabric_file)]
        for app in self.apps or []:
            cmd += ["--app", app]
        with open(self.log_file, "w") as log:
            # Its own session: a Ctrl-C in the terminal reaches the lab, which
            # then stops the controller in order, after the switches.
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        state.record_process(self.proc.pid, marker, "controller")

    def wait_listening(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                socket.create_connection((self.listen_ip, self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.1)
        raise LabError(f"the controller did not listen on {self.listen_ip}:{self.port} within "
                       f"{timeout_s:.0f} s; see {self.log_file}")

    def wait_programmed(self, timeout_s: float, reconnect_after_s: float = 20.0,
                        switches=None) -> None:
        """Wait until the controller has programmed every switch (barrier-confirmed), or
        those of `switches` (a cluster's machine: its own). A switch still missing after
        `reconnect_after_s` is made to reconnect, once: under a software CPU (the lab VM)
        a handshake was seen to stall for good."""
        switches = self.fabric.switches if switches is None else switches
        want = {sw.dpid for sw in switches}
        start = time.monotonic()
        deadline = start + timeout_s
        reconnected = False
        while True:
            self._check_alive()
            done = {int(x) for x in self.status_file.read_text().split()}
            if want <= done:
                return
            missing = sorted(sw.name for sw in switches if sw.dpid not in done)
            if not reconnected and time.monotonic() > start + reconnect_after_s:
                self.reconnect(missing)
                reconnected = True
            if time.monotonic() > deadline:
                raise LabError(f"the controller did not program {len(missing)} switch(es) "
                               f"({', '.join(missing[:5])}) within {timeout_s:.0f} s; "
                               f"see {self.log_file}")
            time.sleep(0.05)

    def reconnect(self, switches: list[str]) -> None:
        target = f"tcp:{self.listen_ip}:{self.port}"
        for name in switches:
            subprocess.run(["ovs-vsctl", "del-controller", name], capture_output=True)
            subprocess.run(["ovs-vsctl", "set-controller", name, target], capture_output=True)

    def enable_rerouting(self, reroute_delay_ms: float = 0.0) -> None:
        """From now on the controller routes around links that go down, after this
        delay (the convergence time of the routing it stands for)."""
        tmp = self.routing_file.with_name(".routing.json.tmp")
        tmp.write_text(json.dumps({"reroute_delay_ms": reroute_delay_ms}))
        tmp.replace(self.routing_file)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_file.read_text().strip().splitlines()[-3:]
            raise LabError(f"the controller exited (code {self.proc.returncode}): "
                           + " | ".join(tail) + f"; full log: {self.log_file}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        protocol.discard_unfinished_writes(self.workdir)
