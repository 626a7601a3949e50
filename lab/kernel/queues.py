"""Kernel queues on every link end: the one module that says what queues a port has.

A switch egress port (a veth end in the root namespace, which OVS sends out of):

    htb 1: at the link rate
     └ class 1:1, the link
        ├ class 1:10  priority 0, everything unmapped   ─ tbf 10: (gate) ─ bfifo
        ├ class 1:13  priority 3, RoCE data (DSCP 26)   ─ tbf 13: (gate) ─ bfifo, or red 23: (ECN)
        └ class 1:16  priority 6, CNPs (DSCP 48), trimmed headers (DSCP 40) ─ tbf 16: (gate) ─ bfifo
    u32 filters on the DSCP (ECN bits masked off) pick the class.

Every class is bounded in bytes, so backlog and drops show (in `tc -s`, or where
the BPF data path runs, in its counters: its program drops at the same bound
first, lab/kernel/dataplane.py). The bound
matters on OVS's userspace datapath: it sends into the veth through an AF_PACKET
socket whose send buffer holds ~100 KB, and past that it drops silently; the
classes' buffers together stay under it.

The tbf under each class is its PFC gate: at the link rate it is transparent;
a pause sets its rate to 1 B/s (lab/kernel/tcnl.py: the kernel keeps the queue and
resets the tokens on a change, so a resume takes effect at once; htb's own
classes cannot do this: a class charged at a tiny rate owes up to 60 s).

A GPU host's NIC has the same classes with their own FIFOs (`host_buffer_kb`, the
NIC's transmit FIFOs) and no RED. While a GPU agent runs there, its transport is the
NIC's MAC: it paces at the link rate and stops a paused priority itself
(traffic/nic.py); on a host without one (rxe, the kernel's stack) the PFC engine
closes the NIC's gate as hardware would (controllers/congestion.py).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from lab.core.errors import LabError
from topologies.fabric import Fabric, interface_name
from traffic.constants import (DSCP_EXPRESS, DSCP_PRIORITY, PRIORITY_CNP, PRIORITY_EXPRESS,
                               PRIORITY_ROCE_DATA)

DEFAULT_PRIORITY = 0
AVERAGE_PACKET_BYTES = 1000        # RED's avpkt: RoCE frames at the default 1024-byte MTU
# A paused gate: 1 byte/s. Its burst must admit the largest frame of a 1500-byte
# MTU link (a tbf drops larger frames at enqueue, and paused frames must queue),
# and no more: a change of rate refills the bucket, so each pause lets one burst
# through and each resume starts with one.
PAUSED_RATE_BYTES_S = 1
GATE_BURST_BYTES = 1600
MAX_FRAME_BYTES = 1514      # a full frame of a 1500-byte MTU link (no FCS on a veth)


@dataclass
class RedParams:
    """Kernel RED with ECN on the RoCE class (needs sch_red)."""
    kmin_kb: float
    kmax_kb: float
    pmax: float


@dataclass
class QueueParams:
    # The lossless RoCE class's buffer: 5 ms at 100 Mb/s.
    buffer_kb: int = 64
    # The other classes (control traffic, CNPs) are small: together with the RoCE
    # class they stay below OVS's ~100 KB of AF_PACKET send buffer per port.
    control_buffer_kb: int = 16
    # A GPU host's queues are its NIC's transmit FIFOs, behind the NIC's gates (a
    # pause holds them too where the engine closes a host's gate). A full one pushes
    # back on the transport (ENOBUFS). 32 KB rides out a Python agent's scheduling
    # hiccups at 100 Mb/s (with 8 KB, sprayed flows stalled on ENOBUFS and finished
    # later than RC's). Paced at the link rate (qp.PACE_AHEAD_S ahead), it rarely fills.
    host_buffer_kb: int = 32
    # DSCP -> priority; anything else -> DEFAULT_PRIORITY
    dscp_priority: dict[int, int] = field(default_factory=lambda: dict(DSCP_PRIORITY))
    red: RedParams | None = None
    # 1: an express class (DSCP_EXPRESS -> PRIORITY_EXPRESS, a RoCE-sized lossy queue)
    # served ahead of RoCE data: latency-bound RDMA (KV caches) beside the bulk
    express_class: int = 0

    def __post_init__(self) -> None:
        if self.express_class:
            self.dscp_priority = {**self.dscp_priority, DSCP_EXPRESS: PRIORITY_EXPRESS}

    @property
    def priorities(self) -> list[int]:
        return sorted({DEFAULT_PRIORITY, *self.dscp_priority.values()})

    def buffer_bytes(self, priority: int) -> int:
        data = (PRIORITY_ROCE_DATA, PRIORITY_EXPRESS)
        kb = self.buffer_kb if priority in data else self.control_buffer_kb
        return kb * 1024

    def host_buffer_bytes(self, priority: int) -> int:
        return self.host_buffer_kb * 1024


def pfc_headroom_bytes(rate_mbps: float, response_ms: float, link_delay_ms: float = 0.0) -> int:
    """What one port feeding a lossless queue may still send after the queue's switch
    decides to pause it, as shared-buffer switches size PFC headroom: 2 x (link delay
    + response) x rate + 2 MTU (the pause frame's way there and the data's way back,
    the time both ends take to react, a frame being sent at each end)."""
    return int(2 * (link_delay_ms + response_ms) / 1e3 * rate_mbps * 1e6 / 8
               + 2 * MAX_FRAME_BYTES)


# --- names: every reader of a queue (telemetry, the ECN and PFC engine) uses these ---
def class_minor(priority: int) -> int:
    return 0x10 + priority


def gate_major(priority: int) -> int:
    """The tbf gate of a priority's class: handle <major>:, parent 1:<class_minor>."""
    return 0x10 + priority


