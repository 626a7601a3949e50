"""`fabriclab inspect PCAP`: what a capture shows, per flow, and the protocol rules it
breaks, with frame numbers. The capture may come from the lab (a run's captures/) or
from real hardware: tshark reads it (pcap or pcapng) with the lab's Lua dissector for
MRC's SACK and NACK.

Per flow (a data sender, its receiver and the receiver's QP): data packets and bytes,
retransmissions (a PSN sent again), packets that arrived after a later one
(reordering), the entropy values (UDP source ports) it used and how evenly, CE marks,
trimmed packets, and what came back: ACKs, NAKs, SACKs, NACKs, CNPs. Per sender of PFC
frames (its MAC): XOFF and XON per priority.

The rules checked (each violation names the frame that shows it):
  rc-go-back-n       after a NAK for PSN E, the requester sends E again (go-back-N)
  mrc-resend         MRC resends a PSN only if no SACK had acknowledged it before
                     (checked for senders on the captured link, after
                     `reaction_grace_ms`: the SACK's way into the host and its reaction)
  pfc-paused-sends   no frame of a paused priority leaves the paused end of the link
                     while its pause lasts (after `reaction_grace_ms`: what a NIC had
                     started, and its reaction); the pause's time needs the link's rate
  cnp-interval       CNPs to one QP come no more often than DCQCN's interval
A frame's priority is its DSCP's in the lab's map (traffic/constants.py). A capture
inside a lab run's directory takes the link rate, the CNP interval and the machine's
factor (the grace stretches with it) from the run.
"""
from __future__ import annotations

import json
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from lab.core.errors import LabError, UsageError
from traffic.constants import (DSCP_PRIORITY, DSCP_TRIMMED, PAUSE_QUANTUM_BIT_TIMES,
                               PFC_PRIORITY_COUNT, PSN_MODULUS, ROCE_V2_UDP_PORT, AethSyndrome,
                               Opcode)
from topologies.fabric import Fabric, interface_name
from traffic import pause
from traffic.dcqcn import DcqcnParams
from traffic.samples import WIRESHARK_LUA

FIELDS = ["frame.number", "frame.time_epoch", "frame.len", "eth.src", "ip.src", "ip.dst",
          "ip.dsfield.dscp", "ip.dsfield.ecn", "udp.srcport", "udp.dstport",
          "infiniband.bth.opcode", "infiniband.bth.destqp", "infiniband.bth.psn",
          "infiniband.aeth.syndrome", "fabriclab_mrc.sack.cum_psn",
          "fabriclab_mrc.sack.acked_psn", "macc.opcode", "macc.cbfc.enbv", "macc.pause_time",
          *(f"macc.cbfc.pause_time.c{i}" for i in range(PFC_PRIORITY_COUNT))]
MAC_CONTROL_PFC, MAC_CONTROL_PAUSE = 0x0101, 0x0001
DATA_OPCODES = range(0x00, 0x0C)      # RC SEND and RDMA WRITE, first to only


@dataclass
class Frame:
    number: int
    t: float
    length: int
    src_mac: str
    src: str
    dst: str
    dscp: int | None
    ecn: int | None
    sport: int | None
    dport: int | None
    opcode: int | None
    qp: int | None
    psn: int | None
    syndrome: int | None
    sack_cum: int | None
    sack_acked: list[int]
    macc: int | None
    enable: int
    pause: list[int]          # per priority: pause time in quanta (PFC; PAUSE: all)

    @property
    def roce(self) -> bool:
        return self.dport == ROCE_V2_UDP_PORT and self.opcode is not None

    @property
    def data(self) -> bool:
        return self.roce and self.opcode in DATA_OPCODES

    @property
    def priority(self) -> int | None:
        return None if self.dscp is None else DSCP_PRIORITY.get(self.dscp, 0)


def _int(v: str) -> int | None:
    return int(v, 0) if v else None


