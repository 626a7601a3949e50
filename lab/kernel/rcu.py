"""Expedited RCU grace periods while the lab tears a fabric down.

Tearing a fabric down waits for RCU grace periods one at a time: OVS's userspace
datapath closes each port's AF_PACKET socket (packet_release calls synchronize_net)
as it deletes a bridge's ports one by one, and a normal grace period takes ~7-23 ms
here (strace of ovs-vswitchd: close() 7-23 ms each). The kernel's own switch,
/sys/kernel/rcu_expedited, makes those waits expedited (IPIs to the CPUs instead of
waiting for their next ticks). Measured here with bare OVS: 40 bridges of 16 ports
deleted in 1.1 s instead of 8.1 s; bench/scale.py's k=16 fat-tree (5,120 switch
ports): the bridges' deletion 60 -> 44 s, the links' 11 -> 7 s. (The build, which
also waits for some, measured no faster: it is left at the normal pace.)

It is a machine-wide setting, so the lab sets it only for the teardown, puts back
the value it found, and records that value in its state directory: `fabriclab
clean` restores it after a run that was killed meanwhile. A kernel without the
switch (or a read-only /sys) tears down at the normal pace.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

from lab.core.paths import STATE_DIR

log = logging.getLogger(__name__)

SWITCH = Path("/sys/kernel/rcu_expedited")
RESTORE_FILE = STATE_DIR / "rcu_expedited"


@contextmanager
def expedited():
    try:
        found = SWITCH.read_text().strip()
    except OSError:
        found = None
    if found != "0":        # missing, or already expedited by someone: leave it
        yield
        return
    try:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        RESTORE_FILE.write_text(found)
        SWITCH.write_text("1")
    except OSError as e:
        log.info(f"RCU grace periods stay normal ({SWITCH}: {e}): the build and the "
                 f"teardown of a large fabric take longer")
        RESTORE_FILE.unlink(missing_ok=True)
        yield
        return
    try:
        yield
    finally:
        restore()


def restore() -> bool:
    """Put back the value the lab found, if it changed it; True if it did."""
    try:
        found = RESTORE_FILE.read_text().strip()
    except OSError:
        return False
    try:
        SWITCH.write_text(found)
    except OSError as e:
        log.warning(f"could not put back {SWITCH} = {found} ({e})")
        return False
    RESTORE_FILE.unlink(missing_ok=True)
    return True
