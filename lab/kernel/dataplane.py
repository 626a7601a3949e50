"""The fabric's per-packet data path: ECN marking and the PFC trigger on every switch
port, as tc BPF programs (lab/kernel/dataplane.bpf.c), and the table they share with
user space.

    dp = Dataplane.attach(fabric, host_pids, queue_params)   # at fabric build
    table = PortTable.open(fabric)     # any process: the controller, telemetry
    table.set_ecn(slot, kmin, kmax, pmax); table.counters(slot, prio)

Every link end has a slot in one array (struct port in the C source): the
configuration user space writes (buffer limits, DSCP -> priority, RED's Kmin,
Kmax, Pmax, each lossless priority's XOFF/XON) and the counters the programs
keep (bytes in and out of each priority's queue, drops, CE marks; as an ingress,
the bytes that entered there and wait in the switch's queues, its XOFF/XON
signals; PFC frames sent and received). The array is mapped into user space,
so reading every port's counters costs no system call. A switch port's programs
send its PFC frames themselves as they decide them; an XON decided on a host's end
of a link (another namespace) goes to a small ring read by the PFC sender
(lab/kernel/pfc_sender.c, a process started with the programs). XOFF, XON and received
pause frames also go to a ring buffer that the controller app reads: at once for a
pause frame received (a gate to close) or a frame nobody sent, otherwise in
batches (its log, its counts). A
lossless frame's ingress port is remembered in an LRU hash (`origins`) from the
switch's ingress to its egress, where the frame is charged to it.

The maps are pinned under /sys/fs/bpf/fl-dataplane (bpffs is mounted if it is
not), a lab object like its namespaces: `remove_pins()` runs at teardown and in
`fabriclab clean`. The programs live as long as the devices they are attached to.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import socket
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from lab.core import state
from lab.core.errors import LabError
from lab.core.paths import BPF_CACHE_DIR
from lab.kernel import bpf, netns, tcnl
from topologies.fabric import NAME_PREFIX, Fabric, interface_name
from traffic import pause
from traffic.constants import PRIORITY_ROCE_DATA

if TYPE_CHECKING:       # numpy only where telemetry reads: Ryu's runtime has none
    import numpy as np

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("dataplane.bpf.c")
HEADER = SOURCE.with_name("dataplane.h")            # the layouts both sides share
SENDER = SOURCE.with_name("pfc_sender.c")
PIN_DIR = bpf.BPF_FS / f"{NAME_PREFIX}dataplane"
PRIOS = 8
NO_SLOT = 0xFFFFFFFF
EVENTS_BYTES = 1 << 20          # the ring buffer: ~18k events
SENDS_BYTES = 1 << 16           # PFC frames handed to the sender: ~4k
# frames on their way through a switch, remembered by content (struct origin_key):
# far more than the fabric's buffers hold (64 KB per queue: ~60 frames)
ORIGINS = 1 << 16
ORIGIN_KEY_BYTES, ORIGIN_BYTES = 36, 16
AVG_SHIFT = 10                  # the C source's fixed point for RED's average

# struct port (dataplane.bpf.c; its static asserts check these sizes)
# ecn mask, kmin, kmax, pmax_u32, wlog, packet_ns, quantum_ns, ifindex, dscp, mac,
# pause_quanta, history, look_ns, peer_slot, role
_HEAD = struct.Struct("=8I64s6sHIIII")
HEAD_QUANTUM, HEAD_IFINDEX, HEAD_DSCP, HEAD_MAC, HEAD_PAUSE_QUANTA = 6, 7, 8, 9, 10
HEAD_HISTORY, HEAD_LOOK_NS, HEAD_PEER, HEAD_ROLE = 11, 12, 13, 14
ROLE_HOST, ROLE_SWITCH, ROLE_STUB = 0, 1, 2     # dataplane.h's ROLE_*
# limit, xoff, xon, nic_honours, headroom, alpha_q8, trim_bytes, trim_dscp
_CFG = struct.Struct("=8I")
CFG_FIELDS = ("limit", "xoff", "xon", "nic", "headroom", "alpha_q8", "trim_bytes", "trim_dscp")
CFG_NIC = 3
_STATE = struct.Struct("=25QIiII")
STATE_FIELDS = ("in_bytes", "out_bytes", "in_packets", "out_packets", "drop_packets",
                "drop_bytes", "ce_marked", "avg_scaled", "idle_since_ns", "xoff_signals",
                "xon_signals", "pfc_tx_pause", "pfc_tx_resume", "pfc_rx_pause",
                "pfc_rx_resume", "rx_packets", "rx_bytes", "red_r", "out_adjust",
                "paused_until_ns", "held_in_bytes", "held_out_bytes", "held_adjust",
                "unattributed", "trimmed", "xoff", "red_count", "wire_xoff", "pad")
PORT_BYTES = _HEAD.size + PRIOS * _CFG.size + PRIOS * _STATE.size
OUT_ADJUST_AT = STATE_FIELDS.index("out_adjust") * 8
HELD_ADJUST_AT = STATE_FIELDS.index("held_adjust") * 8
HELD_AT = STATE_FIELDS.index("held_in_bytes") * 8
# a port's CE marks, PFC frames (sent pausing, resuming, received ...) and trimmed
# frames, every priority: ce_marked, then pfc_tx_pause .. pfc_rx_resume, then trimmed
_ONE_PRIO = (f"{STATE_FIELDS.index('ce_marked') * 8}xQ"
             f"{(STATE_FIELDS.index('pfc_tx_pause') - 7) * 8}x4Q"
             f"{(STATE_FIELDS.index('trimmed') - 15) * 8}xQ")
_PFC_AND_MARKS = struct.Struct("=" + "".join(
    f"{_ONE_PRIO}{_STATE.size - struct.calcsize('=' + _ONE_PRIO)}x" for _ in range(PRIOS)))
DECIDED_AT = STATE_FIELDS.index("xoff_signals") * 8       # then xon_signals
# what queues() reads of each queue, by word
_QUEUE_WORDS = [STATE_FIELDS.index(f) for f in (
    "in_bytes", "out_bytes", "in_packets", "out_packets", "drop_packets", "ce_marked",
    "out_adjust", "paused_until_ns")]
XOFF_AT = STATE_FIELDS.index("xoff") * 8
WIRE_XOFF_AT = XOFF_AT + 8
CFG_AT = _HEAD.size
STATE_AT = CFG_AT + PRIOS * _CFG.size
# struct event
EVENT = struct.Struct("=QIIII8HIII4x")
EV_XOFF, EV_XON, EV_PAUSE_RX = 1, 2, 3
# struct history: per switch port and priority, the queue at the end of each of the last
# HISTORY_LOOKS telemetry periods (struct look: period, then LOOK_FIELDS)
HISTORY_LOOKS = 64
LOOK_FIELDS = ("backlog_bytes", "backlog_packets", "sent_packets", "drop_packets",
               "ce_marked", "paused_until_ns")
HISTORY_BYTES = HISTORY_LOOKS * 8 * (1 + len(LOOK_FIELDS))


def unavailable() -> str | None:
    """None if the data path can run here; else what is missing (doctor says it)."""
    built = _cached_object().exists() and _cached(SENDER, "pfc-sender").exists()
    if shutil.which("clang") is None and not built:
        return "clang is missing (apt-get install clang llvm libbpf-dev libc6-dev)"
    if not Path("/usr/include/bpf/bpf_helpers.h").exists() and not built:
        return "libbpf's headers are missing (apt-get install libbpf-dev)"
    return bpf.available()


def probe() -> str | None:
    """None if both programs build and pass the kernel's verifier here; else why not."""
    why = unavailable()
    if why:
        return why
    try:
        obj = bpf.ElfObject(build())
        ports = bpf.Map.create(bpf.BPF_MAP_TYPE_ARRAY, 4, PORT_BYTES, 1,
                               flags=bpf.BPF_F_MMAPABLE, name="fl_probe")
        events = bpf.Map.create(bpf.BPF_MAP_TYPE_RINGBUF, 0, 0, 4096, name="fl_probe")
        origins = bpf.Map.create(bpf.BPF_MAP_TYPE_LRU_HASH, ORIGIN_KEY_BYTES, ORIGIN_BYTES,
                                 64, name="fl_probe")
        sends = bpf.Map.create(bpf.BPF_MAP_TYPE_RINGBUF, 0, 0, 4096, name="fl_probe")
        history = bpf.Map.create(bpf.BPF_MAP_TYPE_ARRAY, 4, HISTORY_BYTES, PRIOS,
                                 flags=bpf.BPF_F_MMAPABLE, name="fl_probe")
        try:
            for section in ("tc/egress", "tc/ingress"):
                os.close(obj.load(section, {"ports": ports.fd, "events": events.fd,
                                            "origins": origins.fd, "sends": sends.fd,
                                            "history": history.fd},
                                  name="fl_probe"))
            build_sender()
        finally:
            for m in (ports, events, origins, sends, history):
                m.close()
    except (LabError, OSError) as e:
        return str(e).splitlines()[0]
    return None


