"""Removes what the lab created, and nothing else.

What is the lab's: OVS bridges and root-namespace links whose names follow the
lab's own scheme (fl-<role><n>, fl-<role><n>-eth<p>), network namespaces
named fl-*, the BPF maps pinned under /sys/fs/bpf/fl-dataplane (the programs go
with the links they are attached to), the root namespace's nftables table fl_gray
(a gray failure's burst loss, lab/kernel/impair.py), and the processes recorded in lab/core/state.py whose command line
still carries their marker. Never `mn -c` (it kills by name and deletes every
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
from lab.kernel import dataplane, impair, ovs
from topologies.base import ROLE_CODES
from topologies.fabric import NAME_PREFIX

_ROLES = "|".join(ROLE_CODES.values())
LAB_BRIDGE = re.compile(rf"^{re.escape(NAME_PREFIX)}(?:{_ROLES})\d+$")
LAB_LINK = re.compile(rf"^{re.escape(NAME_PREFIX)}(?:{_ROLES})\d+(?:-eth\d+)?$")
LAB_NETNS = re.compile(rf"^{re.escape(NAME_PREFIX)}[a-z0-9-]+$")


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else ""


def lab_bridges() -> list[str]:
    out = _run(["ovs-vsctl", "--timeout=5", "list-br"]) if which("ovs-vsctl") else ""
    return [b for b in out.split() if LAB_BRIDGE.match(b)]


def lab_links() -> list[str]:
    names = []
    for line in _run(["ip", "-o", "link", "show"]).splitlines():
        # "12: fl-lf0-eth1@if11: <...>"
        name = line.split(":", 2)[1].strip().split("@")[0]
        if LAB_LINK.match(name):
            names.append(name)
    return names


def delete_links(names: list[str]) -> None:
    """Delete links in one `ip -batch` (a veth's peer goes with it); one that is gone
    already (its namespace ended meanwhile) is no error."""
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
            "nft_tables": impair.gray_tables()}


def clean() -> dict[str, list]:
    """Remove every lab object; return what was removed."""
    found = leftovers()
    _kill(found["processes"])
    ovs.delete_bridges(found["bridges"])
    delete_links(lab_links())   # deleting a bridge may already have taken some
    for ns in found["netns"]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    dataplane.remove_pins()
    impair.remove_gray_table()
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
