"""Kernel queues on every link end: the one module that says what queues a port has.

Each interface, switch or host side, gets an htb root at its link's rate with
one class and a bounded byte FIFO under it. The bound matters on OVS's
userspace datapath: without it the veth queue is capped by OVS's AF_PACKET send
buffer, which drops the excess silently; with it, drops show in `tc -s qdisc`.
"""
from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass

from lab.errors import LabError
from topologies.fabric import Fabric


@dataclass
class QueueParams:
    # per egress queue: 5 ms at 100 Mb/s. Kept below the ~93 packets (~100 KB of 1 KB
    # RoCE frames) that OVS userspace can have in an AF_PACKET send buffer: past that
    # it drops silently, and the drops must happen here, where tc counts them.
    buffer_kb: int = 64


def interface_name(node: str, port: int) -> str:
    """Mininet's interface name for a node's port."""
    return f"{node}-eth{port}"


def shaping_commands(intf: str, rate_mbps: float, q: QueueParams) -> list[str]:
    return [
        f"qdisc replace dev {intf} root handle 1: htb default 1",
        f"class replace dev {intf} parent 1: classid 1:1 htb rate {rate_mbps}mbit "
        f"ceil {rate_mbps}mbit",
        f"qdisc replace dev {intf} parent 1:1 handle 10: bfifo limit {q.buffer_kb * 1024}",
    ]


def host_interfaces(fabric: Fabric, host: str) -> list[str]:
    return [i.name for i in fabric.host(host).interfaces]


def plan(fabric: Fabric, q: QueueParams) -> dict[str | None, list[str]]:
    """host name (None for the root namespace, where switch ports live) -> tc batch lines."""
    hosts = {h.name for h in fabric.hosts}
    batches: dict[str | None, list[str]] = {}
    for ln in fabric.links:
        for node, port in ((ln.a, ln.a_port), (ln.b, ln.b_port)):
            ns = node if node in hosts else None
            batches.setdefault(ns, []).extend(
                shaping_commands(interface_name(node, port), ln.rate_mbps, q))
    return batches


def apply(fabric: Fabric, host_pids: dict[str, int], q: QueueParams) -> None:
    """Configure every link end; host namespaces in parallel (one tc each)."""
    procs = []
    for ns, lines in plan(fabric, q).items():
        batch = tempfile.NamedTemporaryFile("w", prefix="fl-tc-", suffix=".batch")
        batch.write("\n".join(lines) + "\n")
        batch.flush()
        cmd = ["tc", "-batch", batch.name]
        if ns is not None:
            # No segmentation offload on GPU hosts: every queued packet is one wire frame,
            # so a byte-bounded queue is not filled by one 64 KB TSO burst and tc's
            # packet counts mean packets.
            offload_off = " ".join(f"ethtool -K {i} tso off gso off 2>/dev/null;"
                                   for i in host_interfaces(fabric, ns))
            cmd = ["mnexec", "-a", str(host_pids[ns]), "sh", "-c",
                   f"{offload_off} exec tc -batch {batch.name}"]
        procs.append((ns, batch, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)))
    errors = []
    for ns, batch, proc in procs:
        _, err = proc.communicate()
        batch.close()
        if proc.returncode:
            errors.append(f"{ns or 'switches'}: {err.strip().splitlines()[0] if err else '?'}")
    if errors:
        raise LabError("could not configure link queues (tc): " + "; ".join(errors[:3]))
