"""Reaching another machine of a cluster (lab/cluster.py) through ssh, and the one
channel that runs over it.

The head starts each worker with the user's ssh (their keys, their known_hosts):

    ssh -T -o BatchMode=yes -R 127.0.0.1:P:127.0.0.1:P root@10.0.0.2 -- \\
        /path/to/fabriclab cluster worker

The worker speaks on its stdin and stdout; nothing of the lab listens on a network
(`-R` lets that machine's switches reach the head's controller, which listens on the
head's loopback, through the same ssh connection). On that channel each side sends a
JSON object per line:
  - a request {"op": ...} (head) or its answer {"ok": ...} (worker), one at a time;
  - a stream's bytes {"s": ID, "d": BASE64} or its end {"s": ID, "end": true}: the stdin
    (head to worker) and stdout (worker to head) of a GPU agent the worker started, so
    the head drives a remote agent through a socket as it drives its own through pipes
    (RemoteProcess).
A stream's bytes are handed on by a thread of their own, so a slow reader of one stream
never holds up the answers or the other streams.
"""
from __future__ import annotations

import base64
import collections
import io
import json
import logging
import os
import pwd
import queue
import shlex
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from lab.core.errors import LabError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60       # machines started together have ssh up at different times
HELLO_TIMEOUT_S = 120        # ssh connected, until the worker has imported the lab
# what ssh says when the machine is not (yet) there: tried again until the deadline;
# anything else (a refused key, an unknown host key, no fabriclab there) is said at once
NOT_YET = ("Connection refused", "No route to host", "timed out", "Connection reset",
           "Connection closed", "Network is unreachable", "kex_exchange_identification")
STREAM_CHUNK_BYTES = 1 << 16


def address(target: str) -> str:
    """The machine's address in a `[user@]address` ssh target: what its tunnels and the
    other machines use."""
    return target.rpartition("@")[2]


def remote_user(target: str) -> str | None:
    user, at, _ = target.rpartition("@")
    return user if at else None


@dataclass(frozen=True)
class Reach:
    """How the head reaches the other machines.

    ssh: the ssh command, with any options of the user's (shell words);
    remote_fabriclab: the fabriclab command there (default: this one's path, as a
        checkout provisioned the same way on every machine has it);
    connect_timeout_s: how long to keep trying a machine that does not answer yet."""
    ssh: str = "ssh"
    remote_fabriclab: str | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S

    def fabriclab(self) -> str:
        return self.remote_fabriclab or str(Path(sys.executable).parent / "fabriclab")

    def argv(self, target: str, forward_port: int) -> list[str]:
        """The command that starts the worker on `target`, with the head's loopback port
        `forward_port` (its controller) reachable on that machine's loopback."""
        # a worker builds namespaces and switches: root there, or sudo without a password
        sudo = [] if remote_user(target) == "root" else ["sudo", "-n"]
        remote = [*sudo, self.fabriclab(), "cluster", "worker"]
        return [*_as_the_user(), *shlex.split(self.ssh), "-T",
                "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes",
                "-o", f"ConnectTimeout={max(1, int(min(self.connect_timeout_s, 30)))}",
                "-o", "ServerAliveInterval=15",
                "-R", f"127.0.0.1:{forward_port}:127.0.0.1:{forward_port}",
                target, "--", " ".join(shlex.quote(w) for w in remote)]


def _as_the_user() -> list[str]:
    """Run under sudo, ssh runs as the user who called it, so that user's keys and
    known_hosts are the ones used (root's are not theirs)."""
    user = os.environ.get("SUDO_USER")
    if os.geteuid() != 0 or not user or user == "root":
        return []
    try:
        pwd.getpwnam(user)
    except KeyError:
        return []
    return ["runuser", "-u", user, "--"]


