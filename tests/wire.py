"""Counting frames in a run's captures with tshark, independently of the lab's counters:
what the tests hold metrics.json against. Each pcap is read once (one tshark), into
rows of the fields the checks need."""
from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from topologies.fabric import Fabric, interface_name
from traffic.constants import DSCP_CNP, DSCP_ROCE_DATA, ROCE_V2_UDP_PORT, Opcode

FIELDS = ["frame.time_epoch", "ip.src", "ip.dst", "ip.dsfield.dscp", "ip.dsfield.ecn",
          "udp.dstport", "infiniband.bth.opcode", "infiniband.bth.destqp",
          "infiniband.bth.psn", "infiniband.aeth.syndrome", "macc.opcode", "macc.cbfc.enbv",
          "macc.cbfc.pause_time.c0", "macc.cbfc.pause_time.c1", "macc.cbfc.pause_time.c2",
          "macc.cbfc.pause_time.c3", "macc.cbfc.pause_time.c4", "macc.cbfc.pause_time.c5",
          "macc.cbfc.pause_time.c6", "macc.cbfc.pause_time.c7", "eth.src",
          "frame.len"]
OPCODE_CNP = 129
LAST_DATA_OPCODE = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE
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
