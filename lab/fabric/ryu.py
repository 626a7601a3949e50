"""Ryu, installed on demand, for `--controller-runtime ryu`.

Ryu 4.34 is unmaintained and does not install with plain pip on current Python:
its setup needs pbr without build isolation, and its eventlet must be 0.33.x (later
ones removed what it imports). Those pins, measured on this platform, live here;
the lab's own virtualenv stays on os-ken.
"""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from lab.core.errors import LabError
from lab.core.paths import RYU_VENV

log = logging.getLogger(__name__)

BOOTSTRAP = ["pbr", "wheel", "setuptools"]
PINS = ["ryu==4.34", "eventlet==0.33.3", "dnspython>=2"]


def python() -> Path:
    return RYU_VENV / "bin" / "python"


def installed() -> bool:
    return python().exists() and subprocess.run(
        [str(python()), "-c", "import ryu, eventlet; assert eventlet.__version__ == '0.33.3'"],
        capture_output=True).returncode == 0


def ensure() -> Path:
    """The Ryu interpreter, installing it (~10-60 s, needs PyPI) the first time."""
    if installed():
        return python()
    log.info(f"installing Ryu 4.34 into {RYU_VENV} (once)")
    steps = [[sys.executable, "-m", "venv", "--clear", str(RYU_VENV)],
             [str(python()), "-m", "pip", "install", "-q", *BOOTSTRAP],
             [str(python()), "-m", "pip", "install", "-q", "--no-build-isolation", *PINS]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            tail = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
            raise LabError(f"could not install Ryu ({' '.join(cmd[-3:])}): {tail}; "
                           f"check network access to PyPI, or use the default os-ken runtime")
    if not installed():
        raise LabError(f"Ryu installed into {RYU_VENV} but does not import; remove that "
                       f"directory and retry")
    return python()
