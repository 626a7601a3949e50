"""A GPU's NIC: one wire, its queue pairs, pacing at the line rate, one loop.

The wire is an AF_PACKET socket on the host's interface (`PacketWire`) or, in
unit tests, an in-memory link (`MemoryWire`). Received frames are demultiplexed
to QPs by destination QP number; responses (ACK, NAK, SACK) go out ahead of
data; data leaves paced at `rate_mbps`, the QPs taking turns. If the kernel
queue is full (ENOBUFS) the frame is kept and retried: a NIC never drops its
own packets.
"""
from __future__ import annotations

import collections
import errno
import select
import socket
import time
from collections.abc import Callable

from traffic import pause
from traffic.constants import (DSCP_PRIORITY, MAC_CONTROL_ETHERTYPE, PFC_PRIORITY_COUNT,
                               PRIORITY_ROCE_DATA, ROCE_V2_UDP_PORT)
from traffic.qp import PACE_AHEAD_S, QueuePair
from traffic.roce import ETH_P_IP, Malformed, parse

PAUSE_LOG_MAX = 2000              # when pause frames arrived: for reaction-time measurements
SOL_PACKET = 263
PACKET_IGNORE_OUTGOING = 23
SO_RCVBUFFORCE = 33               # Linux; Python's socket module does not name it
# The emulated link is an htb class, which counts frame bytes (no preamble, FCS or
# inter-frame gap): pacing counts the same, so the NIC fills exactly its link.


