"""Removes what the lab created, and nothing else.

What is the lab's: OVS bridges and root-namespace links whose names follow the
lab's own scheme (fl-<role><n>, fl-<role><n>-eth<p>; a fabric across machines' tunnel
bridge fl-tun and its veth ends fl-x<key>: lab/kernel/tunnel.py), network namespaces
named fl-*, the BPF maps pinned under /sys/fs/bpf/fl-dataplane (the programs go
with the links they are attached to), the root namespace's nftables table fl_gray
(a gray failure's burst loss, lab/kernel/impair.py), /sys/kernel/rcu_expedited
while a build or teardown has it set (lab/kernel/rcu.py: the value it found is put
back), and the processes recorded in lab/core/state.py whose command line still
carries their marker. Never `mn -c` (it kills by name and deletes every
OVS bridge on the machine), never a kill by name.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from shutil import which

from lab.core import state
from lab.kernel import dataplane, impair, ovs, rcu, tunnel
from topologies.base import ROLE_CODES
from topologies.fabric import NAME_PREFIX

_ROLES = "|".join(ROLE_CODES.values())
LAB_BRIDGE = re.compile(rf"^{re.escape(NAME_PREFIX)}(?:{_ROLES})\d+$|^{re.escape(tunnel.BRIDGE)}$")
LAB_LINK = re.compile(rf"^{re.escape(NAME_PREFIX)}(?:{_ROLES})\d+(?:-eth\d+)?$"
                      rf"|^{re.escape(tunnel.STUB_PREFIX)}\d+$")
LAB_NETNS = re.compile(rf"^{re.escape(NAME_PREFIX)}[a-z0-9-]+$")
# The kernel device group of every link end the lab keeps in the root namespace (switch
# ports): `ip link delete group` unregisters them all, with their veth peers, in one
# batch, which waits for RCU a few times instead of once per link (~17 ms each here: the
# 2,048 links between a k=16 fat-tree's switches took 35-50 s one by one). "flab" in ASCII.
LINK_GROUP = 0x666C6162


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def lab_bridges() -> list[str]:
    out = _run(["ovs-vsctl", "--timeout=5", "list-br"]) if which("ovs-vsctl") else ""
    return [b for b in out.split() if LAB_BRIDGE.match(b)]


def _links(*args: str) -> list[str]:
    names = []
    for line in _run(["ip", "-o", "link", "show", *args]).splitlines():
        # "12: fl-lf0-eth1@if11: <...>"
        names.append(line.split(":", 2)[1].strip().split("@")[0])
    return names


def lab_links() -> list[str]:
    return [n for n in _links() if LAB_LINK.match(n)]


def delete_links() -> None:
    """Every lab link of the root namespace (a veth's peer goes with it, wherever it
    is): the lab's device group in one call, if nothing else is in it (another program
    could have picked the same number), then by name in one `ip -batch` what is left
    (a link made before the lab set its group). One gone meanwhile is no error."""
    group = _links("group", str(LINK_GROUP))
    if group and all(LAB_LINK.match(n) for n in group):
        _run(["ip", "link", "delete", "group", str(LINK_GROUP)])
    names = lab_links()
    if names:
        subprocess.run(["ip", "-force", "-batch", "-"], input="".join(
            f"link del {n}\n" for n in names), capture_output=True, text=True)


def lab_netns() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines()
            if line and LAB_NETNS.match(line.split()[0])]


def live_processes() -> list[dict]:
    return [p for p in state.recorded_processes() if p["marker"] in state.cmdline(p["pid"])]


def leftovers() -> dict[str, list]:
    return {"processes": live_processes(), "bridges": lab_bridges(),
            "links": lab_links(), "netns": lab_netns(), "bpf_pins": dataplane.pinned(),
            "nft_tables": impair.gray_tables(),
            "settings": [str(rcu.SWITCH)] if rcu.RESTORE_FILE.exists() else []}


def clean() -> dict[str, list]:
    """Remove every lab object; return what was removed."""
    found = leftovers()
    _kill(found["processes"])
    ovs.delete_bridges(found["bridges"])
    delete_links()
    for ns in found["netns"]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    dataplane.remove_pins()
    impair.remove_gray_table()
    rcu.restore()
    state.forget_processes()
    return found


def _kill(procs: list[dict], grace_s: float = 3.0) -> None:
    for p in procs:
        _signal(p["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.05)
    for p in procs:
        if _alive(p):
            _signal(p["pid"], signal.SIGKILL)


def _alive(p: dict) -> bool:
    return p["marker"] in state.cmdline(p["pid"])


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