# --- the channel, either side ------------------------------------------------------------
class _Sink:
    """Where one stream's bytes go (a socket, a process's stdin), fed by a thread of its
    own from a queue: whoever reads the channel never waits for that reader."""

    def __init__(self, write: Callable[[bytes], None], close: Callable[[], None]):
        self.write, self.close = write, close
        self.queue: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True).start()

    def put(self, data: bytes | None) -> None:
        self.queue.put(data)

    def _run(self) -> None:
        try:
            while (data := self.queue.get()) is not None:
                self.write(data)
        except OSError:
            pass
        try:
            self.close()
        except OSError:
            pass


class Channel:
    """Requests and answers, one at a time, and streams, over a byte pipe each way."""

    def __init__(self, rfile: BinaryIO, wfile: BinaryIO, peer: str):
        self.rfile, self.wfile, self.peer = rfile, wfile, peer
        self.answers: queue.SimpleQueue[dict | None] = queue.SimpleQueue()
        self.sinks: dict[int, _Sink] = {}
        self.writing = threading.Lock()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            for line in self.rfile:
                msg = json.loads(line)
                sid = msg.get("s")
                if sid is None:
                    self.answers.put(msg)
                elif sid in self.sinks:
                    sink = self.sinks[sid] if "d" in msg else self.sinks.pop(sid)
                    sink.put(base64.b64decode(msg["d"]) if "d" in msg else None)
        except (OSError, ValueError) as e:
            log.warning(f"{self.peer}: the channel broke ({e})")
        finally:
            for sink in list(self.sinks.values()):
                sink.put(None)
            self.sinks = {}
            self.answers.put(None)

    def send(self, **msg) -> None:
        data = json.dumps(msg).encode() + b"\n"
        with self.writing:
            self.wfile.write(data)
            self.wfile.flush()

    def receive(self, timeout_s: float | None = None) -> dict | None:
        """The next request or answer; None when the other side has gone."""
        try:
            return self.answers.get(timeout=timeout_s)
        except queue.Empty:
            raise LabError(f"{self.peer} did not answer within {timeout_s:.0f} s") from None

    def ask(self, timeout_s: float, **msg) -> dict:
        self.send(**msg)
        reply = self.receive(timeout_s)
        if reply is None:
            raise LabError(f"{self.peer} closed the connection (see its worker's output)")
        if not reply.get("ok"):
            raise LabError(f"{self.peer}: {reply.get('error', 'failed')}")
        return reply

    # streams
    def sink(self, sid: int, write: Callable[[bytes], None], close: Callable[[], None]) -> None:
        """Stream `sid`'s incoming bytes go to `write`; its end calls `close`."""
        self.sinks[sid] = _Sink(write, close)

    def pump(self, sid: int, read: Callable[[], bytes], done: Callable[[], None] = lambda: None
             ) -> threading.Thread:
        """A thread sending what `read` returns as stream `sid`, then its end (when read
        returns b"" or fails), then calling `done`."""
        def run():
            try:
                while data := read():
                    self.send(s=sid, d=base64.b64encode(data).decode())
            except OSError:
                pass
            try:
                self.send(s=sid, end=True)
            except OSError:
                pass
            done()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t