class SocketWire:
    """A wire over a non-blocking datagram socket: one frame per datagram."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.sock.setblocking(False)

    def filenos(self) -> list[int]:
        return [self.sock.fileno()]

    def send(self, frame: bytes) -> bool:
        try:
            self.sock.send(frame)
            return True
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.ENOBUFS):   # queue full: try again later
                return False
            raise

    def recv_all(self, ready: set[int] | None = None, limit: int = 256) -> list[bytes]:
        """Frames waiting on the socket; none if `ready` (the fds poll() reported)
        leaves it out: no system call, no exception for an empty socket."""
        out = []
        if ready is not None and self.sock.fileno() not in ready:
            return out
        for _ in range(limit):
            try:
                out.append(self.sock.recv(4096))
            except BlockingIOError:
                break
        return out


class PacketWire(SocketWire):
    """Raw AF_PACKET sockets on one interface (inside the caller's namespace): one for
    IPv4 (RoCE v2), one for MAC Control (pause frames). Bound to those protocols, not
    to all: an all-protocol tap sees frames before the ingress hook, so it would
    receive what an nftables loss rule drops."""

    def __init__(self, intf: str, ip: str, rcvbuf_bytes: int = 64 << 20):
        super().__init__(self._bound(intf, ETH_P_IP, rcvbuf_bytes))
        self.control = self._bound(intf, MAC_CONTROL_ETHERTYPE, 1 << 20)
        self.control.setblocking(False)
        # The host kernel also sees the UDP 4791 frames; holding the port stops it
        # answering each with an ICMP port unreachable. Nothing reads this socket.
        # (Shared: a host may run a second agent, e.g. for background traffic.)
        self.holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.holder.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.holder.bind((ip, ROCE_V2_UDP_PORT))

    @staticmethod
    def _bound(intf: str, proto: int, rcvbuf_bytes: int) -> socket.socket:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(proto))
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf_bytes)
        sock.bind((intf, 0))
        return sock

    def filenos(self) -> list[int]:
        return [self.sock.fileno(), self.control.fileno()]

    def recv_all(self, ready: set[int] | None = None, limit: int = 256) -> list[bytes]:
        out = []
        if ready is None or self.control.fileno() in ready:
            for _ in range(8):
                try:
                    out.append(self.control.recv(4096))
                except BlockingIOError:
                    break
        return out + super().recv_all(ready, limit)

    def close(self) -> None:
        for sock in (self.sock, self.control, self.holder):
            sock.close()


class Nic:
    def __init__(self, wire, rate_mbps: float, ext_bytes: dict[int, int] | None = None):
        self.wire = wire
        self.rate_bps = rate_mbps * 1e6
        self.ext_bytes = ext_bytes
        self.qps: dict[int, QueuePair] = {}
        self.ctrl: collections.deque[bytes] = collections.deque()
        self.next_tx = 0.0
        self.rr: collections.deque[int] = collections.deque()
        self.malformed = 0
        self.unknown_qp = 0
        self.stalled: bytes | None = None
        # PFC, as a NIC honours it: a paused priority sends nothing until the time
        # runs out or a resume (time 0) arrives; other priorities keep going.
        self.paused_until = [0.0] * PFC_PRIORITY_COUNT
        self.pause_frames_received = 0
        self.paused_s = [0.0] * PFC_PRIORITY_COUNT
        self.pause_log: list[tuple[float, int]] = []   # (wall time, quanta) of the first ones

    def add(self, qp: QueuePair) -> QueuePair:
        self.qps[qp.qpn] = qp
        self.rr.append(qp.qpn)
        return qp

    def abort(self) -> None:
        """Every QP to the error state (its collective ran out of time): nothing more
        is scheduled. A frame already taken from a QP (counted as sent) and the
        responses already made still go out, so the QPs' counters match the wire."""
        self.qps.clear()
        self.rr.clear()

    def flushed(self) -> bool:
        return self.stalled is None and not self.ctrl

    # --- one turn of the loop ------------------------------------------------------
    def receive(self, now: float, ready: set[int] | None = None) -> int:
        """Take in what arrived; `ready`: the fds poll() reported (None: try all)."""
        frames = self.wire.recv_all(ready)
        for frame in frames:
            self.deliver(frame, now)
        return len(frames)

    def deliver(self, frame: bytes, now: float) -> None:
        if pause.is_mac_control(frame):
            self.on_pause(frame, now)
            return
        try:
            p = parse(frame, self.ext_bytes)
        except Malformed:
            self.malformed += 1
            return
        if p is None:
            return
        qp = self.qps.get(p.dqpn)
        if qp is None:
            self.unknown_qp += 1
            return
        try:
            self.ctrl.extend(qp.on_packet(p, now))
        except (IndexError, ValueError):
            self.malformed += 1   # e.g. a write outside the region: drop it, keep running

    def on_pause(self, frame: bytes, now: float) -> None:
        """802.1Qbb PFC (per priority) or 802.3x PAUSE (every priority)."""
        quanta = pause.parse(frame)
        if quanta is None:
            self.malformed += 1
            return
        self.pause_frames_received += 1
        if len(self.pause_log) < PAUSE_LOG_MAX:
            self.pause_log.append((time.time(), max(quanta.values(), default=0)))
        quantum_s = pause.quantum_s(self.rate_bps)
        for prio, q in quanta.items():
            was = max(0.0, self.paused_until[prio] - now)
            self.paused_until[prio] = now + q * quantum_s
            self.paused_s[prio] += max(0.0, self.paused_until[prio] - now) - was

    def paused_now(self, now: float) -> bool:
        """Some priority is paused."""
        return any(now < t for t in self.paused_until)

    def paused(self, frame: bytes, now: float) -> bool:
        prio = DSCP_PRIORITY.get(frame[15] >> 2, 0)
        return now < self.paused_until[prio]

    def transmit(self, now: float) -> None:
        while self.ctrl:                       # responses first, unpaced (they are small)
            if self.paused(self.ctrl[0], now) or not self.wire.send(self.ctrl[0]):
                break
            self.ctrl.popleft()
        if now < self.paused_until[PRIORITY_ROCE_DATA]:
            return                             # all data is RoCE: its priority is paused
        while now + PACE_AHEAD_S >= self.next_tx:
            frame = self.stalled or self._next_data(now)
            if frame is None:
                return
            if not self.wire.send(frame):
                self.stalled = frame
                self.next_tx = now + 0.0002
                return
            self.stalled = None
            wire_bits = len(frame) * 8
            self.next_tx = max(self.next_tx, now - 0.001) + wire_bits / self.rate_bps

    def _next_data(self, now: float) -> bytes | None:
        for _ in range(len(self.rr)):
            qpn = self.rr[0]
            self.rr.rotate(-1)
            qp = self.qps[qpn]
            if qp.pending(now):
                return qp.next_frame(now)
        return None

    def timers(self, now: float) -> float:
        """Fire due QP timers (what they answer joins the responses); return the time of
        the next event to wake for."""
        wake = now + 0.05
        for qp in self.qps.values():
            dl = qp.deadline()
            if dl is not None:
                if dl <= now:
                    self.ctrl.extend(qp.on_timer(now))
                    dl = qp.deadline()
                if dl is not None:
                    wake = min(wake, dl)
        if self.stalled is not None or any(qp.pending(now) for qp in self.qps.values()):
            wake = min(wake, max(self.next_tx, now, self.paused_until[PRIORITY_ROCE_DATA]))
        for qp in self.qps.values():       # a QP held back by its own rate (DCQCN)
            if qp.paced(now) and not qp.idle():
                wake = min(wake, qp.next_tx)
        return wake


def drive(nics: list[Nic], done: Callable[[], bool], timeout_s: float,
          wake_fds: tuple[int, ...] = ()) -> bool:
    """Run a host's NICs until done() or the timeout; returns done(). Input on
    `wake_fds` wakes the loop (to check done() at once) without being read."""
    poller = select.poll()
    for fd in [fd for nic in nics for fd in nic.wire.filenos()] + list(wake_fds):
        poller.register(fd, select.POLLIN)
    end = time.monotonic() + timeout_s
    ready = None                          # the first turn reads every socket
    while not done():
        now = time.monotonic()
        if now > end:
            return False
        wake = end
        for nic in nics:
            nic.receive(now, ready)
            nic.transmit(now)
            wake = min(wake, nic.timers(now))
        # Work left for now: responses to send, or QP events (a message sent or
        # received) that done() has yet to hand to the collective: sleeping now
        # would hold them until the next frame or timer (measured: 50 ms per message).
        busy = any(nic.ctrl or any(qp.events for qp in nic.qps.values()) for nic in nics)
        events = poller.poll(0 if busy else max(0.0, (wake - time.monotonic()) * 1000))
        ready = {fd for fd, _ in events}
    return True
