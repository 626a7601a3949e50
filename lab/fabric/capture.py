"""Packet captures of chosen switch ports during a run, size-capped, one pcap per port.

A port is named as the user sees it: "fl-lf0:2" (switch:port), "fl-lf0-eth2"
(its interface), "g0" (the switch port that host hangs on) or "fl-lf0" (every
port of that switch). Captures run on
the switch side of the link, so they hold what the switch sends there: data,
CNPs, and its own PFC frames.
"""
from __future__ import annotations

import os
import re
import select
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lab.core import state
from lab.core.errors import LabError, UsageError
from lab.kernel import queues
from topologies.fabric import Fabric, interface_name
from traffic.constants import DSCP_TRIMMED, LAST_DATA_OPCODE, Opcode

FRAME_BYTES_BOUND = 1100        # RoCE frames at the default MTU, for the size cap
PCAP_RECORD_BYTES = 16          # a pcap record's header
START_TIMEOUT_S = 30.0          # for tcpdump to open its capture (a software CPU, loaded)
# libpcap hands tcpdump a ring block when it is full or its timeout (tcpdump's 1000 ms)
# runs out: the last frames of a run can wait that long unseen, and tcpdump stopped
# before then loses them without counting them (measured: the last 80 ms of a run's
# frames, ~84 per port). Quiet for longer than the timeout, every block has arrived.
SETTLE_QUIET_S = 1.2
SETTLE_MAX_S = 10.0
# Wireshark display filters that show the lab's points, counted in every capture (the
# report lists them with their counts); no commas (tshark's io,stat splits on them)
FILTERS = {
    "CE-marked frames": "ip.dsfield.ecn == 3",
    "CNPs": "infiniband.bth.opcode == 129",
    "PFC XOFF, priority 3": "macc.opcode == 0x0101 && macc.cbfc.pause_time.c3 > 0",
    "PFC XON, priority 3": "macc.opcode == 0x0101 && macc.cbfc.pause_time.c3 == 0",
    "RoCE NAKs": "infiniband.aeth.syndrome >= 0x60 && infiniband.aeth.syndrome < 0x80",
    "RoCE data frames": f"udp.dstport == 4791 && infiniband.bth.opcode <= {LAST_DATA_OPCODE:d}",
    "trimmed headers": f"udp.dstport == 4791 && ip.dsfield.dscp == {DSCP_TRIMMED}",
    "MRC NACKs": f"infiniband.bth.opcode == {Opcode.MRC_NACK:#x}",
    "MRC credit requests": f"infiniband.bth.opcode == {Opcode.MRC_CREDIT_REQUEST:#x}",
}
# a pcap-filter keeping all but the unmarked RoCE data frames (DSCP 26, ECN not CE): what
# shows marks, CNPs, ACKs/NAKs and pauses in a fraction of the bytes
NOT_PLAIN_ROCE_DATA = "not (udp dst port 4791 and (ip[1] & 0xfc) = 0x68 and (ip[1] & 3) != 3)"


@dataclass
class CapturePlan:
    """What an experiment finds worth capturing: ports, and a pcap-filter (or None: all)."""
    ports: list[str]
    tcpdump_filter: str | None = None
    keeps: str = "every frame"


def resolve(fabric: Fabric, spec: str, what: str = "--capture") -> list[str]:
    """A port spec -> the switch interfaces to capture on (`what` asked, for the error)."""
    ports = {intf for *_, intf, _ in queues.switch_ports(fabric)}
    if spec in ports:
        return [spec]
    if spec in {s.name for s in fabric.switches}:
        return [intf for sw, _, intf, _ in queues.switch_ports(fabric) if sw == spec]
    m = re.fullmatch(r"(\S+):(\d+)", spec)
    if m and interface_name(m[1], int(m[2])) in ports:
        return [interface_name(m[1], int(m[2]))]
    if spec in {h.name for h in fabric.hosts}:
        i = fabric.host(spec).interface()
        return [interface_name(i.switch, i.port)]
    raise UsageError(f"{what}: no switch port {spec!r}; name one as SWITCH:PORT "
                     f"(e.g. fl-lf0:2), an interface (fl-lf0-eth2), a GPU host (g0) or a "
                     f"switch (fl-lf0: all its ports)")


