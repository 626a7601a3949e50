"""Open vSwitch: started, and run with the datapath this kernel supports.

The kernel datapath needs the openvswitch module; kernels without it (such as
module-less CI kernels) run OVS's userspace datapath ("netdev"), where TCP and
UDP only work with userspace TSO enabled (else checksums are left unfilled).
FABRICLAB_DATAPATH=user forces the userspace datapath on any kernel.
"""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
from pathlib import Path
from shutil import which

from lab.core import paths
from lab.core.errors import LabError

OVS_CTL = "/usr/share/openvswitch/scripts/ovs-ctl"
TSO_KEY = "other_config:userspace-tso-enable"
PIDFILE = Path("/run/openvswitch/ovs-vswitchd.pid")
SYS_PIDFD_GETFD = 438           # the same number on every architecture (the generic table)
SO_SNDBUFFORCE = 32             # <asm-generic/socket.h>; Python's socket module lacks it


def _ok(args: list[str], timeout: float = 10) -> bool:
    try:
        return subprocess.run(args, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def installed() -> bool:
    return which("ovs-vsctl") is not None and Path(OVS_CTL).exists()


def running() -> bool:
    return _ok(["ovs-vsctl", "--timeout=3", "show"])


def kernel_datapath_available() -> bool:
    """True when the kernel's openvswitch datapath answers (loading it if needed)."""
    if which("modprobe") and Path("/proc/modules").exists():
        _ok(["modprobe", "-q", "openvswitch"])
    return _ok(["genl", "ctrl", "get", "name", "ovs_datapath"])


def interfaces() -> set[str]:
    """The names of every interface OVS has (every bridge's ports and the bridges')."""
    r = subprocess.run(["ovs-vsctl", "--timeout=30", "--format=csv", "--no-headings",
                        "--columns=name", "list", "Interface"],
                       capture_output=True, text=True, timeout=40)
    if r.returncode:
        raise LabError(f"ovs-vsctl could not list OVS's interfaces: {r.stderr.strip()}")
    return {line.strip().strip('"') for line in r.stdout.splitlines() if line.strip()}


def delete_bridges(names: list[str]) -> None:
    """Every bridge in `names` (those that exist), in one ovs-vsctl transaction: one
    at a time, OVS reconfigures every remaining port for each."""
    if names:
        args = ["ovs-vsctl", "--timeout=60"]
        for name in names:
            args += ["--", "--if-exists", "del-br", name]
        subprocess.run(args, capture_output=True, timeout=90)


def datapath_lost_packets() -> int:
    """Packets OVS's datapaths lost on flow-table misses (the upcall to ovs-vswitchd
    failed: its queue was full), summed over the machine's datapaths. No queue counts
    these: in the kernel datapath a new flow's first packets wait for ovs-vswitchd,
    and under a slow CPU that queue overflows."""
    try:
        out = subprocess.run(["ovs-appctl", "dpctl/show"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(int(word.split(":")[1]) for line in out.splitlines()
               if line.strip().startswith("lookups:")
               for word in line.split() if word.startswith("lost:"))


def datapath() -> str:
    """'kernel' or 'user'."""
    forced = paths.env(paths.DATAPATH_ENV)
    if forced in ("kernel", "user"):
        return forced
    return "kernel" if kernel_datapath_available() else "user"


def memory_mb() -> float | None:
    """ovs-vswitchd's resident memory (MB), None if it is not running. Debian starts it
    with --mlockall, so what it once held stays resident: a measure of what a fabric
    needs of the machine."""
    try:
        pid = int(PIDFILE.read_text().split()[0])
        status = Path(f"/proc/{pid}/status").read_text()
    except (OSError, ValueError, IndexError):
        return None
    kb = next((int(line.split()[1]) for line in status.splitlines()
               if line.startswith("VmRSS:")), None)
    return kb / 1024 if kb is not None else None


def _service(action: str) -> None:
    if Path("/run/systemd/system").exists() and which("systemctl"):
        ok = _ok(["systemctl", action, "openvswitch-switch"], timeout=60)
    else:
        ok = _ok([OVS_CTL, action, "--system-id=random"], timeout=60)
    if not ok or not running():
        raise LabError(f"could not {action} Open vSwitch; see /var/log/openvswitch/ and run "
                       f"'bash vagrant/provision.sh' as root to reinstall it")


def ensure_running() -> str:
    """Start OVS if needed and configure it for the datapath; return the datapath kind."""
    if not installed():
        raise LabError("Open vSwitch is not installed: run 'make demo' as root (or "
                       "'bash vagrant/provision.sh') to install the lab's packages")
    if not running():
        _service("start")
    kind = datapath()
    if kind == "user":
        current = subprocess.run(["ovs-vsctl", "--timeout=5", "get", "Open_vSwitch", ".",
                                  TSO_KEY], capture_output=True, text=True).stdout.strip()
        if current.strip('"') != "true":
            subprocess.run(["ovs-vsctl", "--timeout=5", "set", "Open_vSwitch", ".",
                            f"{TSO_KEY}=true"], check=True)
            _service("restart")   # the TSO setting is read at start only
    return kind


def send_socket() -> tuple[int, int] | None:
    """(pid, fd) of ovs-vswitchd's AF_PACKET send socket, if it has one yet.

    The userspace datapath sends every port's frames through one packet socket per
    process (lib/netdev-linux.c: made at the first send, never bound), so frames
    waiting in any port's qdisc are all charged to its send buffer: the kernel's
    default, 208 KB of truesize, ~93 frames across every port of every bridge; past
    that a send fails and OVS drops the frame, counted by no queue."""
    try:
        pid = int(PIDFILE.read_text().split()[0])
        fds = {os.readlink(f"/proc/{pid}/fd/{fd}"): int(fd)
               for fd in os.listdir(f"/proc/{pid}/fd")}
        lines = Path("/proc/net/packet").read_text().splitlines()[1:]
    except (OSError, ValueError, IndexError):
        return None
    for line in lines:      # sk RefCnt Type Proto Iface R Rmem User Inode
        cols = line.split()
        if len(cols) >= 9 and int(cols[3], 16) == 0 and cols[4] == "0":
            fd = fds.get(f"socket:[{cols[8]}]")
            if fd is not None:
                return pid, fd
    return None


def lift_send_buffer(nbytes: int) -> int | None:
    """Raise that socket's send buffer to `nbytes` (SO_SNDBUFFORCE through a duplicate
    of it taken with pidfd_getfd: no global sysctl, no restart), so the switch ports'
    own buffers are what bound their queues. Returns the buffer now (the kernel
    doubles what it is given), or None if OVS has no such socket yet or the kernel
    refuses (pidfd_getfd needs Linux 5.6 and ptrace rights over ovs-vswitchd)."""
    found = send_socket()
    if found is None:
        return None
    pid, target = found
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, target, 0)
    finally:
        os.close(pidfd)
    if fd < 0:
        return None
    with socket.socket(fileno=fd) as sock:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < nbytes:
            sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, nbytes)
        return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