def red_major(priority: int) -> int:
    return 0x20 + priority


def fifo_major(priority: int) -> int:
    return 0x30 + priority


def priority_of_gate(major: int) -> int | None:
    return major - 0x10 if 0x10 <= major < 0x18 else None


def gate_rate_bytes_s(rate_mbps: float) -> int:
    return int(rate_mbps * 1e6 / 8)


def gate_burst_bytes(rate_mbps: float) -> int:
    """An open gate's bucket: one frame, or a millisecond at the link rate if more (a
    tbf with a bucket under a timer tick's worth of bytes falls short of its rate:
    measured, iperf3 through 100 Mb/s gates at 1600 bytes made 82 Mb/s, not 95)."""
    return max(GATE_BURST_BYTES, gate_rate_bytes_s(rate_mbps) // 1000)


# --- configuration --------------------------------------------------------------------
def port_commands(intf: str, rate_mbps: float, q: QueueParams,
                         host: bool = False) -> list[str]:
    """The classes of one egress port; host: a GPU host's NIC (small FIFOs, no RED)."""
    lines = [f"qdisc replace dev {intf} root handle 1: htb default "
             f"{class_minor(DEFAULT_PRIORITY):x}"]
    lines += rate_commands(intf, rate_mbps, q, host)
    for dscp, prio in sorted(q.dscp_priority.items()):
        lines.append(f"filter replace dev {intf} parent 1: protocol ip prio 1 u32 "
                     f"match ip dsfield {dscp << 2:#x} 0xfc flowid 1:{class_minor(prio):x}")
    return lines


def gate_command(intf: str, prio: int, rate_mbps: float, q: QueueParams,
                 host: bool = False) -> str:
    """A priority's gate: the tbf that PFC closes, open at the link's rate."""
    limit = q.host_buffer_bytes(prio) if host else q.buffer_bytes(prio)
    return (f"qdisc replace dev {intf} parent 1:{class_minor(prio):x} handle "
            f"{gate_major(prio):x}: tbf rate {gate_rate_bytes_s(rate_mbps) * 8}bit burst "
            f"{gate_burst_bytes(rate_mbps)} limit {limit}")


def rate_commands(intf: str, rate_mbps: float, q: QueueParams,
                  host: bool = False) -> list[str]:
    """What of a configured port depends on its link's rate, for a rate changed in place:
    its classes, gates and RED (htb cannot change its root qdisc, so that one stays)."""
    lines = class_commands(intf, rate_mbps, q)
    for prio in q.priorities:
        lines.append(gate_command(intf, prio, rate_mbps, q, host))
        if q.red is not None and prio == PRIORITY_ROCE_DATA and not host:
            lines.append(roce_queue_command(intf, rate_mbps, q))
    return lines


def class_commands(intf: str, rate_mbps: float, q: QueueParams) -> list[str]:
    """The port's htb classes at `rate_mbps`: the link's, then one per priority."""
    # Guaranteed shares; every class may borrow up to the link, and htb lends
    # spare bandwidth to the lowest `prio` first: CNPs, then RoCE, then the rest. An
    # express class (if any) is guaranteed most of the link and borrows first: whenever
    # it has frames it takes what it needs (up to 95%), and RoCE borrows the link back
    # when it is idle; htb's nearest to strict priority that still guarantees RoCE some.
    share = {PRIORITY_CNP: 0.05, PRIORITY_ROCE_DATA: 0.85, DEFAULT_PRIORITY: 0.10}
    order = {PRIORITY_CNP: 0, PRIORITY_ROCE_DATA: 1}
    if PRIORITY_EXPRESS in q.priorities:
        share.update({PRIORITY_EXPRESS: 0.80, PRIORITY_ROCE_DATA: 0.10,
                      DEFAULT_PRIORITY: 0.05})
        order[PRIORITY_EXPRESS] = 0
    lines = [f"class replace dev {intf} parent 1: classid 1:1 htb rate {rate_mbps}mbit "
             f"ceil {rate_mbps}mbit"]
    for prio in q.priorities:
        rate = rate_mbps * share.get(prio, 0.10 / len(q.priorities))
        lines.append(f"class replace dev {intf} parent 1:1 classid 1:{class_minor(prio):x} "
                     f"htb rate {rate:.3f}mbit ceil {rate_mbps}mbit prio {order.get(prio, 2)}")
    return lines


def set_rate(intf: str, rate_mbps: float, q: QueueParams) -> None:
    """A switch port's link rate changed in place (a degraded link; the root namespace):
    its classes only, so its queues, gates and what waits in them stay."""
    r = subprocess.run(["tc", "-batch", "-"], input="\n".join(class_commands(intf, rate_mbps, q))
                       + "\n", capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"could not set {intf}'s rate to {rate_mbps} Mb/s: {r.stderr.strip()}")


def red_burst(kmin_bytes: float, kmax_bytes: float) -> int:
    """RED's burst in average packets: the tc-red(8) rule."""
    return max(1, int(2 * kmin_bytes + kmax_bytes) // (3 * AVERAGE_PACKET_BYTES))


def red_wlog(kmin_bytes: float, kmax_bytes: float) -> int:
    """RED's averaging weight 2^-wlog, as tc derives it from the burst: the smallest
    wlog whose average, starting from empty, takes `burst` packets to reach Kmin."""
    burst = red_burst(kmin_bytes, kmax_bytes)
    a = burst + 1 - kmin_bytes / AVERAGE_PACKET_BYTES
    w = 0.5
    for wlog in range(1, 32):
        if a <= (1 - (1 - w) ** burst) / w:
            return wlog
        w /= 2
    return 31


def roce_queue_command(intf: str, rate_mbps: float, q: QueueParams) -> str:
    """The queue behind the RoCE class's gate: kernel RED with ECN when q.red is set,
    else a byte FIFO. (Distinct handles: tc replaces a qdisc of another kind only
    when the handle differs.)"""
    prio = PRIORITY_ROCE_DATA
    parent, limit = f"{gate_major(prio):x}:1", q.buffer_bytes(prio)
    if q.red is None:
        return f"qdisc replace dev {intf} parent {parent} handle {fifo_major(prio):x}: " \
               f"bfifo limit {limit}"
    kmin, kmax = int(q.red.kmin_kb * 1024), int(q.red.kmax_kb * 1024)
    burst = red_burst(kmin, kmax)
    # nodrop: a frame that is not ECN-capable (MRC's credit requests, in the data
    # class) is queued where RED would mark, not dropped early, as the BPF data path
    # does; without it kernel RED dropped one in a lab VM incast that claims no drops
    return (f"qdisc replace dev {intf} parent {parent} handle {red_major(prio):x}: "
            f"red limit {limit} min {kmin} max {kmax} avpkt {AVERAGE_PACKET_BYTES} "
            f"burst {burst} probability {q.red.pmax} bandwidth {rate_mbps}mbit ecn nodrop")


def host_interfaces(fabric: Fabric, host: str) -> list[str]:
    return [i.name for i in fabric.host(host).interfaces]


def plan(fabric: Fabric, q: QueueParams, commands=port_commands) -> dict[str | None, list[str]]:
    """host name (None for the root namespace, where switch ports live) -> tc batch lines
    (`commands` per link end: port_commands, or rate_commands for a rate changed in place).
    A link end whose node is not in `fabric` is another machine's (one machine's part of
    a fabric across machines: topologies/partition.py), configured there."""
    hosts = {h.name for h in fabric.hosts}
    switches = {s.name for s in fabric.switches}
    batches: dict[str | None, list[str]] = {}
    for ln in fabric.links:
        for node, port in ((ln.a, ln.a_port), (ln.b, ln.b_port)):
            if node not in hosts and node not in switches:
                continue
            intf = interface_name(node, port)
            batches.setdefault(node if node in hosts else None, []).extend(
                commands(intf, ln.rate_mbps, q, host=node in hosts))
    return batches


def switch_ports(fabric: Fabric) -> list[tuple[str, int, str, float]]:
    """(switch, port, interface, rate Mb/s) of every switch port on a link."""
    switches = {s.name for s in fabric.switches}
    out = []
    for ln in fabric.links:
        for node, port in ((ln.a, ln.a_port), (ln.b, ln.b_port)):
            if node in switches:
                out.append((node, port, interface_name(node, port), ln.rate_mbps))
    return out


# A veth hands each frame to the receive backlog of the CPU that sent it, and a port's
# queue is sent from by either CPU (its timer, a sender's enqueue): two frames of a flow
# could be taken in by two CPUs, the later one first (seen in the lab VM: one frame a
# PSN late now and then, where a veth delivers; RC's receivers NAKed it). Receive packet
# steering on every link end sends each flow's frames to one CPU's backlog, in order.
RPS_PROBE = Path("/sys/class/net/lo/queues/rx-0/rps_cpus")


def receive_steering() -> bool:
    """Whether this kernel steers received packets (CONFIG_RPS)."""
    return RPS_PROBE.exists()


def cpu_mask(cpus: int) -> str:
    """Every CPU as sysfs reads a cpumask: hex, in 32-bit groups separated by commas."""
    bits, groups = (1 << cpus) - 1, []
    while True:
        groups.append(f"{bits & 0xFFFFFFFF:x}")
        bits >>= 32
        if not bits:
            return ",".join(reversed(groups))


def rps_files(intf: str, sys_dir: Path = Path("/sys")) -> list[Path]:
    return sorted((sys_dir / "class/net" / intf / "queues").glob("rx-*/rps_cpus"))


def steer(intfs: list[str]) -> None:
    """Receive steering on these link ends of the root namespace (switch ports, a
    cluster's stubs): each flow's frames taken in by one CPU (nothing where the
    kernel cannot: FabricNetwork says so)."""
    mask = cpu_mask(os.cpu_count() or 1)
    for intf in intfs:
        for f in rps_files(intf):
            f.write_text(mask)


def rps_command(intfs: list[str], mask: str) -> str:
    """Shell that steers a host's link ends, run in its network namespace and in a mount
    namespace of its own: /sys shows the network namespace that mounted it, so a fresh
    sysfs there shows the host's interfaces."""
    files = " ".join(f"/sys/class/net/{i}/queues/rx-*/rps_cpus" for i in intfs)
    return (f"umount -l /sys && mount -t sysfs none /sys || exit 1; "
            f"for f in {files}; do echo {mask} > $f || exit 1; done;")


def set_link_rates(fabric: Fabric, host_pids: dict[str, int], q: QueueParams) -> None:
    """Every configured link end again at its link's rate in `fabric` (changed in place)."""
    procs = []
    for ns, lines in plan(fabric, q, rate_commands).items():
        cmd = ["tc", "-batch", "-"]
        if ns is not None:
            cmd = ["mnexec", "-a", str(host_pids[ns]), *cmd]
        procs.append((ns, subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                           stderr=subprocess.PIPE, text=True)))
        procs[-1][1].stdin.write("\n".join(lines) + "\n")
        procs[-1][1].stdin.close()
    errors = [f"{ns or 'switches'}: {proc.stderr.read().strip()[:200]}" for ns, proc in procs
              if proc.wait()]
    if errors:
        raise LabError("could not change the links' rates (tc): " + "; ".join(errors[:3]))


def apply(fabric: Fabric, host_pids: dict[str, int], q: QueueParams) -> None:
    """Configure every link end; host namespaces in parallel (one tc each)."""
    procs = []
    steering = receive_steering()
    mask = cpu_mask(os.cpu_count() or 1)
    for ns, lines in plan(fabric, q).items():
        batch = tempfile.NamedTemporaryFile("w", prefix="fl-tc-", suffix=".batch")
        batch.write("\n".join(lines) + "\n")
        batch.flush()
        cmd = ["tc", "-batch", batch.name]
        if ns is not None:
            # No segmentation offload on GPU hosts: every queued packet is one wire frame,
            # so a byte-bounded queue is not filled by one 64 KB TSO burst and tc's
            # packet counts mean packets.
            intfs = host_interfaces(fabric, ns)
            offload_off = " ".join(f"ethtool -K {i} tso off gso off 2>/dev/null;"
                                   for i in intfs)
            rps = rps_command(intfs, mask) if steering else ""
            cmd = ["mnexec", "-a", str(host_pids[ns]),
                   *(["unshare", "-m"] if steering else []), "sh", "-c",
                   f"{rps} {offload_off} exec tc -batch {batch.name}"]
        procs.append((ns, batch, subprocess.Popen(cmd, stdout=subprocess.DEVNULL,
                                                  stderr=subprocess.PIPE, text=True)))
    errors = []
    for ns, batch, proc in procs:
        _, err = proc.communicate()
        batch.close()
        if proc.returncode:
            lines = [ln for ln in err.strip().splitlines() if not ln.startswith("Warning")]
            errors.append(f"{ns or 'switches'}: {lines[0] if lines else '?'}")
    if errors:
        raise LabError("could not configure link queues (tc): " + "; ".join(errors[:3]))
    if steering:
        steer([intf for *_, intf, _ in switch_ports(fabric)])