def read(pcap: Path) -> list[Frame]:
    """Every frame of the capture (tshark, with the lab's Lua dissector)."""
    if not Path(pcap).is_file():
        raise UsageError(f"no capture at {pcap}")
    args = ["tshark", "-X", f"lua_script:{WIRESHARK_LUA}", "-r", str(pcap), "-T", "fields",
            "-E", "separator=|", "-E", "occurrence=a", "-E", "aggregator=;"]
    for f in FIELDS:
        args += ["-e", f]
    try:
        r = subprocess.run(args, capture_output=True, text=True)
    except FileNotFoundError:
        raise LabError("tshark is missing (apt-get install tshark)") from None
    if r.returncode:
        raise LabError(f"tshark could not read {pcap}: {r.stderr.strip()[-300:]}")
    out = []
    for line in r.stdout.splitlines():
        every = [x.split(";") for x in line.split("|")]
        v = [x[0] for x in every]            # a field's first occurrence
        macc = _int(v[16])
        if macc == MAC_CONTROL_PAUSE:     # 802.3x: every priority, one time
            enable, pause = 0xFF, [_int(v[18]) or 0] * PFC_PRIORITY_COUNT
        else:
            enable, pause = _int(v[17]) or 0, [_int(x) or 0 for x in v[19:27]]
        out.append(Frame(int(v[0]), float(v[1]), int(v[2]), v[3], v[4], v[5], _int(v[6]),
                         _int(v[7]), _int(v[8]), _int(v[9]), _int(v[10]), _int(v[11]),
                         _int(v[12]), _int(v[13]), _int(v[14]),
                         [int(x) for x in every[15] if x], macc, enable, pause))
    return out


@dataclass
class Flow:
    """One direction of a QP: data from src to dst for the receiver's QP `qp`."""
    src: str
    dst: str
    qp: int
    transport: str = "rc"
    packets: int = 0
    bytes: int = 0
    retransmitted: int = 0
    reordered: int = 0
    ce_marked: int = 0
    trimmed: int = 0
    evs: dict = field(default_factory=lambda: defaultdict(int))
    acks: int = 0
    naks: int = 0
    sacks: int = 0
    nacks: int = 0
    cnps: int = 0

    def summary(self) -> dict:
        counts = list(self.evs.values())
        return {"src": self.src, "dst": self.dst, "qp": f"{self.qp:#x}",
                "transport": self.transport, "packets": self.packets, "bytes": self.bytes,
                "retransmitted": self.retransmitted, "reordered": self.reordered,
                "ce_marked": self.ce_marked, "trimmed": self.trimmed, "evs": len(counts),
                "ev_spread_max_over_mean": round(max(counts) * len(counts) / sum(counts), 3)
                if counts else None,
                "acks": self.acks, "naks": self.naks, "sacks": self.sacks,
                "nacks": self.nacks, "cnps": self.cnps}


# A host's reaction on the reference machine; a run on a slower one stretches it as the
# runner stretches its times (machine_factor): on a software CPU (x0.28) an MRC sender
# resent a PSN 3.2 ms after its SACK passed the switch port, before the SACK reached it.
REACTION_GRACE_MS = 2.0


@dataclass
class Violation:
    frame: int
    rule: str
    text: str


@dataclass
class Settings:
    rate_mbps: float | None = None       # the link's: a pause's length in time
    cnp_interval_ms: float = DcqcnParams().cnp_interval_s * 1e3
    reaction_grace_ms: float = REACTION_GRACE_MS   # what a host may still send after a
    # pause or a SACK passed the capture (the lab's NICs react in software)
    near: tuple[str, ...] | None = None  # the IPs of the host on the captured link (None:
    # unknown); a tuple, not a set: the report carries the settings into --json's output
    # the paused end's MAC, per MAC that sends pauses (else: every other MAC is): a
    # switch may send its pauses from another MAC than the frames it forwards
    paused_macs: dict = field(default_factory=dict)
    check_pauses: bool = True


def _after(psn: int, base: int) -> int:
    """psn's distance past base, on the 24-bit circle (negative: before)."""
    d = (psn - base) % PSN_MODULUS
    return d - PSN_MODULUS if d >= PSN_MODULUS // 2 else d


