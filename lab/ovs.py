"""Open vSwitch: started, and run with the datapath this kernel supports.

The kernel datapath needs the openvswitch module; kernels without it (such as
module-less CI kernels) run OVS's userspace datapath ("netdev"), where TCP and
UDP only work with userspace TSO enabled (else checksums are left unfilled).
FABRICLAB_DATAPATH=user forces the userspace datapath on any kernel.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from shutil import which

from lab.errors import LabError

OVS_CTL = "/usr/share/openvswitch/scripts/ovs-ctl"
TSO_KEY = "other_config:userspace-tso-enable"


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
    forced = os.environ.get("FABRICLAB_DATAPATH")
    if forced in ("kernel", "user"):
        return forced
    return "kernel" if kernel_datapath_available() else "user"


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
