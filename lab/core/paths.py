"""Where the lab keeps its files, and the environment variables that move them or
change what the lab does: the one place for both.

    /run/fabriclab         the run lock and the record of the processes the lab started
                           (tmpfs: gone after a reboot, with everything it describes)
    /var/cache/fabriclab/  what is built once and kept: the BPF object (bpf/), this
                           machine's calibration, the lab VM's images (vm/), the Ryu
                           virtualenv (ryu-venv/)

Environment (all optional):
    FABRICLAB_STATE_DIR    instead of /run/fabriclab
    FABRICLAB_CALIBRATION  the calibration file (read when asked for, so a test can point
                           a child process elsewhere)
    FABRICLAB_VM_CACHE     instead of /var/cache/fabriclab/vm
    FABRICLAB_VM_ACCEL     kvm | tcg: the lab VM's accelerator, instead of probing
    FABRICLAB_DATAPATH     user | kernel: Open vSwitch's datapath, instead of probing
    FABRICLAB_PROFILE_DIR  run each GPU agent under cProfile, its profile written here
"""
from __future__ import annotations

import os
from pathlib import Path

STATE_DIR = Path(os.environ.get("FABRICLAB_STATE_DIR", "/run/fabriclab"))
CACHE_DIR = Path("/var/cache/fabriclab")
BPF_CACHE_DIR = CACHE_DIR / "bpf"
RYU_VENV = CACHE_DIR / "ryu-venv"
VM_CACHE_DIR = Path(os.environ.get("FABRICLAB_VM_CACHE", str(CACHE_DIR / "vm")))

CALIBRATION_ENV = "FABRICLAB_CALIBRATION"
DATAPATH_ENV = "FABRICLAB_DATAPATH"
PROFILE_ENV = "FABRICLAB_PROFILE_DIR"
VM_ACCEL_ENV = "FABRICLAB_VM_ACCEL"


def calibration_file() -> Path:
    return Path(os.environ.get(CALIBRATION_ENV, str(CACHE_DIR / "calibration.json")))


def env(name: str) -> str | None:
    """One of the variables above, or None when unset."""
    return os.environ.get(name) or None
