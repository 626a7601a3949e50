"""Counting frames in a run's captures with tshark, independently of the lab's counters:
what the tests hold metrics.json against. Each pcap is read once (one tshark), into
rows of the fields the checks need."""
from __future__ import annotations

import csv
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lab.tour import CAPTURE_SNAPLEN
from topologies.fabric import Fabric, interface_name
from traffic.constants import DSCP_CNP, DSCP_ROCE_DATA, LAST_DATA_OPCODE, ROCE_V2_UDP_PORT

FIELDS = ["frame.time_epoch", "ip.src", "ip.dst", "ip.dsfield.dscp", "ip.dsfield.ecn",
          "udp.dstport", "infiniband.bth.opcode", "infiniband.bth.destqp",
          "infiniband.bth.psn", "infiniband.aeth.syndrome", "macc.opcode", "macc.cbfc.enbv",
          "macc.cbfc.pause_time.c0", "macc.cbfc.pause_time.c1", "macc.cbfc.pause_time.c2",
          "macc.cbfc.pause_time.c3", "macc.cbfc.pause_time.c4", "macc.cbfc.pause_time.c5",
          "macc.cbfc.pause_time.c6", "macc.cbfc.pause_time.c7", "eth.src",
          "frame.len"]
# The tests' captures keep each frame's headers only (the tour's snaplen: Ethernet to
# RoCE's extension headers), which hold every field above: a cap of N MB then holds ~10x
# the frames (a trimming run on a software CPU resent enough to fill 60 MB of whole ones).
HEADERS_ONLY = ["--capture-snaplen", str(CAPTURE_SNAPLEN)]
OPCODE_CNP = 129
MAC_CONTROL_PFC = 0x0101


@dataclass
class Frame:
    t: float
    src: str
    dst: str
    dscp: int | None
    ecn: int | None
    udp_dst: int | None
    opcode: int | None
    qp: int | None
    psn: int | None
    syndrome: int | None
    macc: int | None
    enable: int
    pause: list[int]
    src_mac: str
    length: int         # on the wire, without the FCS (as the kernel counts tx_bytes)

    @property
    def roce_data(self) -> bool:
        """A RoCE data packet (SEND or RDMA WRITE) in the data class: not its class's
        ACKs, SACKs, NACKs or MRC's probes (whose PSN fields number other things)."""
        return self.udp_dst == ROCE_V2_UDP_PORT and self.dscp == DSCP_ROCE_DATA \
            and self.opcode is not None and self.opcode <= LAST_DATA_OPCODE

    @property
    def nak(self) -> bool:
        """An ACKNOWLEDGE whose AETH syndrome says NAK (0b011xxxxx)."""
        return self.syndrome is not None and self.syndrome >> 5 == 0b011

    @property
    def cnp(self) -> bool:
        return self.opcode == OPCODE_CNP and self.dscp == DSCP_CNP

    def pfc(self, prio: int) -> str | None:
        """"xoff" or "xon" if a PFC frame for `prio`, else None."""
        if self.macc != MAC_CONTROL_PFC or not self.enable >> prio & 1:
            return None
        return "xoff" if self.pause[prio] else "xon"


def _int(v: str) -> int | None:
    return int(v, 0) if v else None


def read(pcap: Path) -> list[Frame]:
    args = ["tshark", "-r", str(pcap), "-T", "fields", "-E", "separator=|",
            "-E", "occurrence=f"]
    for f in FIELDS:
        args += ["-e", f]
    r = subprocess.run(args, capture_output=True, text=True, check=True)
    out = []
    for line in r.stdout.splitlines():
        v = line.split("|")
        out.append(Frame(float(v[0]), v[1], v[2], _int(v[3]), _int(v[4]), _int(v[5]),
                         _int(v[6]), _int(v[7]), _int(v[8]), _int(v[9]), _int(v[10]),
                         _int(v[11]) or 0, [_int(x) or 0 for x in v[12:20]], v[20], int(v[21])))
    return out


def repeats(frames: list[Frame]) -> int:
    """Data frames that repeat a QP's PSN: retransmissions. A QP is named by the source
    and destination addresses and the destination QP number (one host's QPs toward two
    hosts may share a number)."""
    return len(frames) - len({(f.src, f.dst, f.qp, f.psn) for f in frames})