def wait_listening(procs: dict[str, subprocess.Popen],
                   timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every tcpdump has said "listening on" (its stderr, once its capture is open:
    what arrives after that is recorded). A fixed wait (0.3 s here, 0.5 s in a test)
    missed a run's first frames where the machine was loaded: the lab VM's suite counted
    fewer frames on the wire than the data path had sent."""
    said = {intf: b"" for intf in procs}
    deadline = time.monotonic() + timeout_s
    waiting = dict(procs)
    while waiting:
        for intf, proc in list(waiting.items()):
            ready, _, _ = select.select([proc.stderr], [], [], 0.02)
            chunk = os.read(proc.stderr.fileno(), 4096) if ready else b""
            said[intf] += chunk
            if b"listening on" in said[intf]:
                del waiting[intf]
            elif (ready and not chunk) or proc.poll() is not None:
                raise LabError(f"tcpdump on {intf} failed: "
                               f"{said[intf].decode(errors='replace').strip()[-200:]}")
        if waiting and time.monotonic() > deadline:
            raise LabError(f"tcpdump did not open its capture on {', '.join(waiting)} "
                           f"within {timeout_s:g} s")


class Captures:
    """tcpdump per port; stopped (and its pcap flushed) on exit."""

    def __init__(self, fabric: Fabric, specs: list[str], outdir: Path, max_mb: float = 20.0,
                 snaplen: int = 0, tcpdump_filter: str | None = None):
        """max_mb: per port; snaplen: bytes kept of each frame (0: all); tcpdump_filter:
        a pcap-filter of the frames to keep."""
        self.intfs = sorted({intf for s in specs for intf in resolve(fabric, s)})
        self.here = list(self.intfs)    # captured by this process (lab/cluster.py: some elsewhere)
        self.outdir = Path(outdir)
        self.snaplen, self.tcpdump_filter = snaplen, tcpdump_filter
        frame = snaplen + PCAP_RECORD_BYTES if snaplen else FRAME_BYTES_BOUND
        self.max_packets = max(100, int(max_mb * 1e6 / frame))
        self.procs: dict[str, subprocess.Popen] = {}
        self.dropped: dict[str, int | None] = {}     # by tcpdump itself (None: unknown)
        self.reached_cap: dict[str, bool] = {}       # stopped at max_packets: cut short

    def __enter__(self) -> "Captures":
        self.outdir.mkdir(parents=True, exist_ok=True)
        for intf in self.here:
            cmd = ["tcpdump", "-i", intf, "-w", str(self.path(intf)), "-U",
                   "-c", str(self.max_packets)]
            if self.snaplen:
                cmd += ["-s", str(self.snaplen)]
            if self.tcpdump_filter:
                cmd.append(self.tcpdump_filter)
            proc = subprocess.Popen(cmd,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            state.record_process(proc.pid, f"-w {self.path(intf)}", "capture")
            self.procs[intf] = proc
        wait_listening(self.procs)      # every capture open before the traffic starts
        return self

    def __exit__(self, *exc) -> None:
        self.settle()
        for intf, proc in self.procs.items():
            # a tcpdump that ended by itself took its -c packets: the rest went unrecorded
            self.reached_cap[intf] = proc.poll() is not None
            if proc.poll() is None:
                proc.terminate()
        for intf, proc in self.procs.items():
            try:
                _, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            # tcpdump's own account at exit: "N packets dropped by kernel"
            m = re.search(rb"(\d+) packets? dropped by kernel", err or b"")
            self.dropped[intf] = int(m[1]) if m else None

    def settle(self) -> None:
        """Until no pcap has grown for SETTLE_QUIET_S (at most SETTLE_MAX_S): tcpdump
        lags the wire on a busy machine, and what is still in its kernel ring when it
        is stopped is lost without being counted as dropped."""
        sizes, quiet_since, deadline = None, time.monotonic(), time.monotonic() + SETTLE_MAX_S
        while time.monotonic() < deadline:
            now = {i: self.path(i).stat().st_size if self.path(i).exists() else 0
                   for i in self.procs}
            if now != sizes:
                sizes, quiet_since = now, time.monotonic()
            elif time.monotonic() - quiet_since >= SETTLE_QUIET_S:
                return
            time.sleep(0.05)

    def path(self, intf: str) -> Path:
        return self.outdir / f"{intf}.pcap"

    def summary(self) -> dict[str, dict]:
        counts = count_all({i: self.path(i) for i in self.intfs}, FILTERS)
        return {intf: {"file": str(self.path(intf)), "bytes": self.path(intf).stat().st_size
                       if self.path(intf).exists() else 0, "packet_cap": self.max_packets,
                       "reached_cap": self.reached_cap.get(intf, False),
                       "dropped_by_tcpdump": self.dropped.get(intf),
                       "counts": counts[intf]}
                for intf in self.intfs}


def count_all(pcaps: dict[str, Path], filters: dict[str, str]
              ) -> dict[str, dict[str, int] | None]:
    """Per capture, the frames matching each display filter: one tshark over them all,
    merged (mergecap, each file its own interface: a filter per file and interface).
    A tshark's start, loading every dissector, is most of its time: 0.2 s here, seconds
    under a software CPU, where the tour's nine captures took five rounds of two
    tsharks (merged, 1.2 -> 0.3 s here for four). A set mergecap cannot merge (a file
    cut short mid-frame) is counted file by file."""
    out: dict[str, dict[str, int] | None] = dict.fromkeys(pcaps)
    there = [(name, p) for name, p in pcaps.items() if p.exists()]
    if not there:
        return out
    with tempfile.TemporaryDirectory(prefix="fabriclab-count-") as tmp:
        merged = Path(tmp) / "all.pcapng"
        try:
            r = subprocess.run(["mergecap", "-I", "none", "-F", "pcapng", "-w", str(merged),
                                *(str(p) for _, p in there)], capture_output=True, text=True)
            cells = None if r.returncode else _io_stat(
                merged, [f"({f}) && frame.interface_id == {k}"
                         for k in range(len(there)) for f in filters.values()])
        except FileNotFoundError:          # no mergecap (Wireshark's tools)
            cells = None
    if cells is not None:
        n = len(filters)
        return {**out, **{name: dict(zip(filters, cells[k * n:(k + 1) * n]))
                          for k, (name, _) in enumerate(there)}}
    return {**out, **{name: count(p, filters) for name, p in there}}


def count(pcap: Path, filters: dict[str, str]) -> dict[str, int] | None:
    """Frames matching each display filter, in one pass of tshark (None: no tshark, or
    it could not read the file)."""
    if not pcap.exists():
        return None
    cells = _io_stat(pcap, list(filters.values()))
    return None if cells is None else dict(zip(filters, cells))


def _io_stat(pcap: Path, filters: list[str]) -> list[int] | None:
    """The frames each filter matches in the whole file (tshark's io,stat, one interval)."""
    try:
        r = subprocess.run(["tshark", "-q", "-r", str(pcap), "-z",
                            "io,stat,0," + ",".join(filters)], capture_output=True, text=True)
    except FileNotFoundError:
        return None
    rows = [ln for ln in r.stdout.splitlines() if "<>" in ln]
    if r.returncode or not rows:
        return None
    cells = [c.strip() for c in rows[-1].strip().strip("|").split("|")][1:]
    return [int(cells[2 * i]) for i in range(len(filters))]