def flows(frames: list[Frame]) -> dict[tuple[str, str, int], Flow]:
    """Per data flow: what it sent and what came back. A response (ACK, NAK, SACK, NACK,
    CNP) belongs to the flow from its receiver to the host it goes to that sent last."""
    out: dict[tuple[str, str, int], Flow] = {}
    seen: dict[tuple[str, str, int], set[int]] = defaultdict(set)
    highest: dict[tuple[str, str, int], int] = {}
    last: dict[tuple[str, str, int], float] = {}
    for f in frames:
        if not f.roce:
            continue
        if f.data:
            key = (f.src, f.dst, f.qp)
            fl = out.setdefault(key, Flow(f.src, f.dst, f.qp))
            fl.packets += 1
            fl.bytes += f.length
            fl.ce_marked += f.ecn == 3
            fl.trimmed += f.dscp == DSCP_TRIMMED
            fl.evs[f.sport] += 1
            if f.psn in seen[key]:
                fl.retransmitted += 1
            elif key in highest and _after(f.psn, highest[key]) < 0:
                fl.reordered += 1
            seen[key].add(f.psn)
            last[key] = f.t
            if key not in highest or _after(f.psn, highest[key]) > 0:
                highest[key] = f.psn
            continue
        # the receiver's flow from that sender that sent data last (a host pair may have
        # several QPs, one after another: each transfer its own)
        back = [key for key in out if key[:2] == (f.dst, f.src)]
        for fl in [out[max(back, key=last.__getitem__)]] if back else []:
            if f.opcode == Opcode.ACKNOWLEDGE:
                if f.syndrome is not None and f.syndrome >> 5 == 0b011:
                    fl.naks += 1
                else:
                    fl.acks += 1
            elif f.opcode == Opcode.MRC_SACK:
                fl.sacks += 1
                fl.transport = "mrc"
            elif f.opcode == Opcode.MRC_NACK:
                fl.nacks += 1
                fl.transport = "mrc"
            elif f.opcode == Opcode.CNP:
                fl.cnps += 1
    for fl in out.values():
        if len(fl.evs) > 1:
            fl.transport = "mrc"
    return out


def pfc(frames: list[Frame]) -> dict[str, dict]:
    """Per sender of PFC/PAUSE frames (its MAC): XOFF and XON frames per priority."""
    out: dict[str, dict] = {}
    for f in frames:
        if f.macc not in (MAC_CONTROL_PFC, MAC_CONTROL_PAUSE):
            continue
        per = out.setdefault(f.src_mac, {})
        for prio in range(PFC_PRIORITY_COUNT):
            if f.enable >> prio & 1:
                c = per.setdefault(prio, {"xoff": 0, "xon": 0})
                c["xoff" if f.pause[prio] else "xon"] += 1
    return out


# --- the rules ------------------------------------------------------------------------
def check_go_back_n(frames: list[Frame]) -> list[Violation]:
    """After an RC NAK (PSN sequence error) for PSN E, the requester sends E again."""
    out = []
    for i, f in enumerate(frames):
        if not (f.roce and f.opcode == Opcode.ACKNOWLEDGE and f.syndrome is not None
                and f.syndrome == AethSyndrome.NAK_PSN_SEQUENCE_ERROR):
            continue
        resent = any(g.data and g.src == f.dst and g.dst == f.src and g.psn == f.psn
                     for g in frames[i + 1:])
        if not resent:
            out.append(Violation(f.number, "rc-go-back-n",
                                 f"NAK from {f.src} asked {f.dst} for PSN {f.psn}; it was "
                                 f"not sent again in the rest of the capture"))
    return out


