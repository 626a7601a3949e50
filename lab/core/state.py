"""The run lock and the record of processes the lab started.

State lives in /run/fabriclab (tmpfs: gone after a reboot, with everything it
describes). One lab run at a time holds the lock; every process the lab starts
is recorded with a marker from its command line, so that cleanup kills only
those, by PID, and never a process that merely has a similar name.
"""
from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

from lab.core.errors import LabError
from lab.core.paths import STATE_DIR

LOCK_FILE = STATE_DIR / "lock"
PIDS_FILE = STATE_DIR / "pids.jsonl"


class RunLock:
    """An exclusive, non-blocking lock on the lab (flock: released by the
    kernel if the holder dies, so a crash never leaves it stuck)."""

    def __init__(self, purpose: str):
        self.purpose = purpose
        self.fd: int | None = None

    def __enter__(self) -> "RunLock":
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LabError(f"another fabriclab run is active ({holder}); wait for it to "
                           f"finish or stop it (Ctrl-C) before starting a new one") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}: {self.purpose}, since {time.strftime('%H:%M:%S')}"
                 .encode())
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def record_process(pid: int, marker: str, role: str) -> None:
    """Remember a started process; `marker` must occur in its command line."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(PIDS_FILE, "a") as f:
        f.write(json.dumps({"pid": pid, "marker": marker, "role": role}) + "\n")


def recorded_processes() -> list[dict]:
    if not PIDS_FILE.exists():
        return []
    out = []
    for line in PIDS_FILE.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue   # a line cut by a crash mid-write
    return out


def forget_processes(pids: set[int] | None = None) -> None:
    """Forget every recorded process, or those of `pids` (ended by who started them:
    a PID reused later must not look like the lab's)."""
    if pids is None:
        PIDS_FILE.unlink(missing_ok=True)
        return
    kept = [p for p in recorded_processes() if p["pid"] not in pids]
    tmp = PIDS_FILE.with_name(PIDS_FILE.name + ".tmp")
    tmp.write_text("".join(json.dumps(p) + "\n" for p in kept))
    tmp.replace(PIDS_FILE)
