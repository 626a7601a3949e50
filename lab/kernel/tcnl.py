"""Queue statistics and queue gates over raw rtnetlink: the lab's fast path to tc.

Telemetry samples every few milliseconds and PFC must act within a couple: a
`tc` subprocess costs ~4 ms and pyroute2's per-interface dump is slower still
(platform notes), while one RTM_GETQDISC dump of every qdisc, parsed with
`struct`, takes well under a millisecond. Only what the lab reads is parsed:
the generic counters (TCA_STATS), RED's mark counter (TCA_XSTATS) and a tbf's
rate (its gate state, see lab/kernel/queues.py).
"""
from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

NETLINK_ROUTE = 0
RTM_NEWQDISC, RTM_GETQDISC, RTM_NEWTFILTER = 36, 38, 44
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLM_F_EXCL, NLM_F_CREATE = 0x200, 0x400
NLMSG_ERROR, NLMSG_DONE = 2, 3
TCA_KIND, TCA_OPTIONS, TCA_STATS, TCA_XSTATS = 1, 2, 3, 4
TCA_TBF_PARMS, TCA_TBF_BURST = 1, 6
TC_LINKLAYER_ETHERNET = 1
TC_H_CLSACT = 0xFFFFFFF1
CLSACT_INGRESS, CLSACT_EGRESS = 0xFFFFFFF2, 0xFFFFFFF3
TCA_BPF_CLASSID, TCA_BPF_FD, TCA_BPF_NAME, TCA_BPF_FLAGS = 3, 6, 7, 8
TCA_BPF_FLAG_ACT_DIRECT = 1
ETH_P_ALL = 0x0003

_NLMSG = struct.Struct("=IHHII")      # length, type, flags, sequence, port id
_TCMSG = struct.Struct("=BxxxiIII")   # family, ifindex, handle, parent, info
_RTA = struct.Struct("=HH")           # attribute length, type
# struct tc_stats: bytes, packets, drops, overlimits, bps, pps, qlen, backlog
_TC_STATS = struct.Struct("=QIIIIIII")
_RED_XSTATS = struct.Struct("=IIII")  # early, pdrop, other, marked
_RATESPEC = struct.Struct("=BBHhHI")  # cell_log, linklayer, overhead, cell_align, mpu, rate (B/s)
_TBF_QOPT = struct.Struct("=12s12sIII")   # rate, peakrate, limit, buffer (ticks), mtu


@dataclass
class QdiscStats:
    ifindex: int
    handle: int
    parent: int
    kind: str
    bytes: int
    packets: int
    drops: int
    overlimits: int
    qlen: int
    backlog_bytes: int
    marked: int = 0            # RED: packets ECN-marked
    rate_bytes_s: int = 0      # tbf: its configured rate


def handle(major: int, minor: int = 0) -> int:
    return (major << 16) | minor


def _attrs(buf: bytes, start: int, end: int):
    while start + 4 <= end:
        length, kind = _RTA.unpack_from(buf, start)
        if length < 4:
            return
        yield kind & 0x3FFF, start + 4, start + length
        start += (length + 3) & ~3


def _attr(kind: int, payload: bytes) -> bytes:
    data = _RTA.pack(4 + len(payload), kind) + payload
    return data + b"\0" * (-len(data) % 4)


