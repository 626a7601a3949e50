"""GPU agents forked from one process that has already imported them.

Starting a Python agent costs its interpreter and imports (numpy most): 0.2 s of CPU
here, 2.2 s on a software CPU (the lab VM under TCG, measured with -X importtime),
where the eight agents of one collective took ~9 s of two CPUs to start, and the
experiments start agents again for every variant. So a fabric keeps one spawner
(`python -m lab.fabric.spawner`), which imports traffic.agent once; each agent is a
fork of it that enters its host's network and mount namespaces (as `mnexec -a` does)
and runs the agent's main with its own arguments. A fork costs milliseconds (8 forks:
0.05 s under TCG).

The lab asks over a socket pair (one datagram per agent: JSON, with the agent's
stdin, stdout and stderr pipes passed along as file descriptors) and gets the agent's
PID back, which it records for cleanup like any process it starts. The spawner lets
the kernel reap its children; the lab watches an agent's end through a pidfd
(`Agent.poll`, `wait`): an agent's exit status is not known, only that it ended.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

from lab.core import state
from lab.core.errors import LabError
from lab.kernel import netns

MARKER = "lab.fabric.spawner"       # in the command line of the spawner and its agents
REPLY_TIMEOUT_S = 60                # a fork answers at once; generous for a loaded CPU


class Agent:
    """A spawned agent, as GpuAgents uses a Popen: stdin (text, a line at a time),
    stdout (read raw on its fileno), stderr (its errors, once it ended)."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int):
        self.pid = pid
        self.stdin = open(stdin, "w", buffering=1, encoding="utf-8")
        self.stdout = open(stdout, "rb", buffering=0)
        self.stderr = open(stderr, encoding="utf-8", errors="replace")
        self.returncode: int | None = None
        try:
            self.pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:     # already gone (and reaped)
            self.pidfd, self.returncode = None, 0

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def wait(self, timeout: float | None = None) -> int:
        """0 once the agent ended (its status is not known: see the module's text)."""
        if self.returncode is None:
            if not select.select([self.pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"GPU agent {self.pid}", timeout)
            self.returncode = 0
            os.close(self.pidfd)
            self.pidfd = None
        return self.returncode

    def kill(self) -> None:
        if self.pidfd is not None:
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class Spawner:
    """The lab's end: start() the spawner (it imports the agents meanwhile), spawn()
    agents into hosts, close()."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None

    def start(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", MARKER, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        theirs.close()
        state.record_process(self.proc.pid, MARKER, "agent-spawner")
        self.sock.settimeout(REPLY_TIMEOUT_S)

    def spawn(self, host_pid: int, args: list[str], profile: str | None = None) -> Agent:
        """An agent (traffic/agent.py with `args`) in the namespaces of `host_pid`;
        `profile`: a path for its cProfile output."""
        stdin, out, err = os.pipe(), os.pipe(), os.pipe()
        request = json.dumps({"host_pid": host_pid, "args": args, "profile": profile})
        try:
            socket.send_fds(self.sock, [request.encode()], [stdin[0], out[1], err[1]])
            reply = json.loads(self.sock.recv(4096) or b"{}")
        except (OSError, ValueError) as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for fd in (stdin[0], out[1], err[1]):
                os.close(fd)
        if "pid" not in reply:
            for fd in (stdin[1], out[0], err[0]):
                os.close(fd)
            raise LabError(f"the GPU agent spawner could not start an agent: "
                           f"{reply.get('error', 'it has ended')} (its log: {self.log_path})")
        state.record_process(reply["pid"], MARKER, "gpu-agent")
        return Agent(reply["pid"], stdin[1], out[0], err[0])

    def close(self) -> None:
        """The spawner ends when its socket closes (agents still running go on)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


# --- the spawner process -------------------------------------------------------------
def serve(sock: socket.socket) -> None:
    """Fork an agent per request until the lab closes its end."""
    from traffic import agent     # the import every agent would pay, paid once here
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # the kernel reaps the agents
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        except ConnectionResetError:
            return
        if not msg:
            return
        req = json.loads(msg)
        try:
            pid = os.fork()
        except OSError as e:
            reply = {"error": f"fork: {e}"}
        else:
            if pid == 0:
                _run_agent(agent, sock, req, fds)
            reply = {"pid": pid}
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps(reply).encode())


def _run_agent(agent, sock: socket.socket, req: dict, fds: list[int]) -> None:
    """In the forked child: the agent's namespaces, pipes and arguments; never returns."""
    code = 1
    try:
        sock.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        netns.enter(req["host_pid"])
        sys.argv = ["traffic.agent", *req["args"]]
        if req["profile"]:
            import cProfile
            cProfile.runctx("agent.main()", {"agent": agent}, {}, req["profile"])
        else:
            agent.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
