"""The lab's wall clock: the time a transport stamps on what it reports (rate samples,
pause frames taken in, EV changes), so that reports of hosts on different machines
line up. On one machine it is the machine's clock; on a machine of a fabric over
several (lab/cluster.py) the worker that starts a process sets OFFSET_ENV to how far
its clock is behind the head's, and the process's times are the head's."""
from __future__ import annotations

import os
import time

OFFSET_ENV = "FABRICLAB_CLOCK_OFFSET_S"
OFFSET_S = float(os.environ.get(OFFSET_ENV) or 0.0)


def now() -> float:
    """Unix time in seconds on the lab's clock."""
    return time.time() + OFFSET_S