class Netlink:
    """One rtnetlink socket of the calling thread's network namespace."""

    def __init__(self, sock: socket.socket | None = None):
        """sock: an AF_NETLINK NETLINK_ROUTE socket made in another namespace
        (lab/kernel/netns.py); by default one in the caller's."""
        self.sock = sock or socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.sock.bind((0, 0))
        self.seq = 0

    def close(self) -> None:
        self.sock.close()

    def _request(self, msg_type: int, flags: int, body: bytes) -> int:
        self.seq += 1
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(body), msg_type, flags, self.seq,
                                   0) + body)
        return self.seq

    def _replies(self, seq: int):
        """Yield (type, buffer, payload start, payload end) until the reply ends."""
        while True:
            buf = self.sock.recv(1 << 20)
            pos = 0
            while pos + _NLMSG.size <= len(buf):
                length, mtype, _, mseq, _ = _NLMSG.unpack_from(buf, pos)
                if length < _NLMSG.size:
                    return
                if mseq == seq:
                    if mtype == NLMSG_DONE:
                        return
                    if mtype == NLMSG_ERROR:
                        err = struct.unpack_from("=i", buf, pos + _NLMSG.size)[0]
                        if err:
                            raise OSError(-err, os.strerror(-err))
                        return
                    yield mtype, buf, pos + _NLMSG.size, pos + length
                pos += (length + 3) & ~3

    def qdiscs(self) -> list[QdiscStats]:
        """Every qdisc of the namespace with its counters, in one dump."""
        seq = self._request(RTM_GETQDISC, NLM_F_REQUEST | NLM_F_DUMP, _TCMSG.pack(0, 0, 0, 0, 0))
        out = []
        for _, buf, start, end in self._replies(seq):
            _, ifindex, hnd, parent, _ = _TCMSG.unpack_from(buf, start)
            kind, stats, marked, rate = "", None, 0, 0
            for atype, a, b in _attrs(buf, start + _TCMSG.size, end):
                if atype == TCA_KIND:
                    kind = buf[a:b].rstrip(b"\0").decode()
                elif atype == TCA_STATS:
                    stats = _TC_STATS.unpack_from(buf, a)
                elif atype == TCA_XSTATS and b - a >= _RED_XSTATS.size:
                    marked = _RED_XSTATS.unpack_from(buf, a)[3]
                elif atype == TCA_OPTIONS:
                    for otype, oa, _ in _attrs(buf, a, b):
                        if otype == TCA_TBF_PARMS:
                            rate = _RATESPEC.unpack_from(buf, oa)[5]
            if stats is None:
                continue
            nbytes, packets, drops, overlimits, _, _, qlen, backlog = stats
            out.append(QdiscStats(ifindex, hnd, parent, kind, nbytes, packets, drops,
                                  overlimits, qlen, backlog,
                                  marked if kind == "red" else 0,
                                  rate if kind == "tbf" else 0))
        return out

    def set_tbf(self, ifindex: int, parent: int, hnd: int, rate_bytes_s: int,
                burst_bytes: int, limit_bytes: int, wait: bool = True) -> int:
        """Change an existing tbf's rate in place. The kernel resets its tokens on a
        change and keeps its queue: what a PFC gate needs. wait=False returns the
        request's sequence number for `wait()`, so changes in several namespaces
        proceed together."""
        rate = _RATESPEC.pack(0, TC_LINKLAYER_ETHERNET, 0, -1, 0, rate_bytes_s)
        qopt = _TBF_QOPT.pack(rate, b"\0" * _RATESPEC.size, limit_bytes, 0, 0)
        options = _attr(TCA_TBF_PARMS, qopt) + _attr(TCA_TBF_BURST,
                                                     struct.pack("=I", burst_bytes))
        body = (_TCMSG.pack(socket.AF_UNSPEC, ifindex, hnd, parent, 0)
                + _attr(TCA_KIND, b"tbf\0") + _attr(TCA_OPTIONS, options))
        seq = self._request(RTM_NEWQDISC, NLM_F_REQUEST | NLM_F_ACK, body)
        if wait:
            self.wait(seq)
        return seq

    def add_clsact(self, ifindex: int) -> None:
        """The clsact hooks of a device (where tc BPF programs attach); kept if present."""
        body = (_TCMSG.pack(socket.AF_UNSPEC, ifindex, 0xFFFF0000, TC_H_CLSACT, 0)
                + _attr(TCA_KIND, b"clsact\0"))
        try:
            self.wait(self._request(RTM_NEWQDISC, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
                                    | NLM_F_EXCL, body))
        except FileExistsError:
            pass

    def attach_bpf(self, ifindex: int, hook: int, prog_fd: int, name: str,
                   classid: int = 0) -> None:
        """A direct-action tc BPF program on a clsact hook (CLSACT_INGRESS/_EGRESS), for
        every protocol, as `tc filter add dev X egress bpf da classid C ...` does: the
        program reads `classid` as skb->tc_classid (one program, many attachments)."""
        options = (_attr(TCA_BPF_CLASSID, struct.pack("=I", classid))
                   + _attr(TCA_BPF_FD, struct.pack("=I", prog_fd))
                   + _attr(TCA_BPF_NAME, name.encode() + b"\0")
                   + _attr(TCA_BPF_FLAGS, struct.pack("=I", TCA_BPF_FLAG_ACT_DIRECT)))
        info = (1 << 16) | socket.htons(ETH_P_ALL)     # filter priority 1, every protocol
        body = (_TCMSG.pack(socket.AF_UNSPEC, ifindex, 1, hook, info)
                + _attr(TCA_KIND, b"bpf\0") + _attr(TCA_OPTIONS, options))
        self.wait(self._request(RTM_NEWTFILTER, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE
                                | NLM_F_EXCL, body))

    def wait(self, seq: int) -> None:
        """Until the kernel acknowledges request `seq` (raises its error)."""
        for _ in self._replies(seq):
            pass
