"""Collectives as step machines over a NIC's queue pairs, on real values.

Each collective posts RDMA WRITEs into its peers' receive regions and reacts to
the messages that complete in its own ("received", tag, nbytes). A message's tag
names the step, so a step's data lands in its own slot and never overwrites one
still being read.

Ring all-reduce over n ranks (reduce-scatter then all-gather, 2(n-1) steps): the
data is cut into n chunks; at reduce-scatter step s rank r sends chunk r-s to
its right neighbour and adds the chunk r-s-1 arriving from its left; after n-1
steps it owns the fully reduced chunk r+1, and all-gather passes the reduced
chunks around the ring the same way.
"""
from __future__ import annotations

import base64
import zlib

import numpy as np

from traffic.qp import QueuePair, Region


def chunk_bounds(n_elems: int, n: int) -> list[tuple[int, int]]:
    """n contiguous [start, end) element ranges covering the data, as even as can be."""
    edges = np.linspace(0, n_elems, n + 1).round().astype(int)
    return list(zip(edges[:-1], edges[1:]))


class RingAllReduce:
    """Rank `rank` of `n`: sends on `right` (a QP to rank+1), receives into `region`.

    Works in place on `buf`. `steps` runs a part of it: range(0, n-1) is the
    reduce-scatter alone (rank r then owns the reduced chunk `owned_chunk`),
    range(n-1, 2n-2) the all-gather alone: the hierarchical all-reduce uses both."""

    def __init__(self, rank: int, n: int, buf: np.ndarray, right: QueuePair | None,
                 left: QueuePair | None, region: Region, peer_va: int, peer_rkey: int,
                 steps: range | None = None):
        self.rank, self.n = rank, n
        self.buf = buf
        self.right, self.left, self.region = right, left, region
        self.peer_va, self.peer_rkey = peer_va, peer_rkey
        self.bounds = chunk_bounds(len(self.buf), n)
        self.slot_bytes = max(e - s for s, e in self.bounds) * 4
        self.steps = steps if steps is not None else range(2 * (n - 1))
        self.received = 0
        self.sent_acked = 0

    @staticmethod
    def region_bytes(n_elems: int, n: int) -> int:
        slot = max(e - s for s, e in chunk_bounds(n_elems, n)) * 4
        return max(1, 2 * (n - 1) * slot)

    @property
    def owned_chunk(self) -> int:
        """The chunk this rank holds fully reduced after the reduce-scatter."""
        return (self.rank + 1) % self.n

    def _send_chunk(self, s: int) -> int:
        return (self.rank - s) % self.n if s < self.n - 1 else \
            (self.rank + 1 - (s - (self.n - 1))) % self.n

    def _recv_chunk(self, s: int) -> int:
        return (self.rank - s - 1) % self.n if s < self.n - 1 else \
            (self.rank - (s - (self.n - 1))) % self.n

    def start(self, now: float) -> None:
        if len(self.steps):
            self._post(self.steps[0])

    def _post(self, s: int) -> None:
        lo, hi = self.bounds[self._send_chunk(s)]
        self.right.post_write(self.buf[lo:hi].tobytes(), self.peer_va + s * self.slot_bytes,
                              self.peer_rkey, tag=s)

    def on_event(self, qp: QueuePair, event: tuple, now: float) -> None:
        kind, s = event[0], event[1]
        if kind == "sent" and qp is self.right:
            self.sent_acked += 1
        elif kind == "received" and qp is self.left:
            lo, hi = self.bounds[self._recv_chunk(s)]
            incoming = np.frombuffer(self.region.buf, np.float32, hi - lo, s * self.slot_bytes)
            if s < self.n - 1:
                self.buf[lo:hi] += incoming
            else:
                self.buf[lo:hi] = incoming
            self.received += 1
            if s + 1 in self.steps:
                self._post(s + 1)

    def done(self) -> bool:
        return self.received == len(self.steps) and self.sent_acked == len(self.steps)

    def report(self, op: str) -> dict:
        return _result(self.buf, self.n, op)


