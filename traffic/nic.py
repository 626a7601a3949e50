"""A GPU's NIC: one wire (or one per plane), its queue pairs, pacing at the line rate,
one loop.

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

from traffic import clock, pause
from traffic.constants import (DSCP_PRIORITY, MAC_CONTROL_ETHERTYPE, PFC_PRIORITY_COUNT,
                               PRIORITY_ROCE_DATA, ROCE_V2_UDP_PORT)
from traffic.qp import PACE_AHEAD_S, QueuePair
from traffic.roce import ETH_P_IP, Malformed, mac_bytes, parse

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


class Port:
    """One port of a NIC: its wire, paced at the port's rate, paused as its link says.
    A NIC split into planes has one per plane (one link each, paced and paused on its
    own); a frame leaves by the port whose MAC it carries as its source."""

    def __init__(self, wire, rate_mbps: float, plane: int = 0):
        self.wire = wire
        self.plane = plane
        self.rate_bps = rate_mbps * 1e6
        self.ctrl: collections.deque[bytes] = collections.deque()   # responses to send
        self.next_tx = 0.0
        self.stalled: bytes | None = None
        # PFC, as a NIC honours it: a paused priority sends nothing until the time
        # runs out or a resume (time 0) arrives; other priorities keep going.
        self.paused_until = [0.0] * PFC_PRIORITY_COUNT


class Nic:
    def __init__(self, wire, rate_mbps: float, ext_bytes: dict[int, int] | None = None):
        self.ports = [Port(wire, rate_mbps)]
        self.by_mac: dict[bytes, Port] = {}     # a multi-plane NIC's ports by source MAC
        self.ext_bytes = ext_bytes
        self.qps: dict[int, QueuePair] = {}
        self.rr: collections.deque[int] = collections.deque()
        self.malformed = 0
        self.unknown_qp = 0
        self.pause_frames_received = 0           # on every port together
        self.paused_s = [0.0] * PFC_PRIORITY_COUNT
        self.pause_log: list[tuple[float, int]] = []   # (wall time, quanta) of the first ones

    def add_plane(self, wire, rate_mbps: float, mac: str, plane0_mac: str) -> Port:
        """One more port, for the next plane (a multi-plane NIC): its frames carry `mac`
        as their source (`plane0_mac`: the first port's)."""
        if not self.by_mac:
            self.by_mac[mac_bytes(plane0_mac)] = self.ports[0]
        port = Port(wire, rate_mbps, len(self.ports))
        self.ports.append(port)
        self.by_mac[mac_bytes(mac)] = port
        return port

    # the first port's, which is the only one but on a multi-plane NIC
    @property
    def wire(self):
        return self.ports[0].wire

    @property
    def rate_bps(self) -> float:
        return self.ports[0].rate_bps

    @property
    def paused_until(self) -> list[float]:
        return self.ports[0].paused_until

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
        return all(p.stalled is None and not p.ctrl for p in self.ports)

    def responding(self) -> bool:
        """Responses wait to go out."""
        return any(p.ctrl for p in self.ports)

    def _respond(self, frames: list[bytes]) -> None:
        """Responses join the queue of the port whose MAC they carry."""
        for frame in frames:
            port = self.by_mac.get(frame[6:12], self.ports[0]) if self.by_mac \
                else self.ports[0]
            port.ctrl.append(frame)

    # --- one turn of the loop ------------------------------------------------------
    def receive(self, now: float, ready: set[int] | None = None) -> int:
        """Take in what arrived; `ready`: the fds poll() reported (None: try all)."""
        n = 0
        for port in self.ports:
            frames = port.wire.recv_all(ready)
            for frame in frames:
                self.deliver(frame, now, port)
            n += len(frames)
        return n

    def deliver(self, frame: bytes, now: float, port: Port | None = None) -> None:
        port = port or self.ports[0]
        if pause.is_mac_control(frame):
            self.on_pause(frame, now, port)
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
        p.plane = port.plane
        try:
            self._respond(qp.on_packet(p, now))
        except (IndexError, ValueError):
            self.malformed += 1   # e.g. a write outside the region: drop it, keep running

    def on_pause(self, frame: bytes, now: float, port: Port | None = None) -> None:
        """802.1Qbb PFC (per priority) or 802.3x PAUSE (every priority): for the port
        it came in on."""
        port = port or self.ports[0]
        quanta = pause.parse(frame)
        if quanta is None:
            self.malformed += 1
            return
        self.pause_frames_received += 1
        if len(self.pause_log) < PAUSE_LOG_MAX:
            self.pause_log.append((clock.now(), max(quanta.values(), default=0)))
        quantum_s = pause.quantum_s(port.rate_bps)
        for prio, q in quanta.items():
            was = max(0.0, port.paused_until[prio] - now)
            port.paused_until[prio] = now + q * quantum_s
            self.paused_s[prio] += max(0.0, port.paused_until[prio] - now) - was

    def paused_now(self, now: float) -> bool:
        """Some priority of some port is paused."""
        return any(now < t for p in self.ports for t in p.paused_until)

    @staticmethod
    def paused(port: Port, frame: bytes, now: float) -> bool:
        prio = DSCP_PRIORITY.get(frame[15] >> 2, 0)
        return now < port.paused_until[prio]

    def transmit(self, now: float) -> None:
        ready = []
        for port in self.ports:
            while port.ctrl:                   # responses first, unpaced (they are small)
                if self.paused(port, port.ctrl[0], now) or not port.wire.send(port.ctrl[0]):
                    break
                port.ctrl.popleft()
            if now >= port.paused_until[PRIORITY_ROCE_DATA]:   # (all data is RoCE)
                ready.append(port)
        # one data frame from each port in turn: a window the planes share evenly
        while ready:
            ready = [port for port in ready if self._send_data(port, now)]

    def _send_data(self, port: Port, now: float) -> bool:
        """A data frame out of `port` if its pacing lets it; whether it may send more."""
        if now + PACE_AHEAD_S < port.next_tx:
            return False
        frame = port.stalled or self._next_data(now, port.plane)
        if frame is None:
            return False
        if not port.wire.send(frame):
            port.stalled = frame
            port.next_tx = now + 0.0002
            return False
        port.stalled = None
        port.next_tx = max(port.next_tx, now - 0.001) + len(frame) * 8 / port.rate_bps
        return True

    def _next_data(self, now: float, plane: int) -> bytes | None:
        for _ in range(len(self.rr)):
            qpn = self.rr[0]
            self.rr.rotate(-1)
            qp = self.qps[qpn]
            if qp.pending(now) and qp.sends_on(plane, now):
                return qp.next_frame(now, plane)
        return None

    def timers(self, now: float) -> float:
        """Fire due QP timers (what they answer joins the responses); return the time of
        the next event to wake for."""
        wake = now + 0.05
        for qp in self.qps.values():
            dl = qp.deadline()
            if dl is not None:
                if dl <= now:
                    self._respond(qp.on_timer(now))
                    dl = qp.deadline()
                if dl is not None:
                    wake = min(wake, dl)
        for port in self.ports:                # a port with data for it: when it may send
            if port.stalled is not None or any(qp.pending(now) and qp.sends_on(port.plane, now)
                                               for qp in self.qps.values()):
                wake = min(wake, max(port.next_tx, now, port.paused_until[PRIORITY_ROCE_DATA]))
        for qp in self.qps.values():       # a QP held back by its own rate (DCQCN)
            if qp.paced(now) and not qp.idle():
                wake = min(wake, qp.next_tx)
        return wake


def drive(nics: list[Nic], done: Callable[[], bool], timeout_s: float,
          wake_fds: tuple[int, ...] = ()) -> bool:
    """Run a host's NICs until done() or the timeout; returns done(). Input on
    `wake_fds` wakes the loop (to check done() at once) without being read."""
    poller = select.poll()
    for fd in [fd for nic in nics for port in nic.ports for fd in port.wire.filenos()] + \
            list(wake_fds):
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
        busy = any(nic.responding() or any(qp.events for qp in nic.qps.values()) for nic in nics)
        events = poller.poll(0 if busy else max(0.0, (wake - time.monotonic()) * 1000))
        ready = {fd for fd, _ in events}
    return True