def _cached(source: Path, name: str) -> Path:
    digest = hashlib.sha256(source.read_bytes() + HEADER.read_bytes()).hexdigest()[:16]
    return BPF_CACHE_DIR / f"{name}-{digest}"


def _cached_object() -> Path:
    return _cached(SOURCE, "dataplane").with_suffix(".o")


def _compile(source: Path, out: Path, *flags: str) -> Path:
    """`source` compiled once per version of it and of the shared header."""
    if out.exists():
        return out
    BPF_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    arch = f"{platform.machine()}-linux-gnu"      # where Debian keeps asm/types.h
    tmp = out.with_suffix(".tmp")
    r = subprocess.run(["clang", "-O2", *flags, f"-I/usr/include/{arch}", str(source),
                        "-o", str(tmp)], capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"could not compile {source.name} with clang: "
                       f"{r.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out


def build() -> Path:
    """The programs' object."""
    return _compile(SOURCE, _cached_object(), "-target", "bpf", "-mcpu=v3", "-c")


def build_sender() -> Path:
    """The PFC sender's executable (lab/kernel/pfc_sender.c)."""
    return _compile(SENDER, _cached(SENDER, "pfc-sender"))


@dataclass
class Slot:
    node: str
    port: int
    intf: str
    switch: bool
    stub: bool = False     # another machine's switch port: its stand-in here (tunnel.py)

    @property
    def role(self) -> int:
        return ROLE_SWITCH if self.switch else ROLE_STUB if self.stub else ROLE_HOST


def slots(fabric: Fabric) -> list[Slot]:
    """Every link end, in the fabric's link order: its index is its slot. On one
    machine of several (topologies/partition.py: Partition.local), a link to another
    machine's switch has its far end here as a stub, whose interface the tunnel names
    (its `intf` is left empty here)."""
    switches = {s.name for s in fabric.switches}
    hosts = {h.name for h in fabric.hosts}
    out = []
    for ln in fabric.links:
        for node, port in ((ln.a, ln.a_port), (ln.b, ln.b_port)):
            stub = node not in switches and node not in hosts
            out.append(Slot(node, port, "" if stub else interface_name(node, port),
                            node in switches, stub))
    return out


def history_entries(fabric: Fabric) -> dict[int, int]:
    """switch port slot -> its first entry in the history map (one per priority)."""
    switch_slots = [i for i, s in enumerate(slots(fabric)) if s.switch]
    return {slot: n * PRIOS for n, slot in enumerate(switch_slots)}


def peers(fabric: Fabric) -> dict[int, int]:
    """slot -> the slot at the other end of its link."""
    out = {}
    for i in range(len(fabric.links)):
        out[2 * i], out[2 * i + 1] = 2 * i + 1, 2 * i
    return out


class PortTable:
    """The shared array of ports, mapped into this process."""

    def __init__(self, m: bpf.Map):
        self.map = m
        self.mem = m.mmap()
        self.stride = (PORT_BYTES + 7) & ~7
        self._words: np.ndarray | None = None      # the table as 64-bit words: queues()

    @classmethod
    def open(cls, fabric: Fabric, pin_dir: Path = PIN_DIR) -> "PortTable":
        return cls(bpf.Map.open_pinned(pin_dir / "ports", PORT_BYTES, len(slots(fabric))))

    def __len__(self) -> int:
        return self.map.max_entries

    def _at(self, slot: int) -> int:
        if not 0 <= slot < self.map.max_entries:
            raise IndexError(f"no port slot {slot}")
        return slot * self.stride

    # configuration (user space writes, the programs read)
    def _cfg(self, slot: int, prio: int, **change) -> None:
        off = self._at(slot) + CFG_AT + prio * _CFG.size
        cfg = dict(zip(CFG_FIELDS, _CFG.unpack_from(self.mem, off)))
        cfg.update(change)
        _CFG.pack_into(self.mem, off, *cfg.values())

    def set_queues(self, slot: int, dscp_priority: dict[int, int],
                   limits: dict[int, int]) -> None:
        at = self._at(slot)
        head = list(_HEAD.unpack_from(self.mem, at))
        dscp = bytearray(64)
        for d, prio in dscp_priority.items():
            dscp[d] = prio
        head[HEAD_DSCP] = bytes(dscp)
        _HEAD.pack_into(self.mem, at, *head)
        for prio in range(PRIOS):
            self._cfg(slot, prio, limit=limits.get(prio, 0))

    def set_ecn(self, slot: int, prio_mask: int, kmin_bytes: int, kmax_bytes: int,
                pmax: float, wlog: int, packet_ns: int) -> None:
        at = self._at(slot)
        head = list(_HEAD.unpack_from(self.mem, at))
        head[:6] = [prio_mask, kmin_bytes, kmax_bytes, min(0xFFFFFFFF, int(pmax * 2 ** 32)),
                    wlog, packet_ns]
        _HEAD.pack_into(self.mem, at, *head)

    def set_link(self, slot: int, rate_mbps: float) -> None:
        """The port's link rate, as the programs need it: a pause quantum's time."""
        self._head(slot, {HEAD_QUANTUM: round(pause.quantum_s(rate_mbps * 1e6) * 1e9)})

    def set_mac(self, slot: int, ifindex: int, mac: str) -> None:
        """A switch port's device (its ifindex in the namespace of the switch's ports)
        and MAC: its programs send its PFC frames themselves (without: user space)."""
        self._head(slot, {HEAD_IFINDEX: ifindex, HEAD_MAC: bytes.fromhex(mac.replace(":", ""))})

    def set_role(self, slot: int, peer_slot: int, role: int) -> None:
        """Which the port is (ROLE_*: a switch's, a host's, a stub), and the switch
        port at its link's other end (NO_SLOT: a host's end or a stub, which keep no
        queue the programs count)."""
        self._head(slot, {HEAD_PEER: peer_slot, HEAD_ROLE: role})

    def set_history(self, slot: int, index: int, look_ns: int = 0) -> None:
        """Where the port's programs keep telemetry's looks at its queues (`index`: its
        entry / PRIOS in the history map; NO_SLOT: nowhere), every `look_ns` (0: not)."""
        self._head(slot, {HEAD_HISTORY: index, HEAD_LOOK_NS: look_ns})

    def set_look_ns(self, slot: int, look_ns: int) -> None:
        self._head(slot, {HEAD_LOOK_NS: look_ns})

    def look_ns(self, slot: int) -> int:
        """The period of the looks the port's programs keep (0: none kept)."""
        return _HEAD.unpack_from(self.mem, self._at(slot))[HEAD_LOOK_NS]

    def set_pause_quanta(self, slot: int, quanta: int) -> None:
        """The pause time of the XOFF frames the port's programs send."""
        self._head(slot, {HEAD_PAUSE_QUANTA: quanta})

    def _head(self, slot: int, change: dict[int, object]) -> None:
        at = self._at(slot)
        head = list(_HEAD.unpack_from(self.mem, at))
        for i, v in change.items():
            head[i] = v
        _HEAD.pack_into(self.mem, at, *head)

    def set_pfc(self, slot: int, prio: int, xoff_bytes: int, xon_bytes: int,
                headroom_bytes: int = 0, alpha: float = 1.0) -> None:
        """PFC for what waits in this port's `prio` queue, per ingress port: an ingress
        pauses at alpha x the queue's free part above `headroom_bytes`, at most at
        `xoff_bytes` (0: the priority is not lossless here), and resumes at the same
        ratio of `xon_bytes` to `xoff_bytes`."""
        self._cfg(slot, prio, xoff=xoff_bytes, xon=xon_bytes, headroom=headroom_bytes,
                  alpha_q8=round(alpha * 256))

    def set_trim(self, slot: int, prio: int, trim_bytes: int, dscp: int) -> None:
        """Packet trimming on this port's `prio` queue: a RoCE frame that would take its
        backlog past `trim_bytes` is cut to its headers and queued with `dscp` (its
        queue: the DSCP's priority) instead of being dropped; 0: no trimming."""
        self._cfg(slot, prio, trim_bytes=trim_bytes, trim_dscp=dscp)

    def set_nic_honours(self, slot: int, prio: int, on: bool) -> None:
        """Whether the NIC at this link end stops `prio` itself when a pause arrives (a
        GPU agent's transport: traffic/nic.py): then nobody closes a gate for it."""
        self._cfg(slot, prio, nic=int(on))

    def nic_honours(self, slot: int, prio: int) -> bool:
        return bool(_CFG.unpack_from(self.mem, self._at(slot) + CFG_AT + prio * _CFG.size)
                    [CFG_NIC])

    def clear_xoff(self, slot: int, prio: int) -> None:
        """Forget this ingress's signalled XOFF and what it holds (PFC turned off)."""
        struct.pack_into("=I", self.mem, self._state_at(slot, prio) + XOFF_AT, 0)
        self.write_off_held(slot, prio, self.held_bytes(slot, prio))

    def held_bytes(self, slot: int, prio: int) -> int:
        """What entered the switch through this port and waits in its `prio` queues."""
        held_in, held_out, adjust = struct.unpack_from("=3Q", self.mem,
                                                       self._state_at(slot, prio) + HELD_AT)
        return max(0, held_in - held_out - adjust)

    def write_off_held(self, slot: int, prio: int, nbytes: int) -> None:
        """Bytes charged to this ingress that left unseen (user space: the only writer)."""
        at = self._state_at(slot, prio) + HELD_ADJUST_AT
        struct.pack_into("=Q", self.mem, at, struct.unpack_from("=Q", self.mem, at)[0] + nbytes)

    def xoff(self, slot: int, prio: int) -> bool:
        """XOFF decided for this port as an ingress (the data path's flag)."""
        return bool(struct.unpack_from("=I", self.mem, self._state_at(slot, prio) + XOFF_AT)[0])

    def decisions(self, slot: int, prio: int) -> int:
        """How many XOFF and XON decisions the programs made for this ingress."""
        return sum(struct.unpack_from("=2Q", self.mem, self._state_at(slot, prio) + DECIDED_AT))

    def wire_xoff(self, slot: int, prio: int) -> bool:
        """The last PFC frame this port sent for `prio` paused it (else resumed it)."""
        return bool(struct.unpack_from("=I", self.mem,
                                       self._state_at(slot, prio) + WIRE_XOFF_AT)[0])

    def write_off(self, slot: int, prio: int, nbytes: int) -> None:
        """Bytes that left the queue unseen (user space is this field's only writer)."""
        at = self._state_at(slot, prio) + OUT_ADJUST_AT
        struct.pack_into("=Q", self.mem, at, struct.unpack_from("=Q", self.mem, at)[0] + nbytes)

    # counters (the programs write)
    def _state_at(self, slot: int, prio: int) -> int:
        return self._at(slot) + STATE_AT + prio * _STATE.size

    def counters(self, slot: int, prio: int) -> dict[str, int]:
        values = _STATE.unpack_from(self.mem, self._state_at(slot, prio))
        out = dict(zip(STATE_FIELDS, values))
        out["backlog_bytes"] = max(0, out["in_bytes"] - out["out_bytes"] - out["out_adjust"])
        out["avg_bytes"] = out["avg_scaled"] >> AVG_SHIFT
        return out

    def pfc_and_marks(self, slot: int) -> list[tuple[int, int, int, int, int, int]]:
        """Per priority: (PFC frames sent pausing, sent resuming, received pausing,
        received resuming, CE marks, frames trimmed): what the controller reports of
        every port four times a second, in one unpack per port."""
        v = _PFC_AND_MARKS.unpack_from(self.mem, self._state_at(slot, 0))
        return [(*v[i + 1:i + 5], v[i], v[i + 5]) for i in range(0, len(v), 6)]

    def queues(self, slots: np.ndarray, prios: np.ndarray, now_ns: int) -> np.ndarray:
        """What telemetry reads of many queues at once (~30 every 5 ms: one object per
        queue per look was most of its CPU): rows of (backlog bytes, backlog packets,
        packets sent, drops, CE marks, paused (0/1) at now_ns), int64."""
        rows = self.queue_states(slots, prios)
        rows[:, 5] = rows[:, 5] > now_ns
        return rows

    def queue_states(self, slots: np.ndarray, prios: np.ndarray) -> np.ndarray:
        """Rows of LOOK_FIELDS (as the programs note them in the history), int64."""
        import numpy as np      # (the controller apps import this module too, numpy-less)
        if self._words is None:
            self._words = np.frombuffer(self.mem, dtype=np.uint64,
                                        count=len(self) * self.stride // 8).reshape(
                len(self), self.stride // 8)
        # one gather of the words each queue needs (_QUEUE_WORDS), then arithmetic
        base = STATE_AT // 8 + prios * (_STATE.size // 8)
        block = self._words[slots[:, None], base[:, None] + np.array(_QUEUE_WORDS)].astype(
            np.int64)
        inb, outb, inp, outp, drops, ce, adjust, paused_until = block.T
        return np.stack([np.maximum(0, inb - outb - adjust), np.maximum(0, inp - outp), outp,
                         drops, ce, paused_until], axis=1)

    def in_bytes(self, slot: int, prio: int) -> int:
        return struct.unpack_from("=Q", self.mem, self._state_at(slot, prio))[0]

    def out_bytes(self, slot: int, prio: int) -> int:
        """What left the queue, as the peer's program saw it arrive."""
        return struct.unpack_from("=Q", self.mem, self._state_at(slot, prio) + 8)[0]

    def backlog_bytes(self, slot: int, prio: int) -> int:
        at = self._state_at(slot, prio)
        inb, outb = struct.unpack_from("=QQ", self.mem, at)
        return max(0, inb - outb - struct.unpack_from("=Q", self.mem, at + OUT_ADJUST_AT)[0])

    def close(self) -> None:
        self._words = None          # (a view of the mapping: it must go first)
        self.mem.close()
        self.map.close()


class History:
    """The programs' looks at every switch queue (struct history), mapped into this
    process: telemetry reads finished periods from it (lab/fabric/telemetry.py)."""

    def __init__(self, m: bpf.Map):
        import numpy as np      # (see PortTable.queue_states)
        self.map = m
        self.mem = m.mmap()
        self.looks: np.ndarray | None = np.frombuffer(
            self.mem, dtype=np.uint64, count=m.max_entries * HISTORY_BYTES // 8).reshape(
            m.max_entries, HISTORY_LOOKS, 1 + len(LOOK_FIELDS))

    @classmethod
    def open(cls, fabric: Fabric, pin_dir: Path = PIN_DIR) -> "History":
        n = max(1, len(history_entries(fabric))) * PRIOS
        return cls(bpf.Map.open_pinned(pin_dir / "history", HISTORY_BYTES, n))

    def close(self) -> None:
        self.looks = None           # (a view of the mapping: it must go first)
        self.mem.close()
        self.map.close()


def parse_event(raw: bytes) -> dict:
    t_ns, kind, slot, prio, value, *quanta, queue, threshold, sent = EVENT.unpack_from(raw)
    return {"t_ns": t_ns, "kind": kind, "slot": slot, "prio": prio, "value": value,
            "quanta": quanta, "queue": queue, "threshold": threshold, "sent": bool(sent)}


def open_events(pin_dir: Path = PIN_DIR) -> bpf.RingBuffer:
    return bpf.RingBuffer(bpf.Map.open_pinned(pin_dir / "events", 0, EVENTS_BYTES))


class Dataplane:
    """The programs of one running fabric: loaded and attached at build, the maps pinned."""

    def __init__(self, fabric: Fabric, table: PortTable, events: bpf.Map, origins: bpf.Map,
                 sends: bpf.Map, history: bpf.Map):
        self.fabric = fabric
        self.table = table
        self.events = events
        self.origins = origins
        self.sends = sends
        self.history = history
        self.sender: subprocess.Popen | None = None
        self.slots = slots(fabric)
        self.slot_of = {(s.node, s.port): i for i, s in enumerate(self.slots)}
        self.transports: dict[str, int] = {}    # host -> GPU agents running there

    @classmethod
    def attach(cls, fabric: Fabric, host_pids: dict[str, int], queue_params,
               pin_dir: Path = PIN_DIR, stubs: dict[tuple[str, int], str] | None = None
               ) -> "Dataplane":
        """stubs: on one machine of several, the interface standing in here for each
        other machine's switch port at the end of a crossing link, by (switch, port)."""
        missing = [f"{s.node}:{s.port}" for s in slots(fabric)
                   if s.stub and (s.node, s.port) not in (stubs or {})]
        if missing:
            raise LabError(f"the data path has no interface for the far end of the links "
                           f"to {', '.join(missing)}, on other machines")
        why = unavailable()
        if why:
            raise LabError(f"the BPF data path cannot run here: {why}")
        obj = bpf.ElfObject(build())
        all_slots = slots(fabric)
        bpf.mount_bpffs()
        remove_pins(pin_dir)
        pin_dir.mkdir(parents=True)
        ports = bpf.Map.create(bpf.BPF_MAP_TYPE_ARRAY, 4, PORT_BYTES, len(all_slots),
                               flags=bpf.BPF_F_MMAPABLE, name="fl_ports")
        events = bpf.Map.create(bpf.BPF_MAP_TYPE_RINGBUF, 0, 0, EVENTS_BYTES,
                                name="fl_events")
        origins = bpf.Map.create(bpf.BPF_MAP_TYPE_LRU_HASH, ORIGIN_KEY_BYTES, ORIGIN_BYTES,
                                 ORIGINS, name="fl_origins")
        sends = bpf.Map.create(bpf.BPF_MAP_TYPE_RINGBUF, 0, 0, SENDS_BYTES, name="fl_sends")
        entries = history_entries(fabric)
        history = bpf.Map.create(bpf.BPF_MAP_TYPE_ARRAY, 4, HISTORY_BYTES,
                                 max(1, len(entries)) * PRIOS, flags=bpf.BPF_F_MMAPABLE,
                                 name="fl_history")
        ports.pin(pin_dir / "ports")
        events.pin(pin_dir / "events")
        origins.pin(pin_dir / "origins")
        sends.pin(pin_dir / "sends")
        history.pin(pin_dir / "history")
        dp = cls(fabric, PortTable(ports), events, origins, sends, history)
        for s in dp.slots:
            if s.stub:
                s.intf = stubs[(s.node, s.port)]
        dp.set_link_rates(fabric)
        dpid = {sw.name: sw.dpid for sw in fabric.switches}
        peer = peers(fabric)
        for i, s in enumerate(all_slots):
            dp.table.set_role(i, peer[i] if all_slots[peer[i]].switch else NO_SLOT, s.role)
            dp.table.set_history(i, entries[i] // PRIOS if s.switch else NO_SLOT)
            if s.switch:
                dp.table.set_mac(i, socket.if_nametoindex(s.intf),
                                 pause.port_mac(dpid[s.node], s.port))
            dp.table.set_queues(i, queue_params.dscp_priority,
                                {p: queue_params.buffer_bytes(p) for p in queue_params.priorities}
                                if s.switch else {})
        dp._attach_programs(obj, host_pids)
        dp.start_sender(pin_dir)
        return dp

    def set_link_rates(self, fabric: Fabric) -> None:
        """Each port's link rate as the programs need it (a pause quantum's time), from
        the fabric's links: at the start, and after their rates changed in place."""
        rate = {(end, port): ln.rate_mbps for ln in fabric.links
                for end, port in ((ln.a, ln.a_port), (ln.b, ln.b_port))}
        for i, s in enumerate(self.slots):
            self.table.set_link(i, rate[(s.node, s.port)])

    def start_sender(self, pin_dir: Path) -> None:
        """The process that sends the PFC frames the programs hand over (an XON decided
        on a host's end of a link: lab/kernel/pfc_sender.c), recorded for cleanup."""
        exe = build_sender()
        self.sender = subprocess.Popen([str(exe), str(pin_dir)], stdin=subprocess.DEVNULL)
        state.record_process(self.sender.pid, exe.name, "pfc-sender")

    def stop_sender(self) -> None:
        """Stops the sender; says so if it had stopped by itself (its errors went to
        the lab's stderr): XONs from hosts' ends then waited for the controller's
        reconciliation (every 100 ms)."""
        if self.sender is None:
            return
        died = self.sender.poll()
        if died is None:
            self.sender.terminate()
            self.sender.wait(timeout=5)
        else:
            log.warning("the PFC sender (pid %d) had exited with code %s during the run",
                        self.sender.pid, died)
        self.sender = None

    def _load(self, obj: bpf.ElfObject) -> dict[str, int]:
        """The two programs, loaded once: every port's attachment shares them."""
        maps = {"ports": self.table.map.fd, "events": self.events.fd,
                "origins": self.origins.fd, "sends": self.sends.fd,
                "history": self.history.fd}
        progs: dict[str, int] = {}
        try:
            for section in ("tc/ingress", "tc/egress"):
                progs[section] = obj.load(section, maps, name=f"fl_{section[3:]}")
        except BaseException:
            for fd in progs.values():
                os.close(fd)
            raise
        return progs

    def _attach_programs(self, obj: bpf.ElfObject, host_pids: dict[str, int]) -> None:
        progs = self._load(obj)
        root = tcnl.Netlink()
        per_ns: dict[str, tcnl.Netlink] = {}
        try:
            for i, s in enumerate(self.slots):
                if s.switch or s.stub:      # the switches' namespace: this one
                    self._attach(progs, i, root, socket.if_nametoindex(s.intf))
                    continue
                pid = host_pids[s.node]
                if s.node not in per_ns:
                    per_ns[s.node] = tcnl.Netlink(netns.socket_in_netns(
                        pid, socket.SOCK_RAW, tcnl.NETLINK_ROUTE, family=socket.AF_NETLINK))
                self._attach(progs, i, per_ns[s.node], netns.ifindex_in_netns(pid, s.intf))
        finally:
            root.close()
            for nl in per_ns.values():
                nl.close()
            for fd in progs.values():     # the attachments hold the programs
                os.close(fd)

    def _attach(self, progs: dict[str, int], slot: int, nl: tcnl.Netlink,
                ifindex: int) -> None:
        """A link end's programs: ingress everywhere, egress on a switch port; the
        filter's classid tells them the slot."""
        nl.add_clsact(ifindex)
        hooks = [("tc/ingress", tcnl.CLSACT_INGRESS)]
        if self.slots[slot].switch:
            hooks.append(("tc/egress", tcnl.CLSACT_EGRESS))
        for section, hook in hooks:
            nl.attach_bpf(ifindex, hook, progs[section], f"{NAME_PREFIX}{section[3:]}",
                          classid=slot)

    def reattach_host(self, host: str, pid: int | None) -> None:
        """A GPU host's NIC moved to another namespace (pid's; None: the root one, as
        Soft-RoCE needs): the move shut its qdiscs down, programs included, and the
        switch port feeding it would count what it sends as never leaving."""
        progs = self._load(bpf.ElfObject(build()))
        try:
            for i, s in enumerate(self.slots):
                if s.node != host:
                    continue
                if pid is None:
                    nl, ifindex = tcnl.Netlink(), socket.if_nametoindex(s.intf)
                else:
                    nl = tcnl.Netlink(netns.socket_in_netns(pid, socket.SOCK_RAW,
                                                            tcnl.NETLINK_ROUTE,
                                                            family=socket.AF_NETLINK))
                    ifindex = netns.ifindex_in_netns(pid, s.intf)
                try:
                    self._attach(progs, i, nl, ifindex)
                finally:
                    nl.close()
        finally:
            for fd in progs.values():
                os.close(fd)

    def counters(self, node: str, port: int, prio: int) -> dict[str, int]:
        return self.table.counters(self.slot_of[(node, port)], prio)

    def transport_honours_pauses(self, host: str, on: bool) -> None:
        """A GPU agent's transport on `host` starts (on) or stops. While one runs, it is
        the host's NIC for RoCE data and stops that priority itself when a pause frame
        arrives (traffic/nic.py), as a MAC does, so the controller closes no kernel
        gate for it (two netlink changes and a wake-up per pause cycle per host: most
        of the controller's CPU in the incast). Counted per host: a second set of
        agents (background traffic) may run beside the first."""
        n = self.transports.get(host, 0) + (1 if on else -1)
        self.transports[host] = max(0, n)
        for i, s in enumerate(self.slots):
            if s.node == host:
                self.table.set_nic_honours(i, PRIORITY_ROCE_DATA, n > 0)

    def port_counters(self, prio: int) -> dict[str, dict[str, int]]:
        """The counters of `prio` on every switch port here, by "switch:port"."""
        return {f"{s.node}:{s.port}": self.table.counters(i, prio)
                for i, s in enumerate(self.slots) if s.switch}

    def lost_inside(self, switch: str, prio: int) -> int:
        """Frames of `prio` that entered `switch` and reached none of its egress ports
        (neither queued nor dropped there): lost inside the switch itself, e.g. by OVS's
        user space. Exact once the switch is idle; in flight otherwise."""
        entered = left = 0
        for i, s in enumerate(self.slots):
            if s.node == switch:
                c = self.table.counters(i, prio)
                entered += c["rx_packets"]
                # (a frame trimmed here queued in another priority: it left this one)
                left += c["in_packets"] + c["drop_packets"] + c["trimmed"]
        return entered - left

    def close(self) -> None:
        self.stop_sender()
        self.table.close()
        self.events.close()
        self.origins.close()
        self.sends.close()
        self.history.close()


def pinned(pin_dir: Path = PIN_DIR) -> list[str]:
    return sorted(str(f) for f in pin_dir.iterdir()) if pin_dir.is_dir() else []


def remove_pins(pin_dir: Path = PIN_DIR) -> list[str]:
    """Unpin the lab's maps (the kernel frees them once nothing else holds them)."""
    if not pin_dir.exists():
        return []
    removed = []
    for f in pin_dir.iterdir():
        f.unlink()
        removed.append(str(f))
    pin_dir.rmdir()
    return removed