class HierarchicalAllReduce:
    """All-reduce in three phases, as on GPU racks: reduce-scatter inside the rack over
    the fast scale-up links (local rank l of g ends with chunk l+1 summed over its rack),
    ring all-reduce of that chunk across the racks over scale-out, among the GPUs of
    the same local rank, then all-gather inside the rack. Scale-out carries only 1/g of
    the data: the win when scale-up is ~9x faster."""

    def __init__(self, local_rank: int, g: int, rack: int, racks: int, buf: np.ndarray,
                 up: tuple[QueuePair, QueuePair, Region], out: tuple[QueuePair, QueuePair, Region],
                 peer_va: int, rkey: int):
        self.buf, self.n = buf, g * racks
        self.up_qps = {id(up[0]), id(up[1])} if g > 1 else set()
        self.rs = RingAllReduce(local_rank, g, buf, *up, peer_va, rkey, steps=range(g - 1))
        lo, hi = self.rs.bounds[self.rs.owned_chunk]
        self.across = RingAllReduce(rack, racks, buf[lo:hi], *out, peer_va, rkey)
        self.ag = RingAllReduce(local_rank, g, buf, *up, peer_va, rkey,
                                steps=range(g - 1, 2 * (g - 1)))
        self.phases = [self.rs, self.across, self.ag]
        self.current = 0
        self.early: list[tuple] = []      # events of phases not started yet
        self.phase_times: list[float] = []   # start, then the end of each phase

    @staticmethod
    def region_bytes(n_elems: int, g: int, racks: int) -> tuple[int, int]:
        chunk = max(e - s for s, e in chunk_bounds(n_elems, g))
        return RingAllReduce.region_bytes(n_elems, g), RingAllReduce.region_bytes(chunk, racks)

    def _owner(self, qp: QueuePair, event: tuple):
        if id(qp) not in self.up_qps:
            return self.across
        return self.rs if event[1] in self.rs.steps else self.ag

    def start(self, now: float) -> None:
        self.phase_times = [now]
        self.rs.start(now)
        self._advance(now)

    def _advance(self, now: float) -> None:
        while self.phases[self.current].done() and len(self.phase_times) <= self.current + 1:
            self.phase_times.append(now)
            if self.current + 1 == len(self.phases):
                return
            self.current += 1
            self.phases[self.current].start(now)
            early, self.early = self.early, []
            for qp, event in early:
                self.on_event(qp, event, now)

    def on_event(self, qp: QueuePair, event: tuple, now: float) -> None:
        phase = self._owner(qp, event)
        if phase is not self.phases[self.current]:
            self.early.append((qp, event))     # a faster peer is a phase ahead of us
            return
        phase.on_event(qp, event, now)
        self._advance(now)

    def done(self) -> bool:
        return all(p.done() for p in self.phases)

    def report(self, op: str) -> dict:
        t = self.phase_times
        return {**_result(self.buf, self.n, op),
                "phase_s": {name: round(b - a, 4) for name, a, b in
                            zip(("scale-up reduce-scatter", "scale-out ring", "scale-up all-gather"),
                                t, t[1:])}}


class RingReduceScatter(RingAllReduce):
    """Reduce-scatter alone, in NCCL's convention: rank r ends with chunk r of the sum
    (chunk_bounds). The ring all-reduce's first n-1 steps, each rank playing the part of
    the rank before it, so that the chunk it owns at the end is its own."""

    def __init__(self, rank: int, n: int, buf: np.ndarray, right: QueuePair | None,
                 left: QueuePair | None, region: Region, peer_va: int, peer_rkey: int):
        super().__init__((rank - 1) % n, n, buf, right, left, region, peer_va, peer_rkey,
                         steps=range(n - 1))

    def report(self, op: str) -> dict:
        lo, hi = self.bounds[self.owned_chunk]
        return {**_result(self.buf[lo:hi], self.n, op), "chunk": self.owned_chunk}