class RunCaptures:
    """The pcaps of one run (results dir), per switch interface, read once."""

    def __init__(self, out: Path):
        m = json.loads((out / "metrics.json").read_text())
        self.ports = m["metrics"]["captures"]["ports"]
        self.metrics = m["metrics"]
        self.frames = {intf: read(Path(p["file"])) for intf, p in self.ports.items()}
        self.fabric = Fabric.load(out / "fabric.json")

    def tcpdump_dropped(self, intfs) -> int:
        """What tcpdump itself reported losing on these ports: the only slack allowed."""
        dropped = [self.ports[i]["dropped_by_tcpdump"] for i in intfs]
        assert None not in dropped, f"tcpdump did not report its drops: {self.ports}"
        full = [i for i in intfs if self.ports[i].get("reached_cap")]
        assert not full, f"captures cut short at their packet cap (raise --capture-mb): {full}"
        return sum(dropped)

    def host_port(self, host: str) -> str:
        """The switch interface a GPU host hangs off (its capture's name)."""
        i = self.fabric.host(host).interface()
        return interface_name(i.switch, i.port)

    def within(self, intfs, span: list[float], keep) -> list[Frame]:
        return [f for i in intfs for f in self.frames[i] if span[0] <= f.t <= span[1] and keep(f)]

    def count(self, intfs, span: list[float], keep) -> int:
        return len(self.within(intfs, span, keep))


def queue_looks(queues_csv: Path, queue: str) -> np.ndarray:
    """One queue ("switch:port:priority") of a run's queues.csv: rows of (t, backlog
    bytes, backlog packets, packets sent so far)."""
    where = queue.split(":")
    with open(queues_csv) as f:
        rows = [[float(r["t"]), int(r["backlog_bytes"]), int(r["backlog_packets"]),
                 int(r["sent_packets"])] for r in csv.DictReader(f)
                if [r["switch"], r["port"], r["priority"]] == where]
    return np.array(rows).reshape(-1, 4)


def marking_curve(looks: np.ndarray, ce_times: list[float], span: list[float], wlog: int,
                  edges: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """How a queue marked, as the wire shows it: per bin (`edges`, bytes) of RED's
    average backlog when each packet entered the queue, the packets that left it within
    `span` and those of them that left CE-marked (`ce_times`: when each was captured
    leaving). The same for any marker (kernel RED, the BPF data path), so two can be
    compared on their own traffic.

    RED's average is estimated from the data path's looks (queue_looks; 5 ms periods):
    avg += (backlog - avg) * 2^-wlog per arrival, the backlog each arrival of a period
    found taken on the line between the period's start and end. A packet is marked as it
    enters and captured as it leaves, a queueing delay later (32 ms for 20 KB at 5 Mb/s:
    longer than the average's own memory), so each departure is traced back to its
    entry in FIFO order: the k-th packet to leave is the k-th admitted."""
    t, backlog, queued, sent = looks.T
    admitted = np.maximum.accumulate(sent + queued).astype(np.int64)
    kept = 1 - 2.0 ** -wlog
    base = int(admitted[0])
    avg_at = np.zeros(int(admitted[-1]) - base + 1)     # by admitted number - base
    a = 0.0
    for i in range(1, len(t)):
        n = int(admitted[i] - admitted[i - 1])
        for j in range(n):
            a = a * kept + (backlog[i - 1] + (backlog[i] - backlog[i - 1]) * j / n) * (1 - kept)
            avg_at[admitted[i - 1] - base + j + 1] = a
    # the packets that left within the span, by their number (1: the first ever)
    first, last = np.searchsorted(t, span[0]), np.searchsorted(t, span[1], side="right") - 1
    left = np.arange(max(base + 1, int(sent[max(0, first - 1)]) + 1), int(sent[last]) + 1)
    # a captured frame's number: interpolated between the looks around it
    ce = [x for x in ce_times if span[0] <= x <= span[1]]
    ce_left = np.ceil(np.interp(ce, t, sent) - 1e-9).astype(np.int64)
    ce_left = ce_left[ce_left > base]
    packets, _ = np.histogram(avg_at[left - base], bins=edges)
    marked, _ = np.histogram(avg_at[ce_left - base], bins=edges)
    return packets, marked