def check_mrc_resends(frames: list[Frame], s: Settings) -> list[Violation]:
    """An MRC data PSN sent again more than `reaction_grace_ms` after a SACK that
    acknowledged it passed the capture. Checked for the senders on the captured link
    (`near`, when known): farther away, a frame crosses queues before the capture sees
    it, and a SACK crosses them before its sender does."""
    Flow = tuple[str, str, int]
    acked_at: dict[Flow, dict[int, float]] = defaultdict(dict)        # psn -> when
    cum_at: dict[Flow, list[tuple[int, float]]] = defaultdict(list)   # (cum, when), rising
    last: dict[Flow, float] = {}          # when each flow last sent data (SACKs -> flows)
    sent: set[tuple[str, str, int, int]] = set()
    out = []
    for f in frames:
        if f.roce and f.opcode == Opcode.MRC_SACK and f.sack_cum is not None:
            flows_back = [k for k in last if k[:2] == (f.dst, f.src)]
            if not flows_back:
                continue
            flow = max(flows_back, key=last.__getitem__)
            if not cum_at[flow] or _after(f.sack_cum, cum_at[flow][-1][0]) > 0:
                cum_at[flow].append((f.sack_cum, f.t))
            for psn in f.sack_acked:
                acked_at[flow].setdefault(psn, f.t)
        elif f.data and f.dscp != DSCP_TRIMMED:
            flow = (f.src, f.dst, f.qp)
            last[flow] = f.t
            if (*flow, f.psn) in sent and (s.near is None or f.src in s.near):
                when = [t for cum, t in cum_at[flow] if _after(f.psn, cum) < 0][:1]
                if f.psn in acked_at[flow]:
                    when.append(acked_at[flow][f.psn])
                if when and f.t - min(when) > s.reaction_grace_ms / 1e3:
                    out.append(Violation(f.number, "mrc-resend",
                                         f"{f.src} resent PSN {f.psn} to {f.dst} "
                                         f"{(f.t - min(when)) * 1e3:.2f} ms after a SACK "
                                         f"had acknowledged it"))
            sent.add((*flow, f.psn))
    return out


def check_pauses(frames: list[Frame], s: Settings) -> list[Violation]:
    """Frames of a paused priority leaving the paused end (any MAC but the one that sent
    the pause) while the pause lasts, later than `reaction_grace_ms` after it was sent."""
    if not s.rate_mbps or not s.check_pauses:
        return []
    quantum_s = PAUSE_QUANTUM_BIT_TIMES / (s.rate_mbps * 1e6)
    paused: dict[tuple[str, int], tuple[float, float]] = {}   # (MAC, priority) -> span
    out = []
    for f in frames:
        if f.macc in (MAC_CONTROL_PFC, MAC_CONTROL_PAUSE):
            for prio in range(PFC_PRIORITY_COUNT):
                if f.enable >> prio & 1:      # an XON (time 0) ends the pause now
                    paused[(f.src_mac, prio)] = (f.t, f.t + f.pause[prio] * quantum_s)
            continue
        prio = f.priority
        for (mac, p), (start, end) in paused.items():
            paused_end = f.src_mac == s.paused_macs[mac] if mac in s.paused_macs \
                else f.src_mac != mac
            if p == prio and paused_end and start + s.reaction_grace_ms / 1e3 < f.t < end:
                out.append(Violation(f.number, "pfc-paused-sends",
                                     f"{f.src_mac} sent priority {prio} {(f.t - start) * 1e3:.2f}"
                                     f" ms into a pause from {mac} ({(end - start) * 1e3:.2f} ms "
                                     f"long)"))
                break
    return out


def check_cnp_interval(frames: list[Frame], s: Settings) -> list[Violation]:
    last: dict[tuple[str, int], float] = {}
    out = []
    for f in frames:
        if not (f.roce and f.opcode == Opcode.CNP):
            continue
        key = (f.dst, f.qp)
        if key in last and f.t - last[key] < s.cnp_interval_ms / 1e3:
            out.append(Violation(f.number, "cnp-interval",
                                 f"CNP to {f.dst} QP {f.qp:#x} {(f.t - last[key]) * 1e3:.3f} ms "
                                 f"after the last (DCQCN's interval: {s.cnp_interval_ms} ms)"))
        last[key] = f.t
    return out