class RingAllGather(RingAllReduce):
    """All-gather alone, in NCCL's convention: rank r contributes chunk r of the buffer
    (its place in `buf`, the rest ignored) and ends with every rank's. The ring
    all-reduce's last n-1 steps, each rank playing the part of the rank before it."""

    def __init__(self, rank: int, n: int, buf: np.ndarray, right: QueuePair | None,
                 left: QueuePair | None, region: Region, peer_va: int, peer_rkey: int):
        super().__init__((rank - 1) % n, n, buf, right, left, region, peer_va, peer_rkey,
                         steps=range(n - 1, 2 * (n - 1)))

    def report(self, op: str) -> dict:
        return _result(self.buf, 1, "sum")           # gathered, not reduced


class RingBroadcast:
    """The root's buffer to every rank, along the ring root, root+1, ..., root-1, cut into
    `pieces` so the ring pipelines: a rank passes each piece on as it arrives (the last
    rank only receives). Each link carries the buffer once: nccl-tests' busbw = algbw."""

    def __init__(self, rank: int, n: int, root: int, buf: np.ndarray, right: QueuePair | None,
                 left: QueuePair | None, region: Region, peer_va: int, peer_rkey: int,
                 pieces: int):
        self.n, self.buf = n, buf
        self.position = (rank - root) % n            # 0: the root; n-1: the ring's end
        self.right, self.left, self.region = right, left, region
        self.peer_va, self.peer_rkey = peer_va, peer_rkey
        self.bounds = chunk_bounds(len(buf), pieces)
        self.slot_bytes = max(e - s for s, e in self.bounds) * 4
        self.forwards = len(self.bounds) if self.position < n - 1 else 0
        self.receives = len(self.bounds) if self.position > 0 else 0
        self.received = self.sent_acked = 0

    @staticmethod
    def region_bytes(n_elems: int, pieces: int) -> int:
        return max(1, pieces * max(e - s for s, e in chunk_bounds(n_elems, pieces)) * 4)

    def _post(self, piece: int) -> None:
        lo, hi = self.bounds[piece]
        self.right.post_write(self.buf[lo:hi].tobytes(), self.peer_va + piece * self.slot_bytes,
                              self.peer_rkey, tag=piece)

    def start(self, now: float) -> None:
        if self.position == 0 and self.forwards:
            for piece in range(len(self.bounds)):
                self._post(piece)

    def on_event(self, qp: QueuePair, event: tuple, now: float) -> None:
        kind, piece = event[0], event[1]
        if kind == "sent" and qp is self.right:
            self.sent_acked += 1
        elif kind == "received" and qp is self.left:
            lo, hi = self.bounds[piece]
            self.buf[lo:hi] = np.frombuffer(self.region.buf, np.float32, hi - lo,
                                            piece * self.slot_bytes)
            self.received += 1
            if self.forwards:
                self._post(piece)

    def done(self) -> bool:
        return self.received == self.receives and self.sent_acked == self.forwards

    def report(self, op: str) -> dict:
        return _result(self.buf, 1, "sum")


def _result(buf: np.ndarray, n: int, op: str) -> dict:
    result = buf / n if op == "mean" else buf
    return {"result": base64.b64encode(result.astype(np.float32).tobytes()).decode()}