# --- the head's side -----------------------------------------------------------------------
class WorkerConnection:
    """The ssh process that runs one machine's worker, and the channel over it; what the
    worker writes to stderr (its log) is logged here, each line under the machine's name."""

    def __init__(self, machine: int, target: str, reach: Reach, forward_port: int):
        self.machine, self.target, self.reach = machine, target, reach
        self.peer = f"machine {machine} ({target})"
        self.said: collections.deque[str] = collections.deque(maxlen=20)
        self.next_stream = 1
        deadline = time.monotonic() + reach.connect_timeout_s
        while True:
            self.proc = subprocess.Popen(reach.argv(target, forward_port),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True)
            self.errors = threading.Thread(target=self._log_errors, daemon=True)
            self.errors.start()
            self.channel = Channel(self.proc.stdout, self.proc.stdin, self.peer)
            try:
                hello = self.channel.receive(HELLO_TIMEOUT_S)
            except LabError:
                self._end_process()     # (started here: stopped here, by its PID)
                raise
            if hello is not None and hello.get("worker"):
                return
            self._end_process()
            said = " / ".join(self.said) or f"ssh exited {self.proc.returncode}"
            if time.monotonic() < deadline and any(s in said for s in NOT_YET):
                time.sleep(1)
                continue
            raise LabError(self._why(said))

    def _why(self, said: str) -> str:
        where = f"could not start a cluster worker on {self.peer} over ssh: {said}"
        if self.proc.returncode == 127 or "not found" in said or "No such file" in said:
            return (f"{where}. Install fabriclab there as here (README), or say where its "
                    f"fabriclab is: --remote-fabriclab PATH (tried {self.reach.fabriclab()})")
        if "password is required" in said:
            return (f"{where}. The worker needs root there: name root@ in --machines, or let "
                    f"that user run fabriclab with sudo without a password")
        if any(s in said for s in NOT_YET):
            return (f"{where} (for {self.reach.connect_timeout_s:g} s; --wait S to wait "
                    f"longer)")
        user = os.environ["SUDO_USER"] if _as_the_user() else pwd.getpwuid(os.geteuid()).pw_name
        return (f"{where}. ssh runs as {user}, with that user's keys and known_hosts: check "
                f"that `ssh {self.target} true` works there without a prompt")

    def _log_errors(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            if line:
                self.said.append(line)
                log.info(f"[machine {self.machine}] {line}")

    def open_stream(self) -> tuple[int, socket.socket]:
        """A new stream: its id, and the socket that is its end here (what is written to
        it goes to the stream, what the other side sends arrives on it)."""
        sid, self.next_stream = self.next_stream, self.next_stream + 1
        mine, theirs = socket.socketpair()
        self.channel.sink(sid, theirs.sendall, lambda: _shut(theirs))
        self.channel.pump(sid, lambda: theirs.recv(STREAM_CHUNK_BYTES))
        return sid, mine

    def close(self, timeout_s: float) -> None:
        """The worker's stdin closes (it takes its part down and exits), then ssh ends;
        killed by its PID if it lingers."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._end_process()
        self.errors.join(timeout=5)

    def _end_process(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.errors.join(timeout=5)


def _shut(sock: socket.socket) -> None:
    """The stream ended: the reader here sees its end of file."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class RemoteProcess:
    """A process in a host of another machine, as GpuAgents uses a Popen: its stdin and
    stdout are one socket, a stream of the channel to that machine's worker, which
    started it there (recorded there for cleanup); its stderr goes to the worker's log.
    The stream ending is the process ending, either way."""

    def __init__(self, sock: socket.socket, pid: int, machine: int):
        self.sock, self.pid, self.machine = sock, pid, machine
        self.stdin = sock.makefile("w", encoding="utf-8")
        self.stdout = sock              # read raw (os.read on its fileno) by GpuAgents
        self.stderr = io.StringIO(f"(its errors are in machine {machine}'s worker output)")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    self.returncode = 0
            except BlockingIOError:
                pass
            except OSError:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Until the stream ends; what the process still wrote is read and dropped
        (else it would hide the end from poll's peek)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            try:
                if self.sock.recv(1 << 16, socket.MSG_DONTWAIT) == b"":
                    self.returncode = 0
                continue
            except BlockingIOError:
                pass
            except OSError:
                self.returncode = 0
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid} on machine {self.machine}",
                                                timeout)
            time.sleep(0.05)
        return self.returncode

    def kill(self) -> None:
        """The worker sees the stream end and stops the process."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.returncode = -9


# --- the worker's side ---------------------------------------------------------------------
def stdio_channel(peer: str = "the head") -> Channel:
    """The worker's channel: its stdin and stdout as ssh gave them. Everything else the
    process or its children write to fd 1 (Mininet's messages, a stray print) goes to
    stderr instead, and children read nothing from the channel: fds 0 and 1 are moved
    out of the way first."""
    rfile = os.fdopen(os.dup(0), "rb")
    wfile = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    return Channel(rfile, wfile, peer)