def settings_of_run(pcap: Path) -> Settings:
    """A capture in a lab run's captures/ (named by its switch port): the link's rate and
    ends, and the run's CNP interval. Elsewhere: the defaults."""
    run = Path(pcap).resolve().parent.parent
    s = Settings()
    try:
        metrics = json.loads((run / "metrics.json").read_text())
        fabric = Fabric.load(run / "fabric.json")
    except (OSError, ValueError, KeyError):
        return s
    ends = {interface_name(n, p): (ln, n, p) for ln in fabric.links
            for n, p in ((ln.a, ln.a_port), (ln.b, ln.b_port))}
    if Path(pcap).stem in ends:
        ln, switch, port = ends[Path(pcap).stem]
        s.rate_mbps = ln.rate_mbps
        peer = ln.b if ln.a == switch else ln.a
        hosts = {h.name: h for h in fabric.hosts}
        if peer in hosts:
            # the switch pauses from its port's MAC and forwards from another: its pause
            # holds the host; the host's pause holds every frame the switch sends
            mac = next(i.mac for i in hosts[peer].interfaces
                       if (i.switch, i.port) == (switch, port))
            dpid = next(sw.dpid for sw in fabric.switches if sw.name == switch)
            s.paused_macs = {pause.port_mac(dpid, port): mac}
            s.near = tuple(sorted(i.ip for i in hosts[peer].interfaces))   # JSON has no sets
        else:
            s.check_pauses = False        # two switches forward from the same MACs
    scales = [v["rc_params"]["rate_scale"] for v in metrics.get("metrics", {}).values()
              if isinstance(v, dict) and "rc_params" in v]
    if scales:
        s.cnp_interval_ms = DcqcnParams().at_scale(scales[0]).cnp_interval_s * 1e3
    s.reaction_grace_ms = REACTION_GRACE_MS / metrics.get("machine_factor", 1.0)
    return s


def inspect(pcap: Path, s: Settings) -> dict:
    frames = read(pcap)
    violations = (check_go_back_n(frames) + check_mrc_resends(frames, s)
                  + check_pauses(frames, s) + check_cnp_interval(frames, s))
    return {"capture": str(pcap), "frames": len(frames),
            "settings": s.__dict__,
            "flows": [fl.summary() for fl in flows(frames).values()],
            "pfc": {mac: {str(p): c for p, c in per.items()} for mac, per in pfc(frames).items()},
            "violations": [v.__dict__ for v in sorted(violations, key=lambda v: v.frame)]}


def render(report: dict) -> str:
    lines = [f"{report['capture']}: {report['frames']} frames"]
    for fl in report["flows"]:
        lines.append(f"  {fl['transport']:3} {fl['src']} -> {fl['dst']} QP {fl['qp']}: "
                     f"{fl['packets']} packets ({fl['bytes']} B), {fl['retransmitted']} resent, "
                     f"{fl['reordered']} reordered, {fl['evs']} EVs"
                     + (f" (max/mean {fl['ev_spread_max_over_mean']})" if fl["evs"] > 1 else "")
                     + f", CE {fl['ce_marked']}, trimmed {fl['trimmed']}; back: ACK "
                     f"{fl['acks']}, NAK {fl['naks']}, SACK {fl['sacks']}, NACK {fl['nacks']}, "
                     f"CNP {fl['cnps']}")
    for mac, per in report["pfc"].items():
        lines.append(f"  PFC from {mac}: " + ", ".join(
            f"priority {p} XOFF {c['xoff']} XON {c['xon']}" for p, c in sorted(per.items())))
    if not report["settings"]["check_pauses"]:
        lines.append("  (pfc-paused-sends not checked: a link between two switches, whose "
                     "frames share their MACs)")
    elif not report["settings"]["rate_mbps"]:
        lines.append("  (pfc-paused-sends not checked: give --rate-mbps, the link's rate)")
    v = report["violations"]
    lines.append(f"  {len(v)} violation(s)" + (":" if v else ""))
    lines += [f"    frame {x['frame']}: {x['rule']}: {x['text']}" for x in v]
    return "\n".join(lines)