class TreeAllReduce:
    """Binary-tree all-reduce: every rank sums what its children send up (rank r's
    children are 2r+1 and 2r+2), passes the sum to its parent, and the root's total
    comes back down the same tree. 2 log2(n) steps of the whole vector: fewer steps
    than the ring (better for small messages), but each link carries all of it."""

    UP, DOWN = 0, 1     # message tags

    def __init__(self, rank: int, n: int, data: np.ndarray, qps: dict[int, QueuePair],
                 region: Region, peer_va: int, peer_rkey: int):
        self.rank, self.n = rank, n
        self.buf = data
        self.qps, self.region = qps, region
        self.peer_va, self.peer_rkey = peer_va, peer_rkey
        self.parent = (rank - 1) // 2 if rank else None
        self.children = [c for c in (2 * rank + 1, 2 * rank + 2) if c < n]
        self.nbytes = self.buf.nbytes
        self.from_children = 0
        self.have_result = False
        self.sends = self.acked = 0

    @staticmethod
    def region_bytes(n_elems: int, n: int) -> int:
        return max(1, 3 * n_elems * 4)     # a slot per child (up), one for the result (down)

    def _slot(self, index: int) -> int:
        return index * self.nbytes

    def _send(self, peer: int, slot: int, tag: int) -> None:
        self.sends += 1
        self.qps[peer].post_write(self.buf.tobytes(), self.peer_va + self._slot(slot),
                                  self.peer_rkey, tag=tag)

    def start(self, now: float) -> None:
        self._maybe_up()

    def _maybe_up(self) -> None:
        if self.from_children < len(self.children):
            return
        if self.parent is None:
            self._down()
        else:
            self._send(self.parent, 0 if self.rank == 2 * self.parent + 1 else 1, self.UP)

    def _down(self) -> None:
        self.have_result = True
        for c in self.children:
            self._send(c, 2, self.DOWN)

    def on_event(self, qp: QueuePair, event: tuple, now: float) -> None:
        if event[0] == "sent":
            self.acked += 1
            return
        slot = 2 if event[1] == self.DOWN else self.children.index(
            next(p for p, q in self.qps.items() if q is qp))
        incoming = np.frombuffer(self.region.buf, np.float32, len(self.buf), self._slot(slot))
        if event[1] == self.UP:
            self.buf += incoming
            self.from_children += 1
            self._maybe_up()
        else:
            self.buf[:] = incoming
            self._down()

    def done(self) -> bool:
        return self.have_result and self.acked == self.sends

    def report(self, op: str) -> dict:
        return _result(self.buf, self.n, op)


def pattern_bytes(src_rank: int, dst_rank: int, nbytes: int) -> bytes:
    """Reproducible payload of the message src -> dst (so integrity is checkable)."""
    return np.random.default_rng([src_rank, dst_rank]).bytes(nbytes)


class Transfers:
    """Point-to-point messages: one to each peer in `sends`, one expected from each
    peer in `recvs` (incast, all-to-all, long flows). Each message's CRC-32 is
    recorded on both ends, so the lab can check every byte arrived intact."""

    def __init__(self, rank: int, sends: dict[int, tuple[QueuePair, int, int, int]],
                 recvs: dict[int, tuple[QueuePair, int, int]], region: Region):
        self.rank = rank
        self.sends = sends        # peer -> (qp, nbytes, remote_va, rkey)
        self.recvs = recvs        # peer -> (qp, offset in region, nbytes)
        self.region = region
        self.by_qp = {id(qp): peer for peer, (qp, *_) in sends.items()}
        self.by_qp.update({id(qp): peer for peer, (qp, *_) in recvs.items()})
        # the data exists before the transfer starts, as a GPU's does: making it is not
        # part of the transfer's time (37 MB took 0.15 s of a 3.4 s flow)
        self.data = {peer: pattern_bytes(rank, peer, nbytes)
                     for peer, (_, nbytes, *_) in sends.items()}
        self.sent_crc = {peer: zlib.crc32(data) for peer, data in self.data.items()}
        self.recv_crc: dict[int, int] = {}
        self.finished_at: dict[int, float] = {}
        self.t0 = 0.0

    def start(self, now: float) -> None:
        self.t0 = now
        for peer, (qp, _, va, rkey) in self.sends.items():
            qp.post_write(self.data.pop(peer), va, rkey, tag=self.rank)

    def on_event(self, qp: QueuePair, event: tuple, now: float) -> None:
        peer = self.by_qp.get(id(qp))
        if event[0] == "sent" and peer in self.sends:
            self.finished_at[peer] = now - self.t0
        elif event[0] == "received" and peer in self.recvs:
            _, off, nbytes = self.recvs[peer]
            self.recv_crc[peer] = zlib.crc32(self.region.buf[off:off + nbytes])

    def done(self) -> bool:
        return len(self.finished_at) == len(self.sends) and len(self.recv_crc) == len(self.recvs)

    def report(self, op: str) -> dict:
        return {"sent_crc": self.sent_crc, "recv_crc": self.recv_crc,
                "finished_at": self.finished_at}
