"""Soft-RoCE (rdma_rxe) hosts on the emulated fabric: real RoCE v2 from the kernel's
RDMA stack, for comparing the lab's transports with it and for showing the fabric's
congestion features acting on it.

    with RxeHosts(net, ["g0", "g1"]) as rxe:
        result = ib_write_bw(server=rxe["g1"], client=rxe["g0"], size_bytes=16384,
                             iterations=20)

Where the hosts go. Debian 12's kernel (6.1) runs rxe in the initial network
namespace only (its UDP socket and route lookups are init_net's), so each rxe
host's interface leaves its Mininet namespace for the root one (address and MAC
kept) and goes back on exit. Its traffic still enters the fabric where the host's
would: the interface is the same veth, its peer the same leaf switch port. Two
things keep it on the fabric:
  - policy routing: rxe looks its route up with the netdev as output interface,
    which skips the local table's routes (they are on the peer's interface) and
    reaches a table routing each rxe peer via this host's own gateway;
  - the NIC's rate: moving a device between namespaces deletes its qdiscs, so the
    lab's host classes are put back, paced at the link rate like any GPU host's
    NIC, with FIFOs big enough for what rxe keeps in flight locally (64 skbs per
    QP): a smaller FIFO drops at the host, which rxe absorbs by rolling back and
    spinning on the CPU, not by slowing down.
rxe has no MAC of its own: nothing in it honours a PFC frame. `without_lab_mac`
tells the controller so (it otherwise emulates a GPU host's MAC closing its NIC's
gate, inside the host's namespace, where this interface no longer is).
"""
from __future__ import annotations

import dataclasses
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from lab.core import state
from lab.core.errors import LabError
from lab.kernel import queues
from topologies.fabric import HostInterface
from traffic import pause, roce
from traffic.constants import AethSyndrome, Opcode

RUN_IN_VM = ("Run it where the kernel has Soft-RoCE: the lab VM "
             "('fabriclab vm run -- fabriclab run softroce') or the Vagrant VM")
TABLE_BASE = 4800            # policy-routing tables 4800.. (numbers nothing else uses)
RULE_PREF = 100              # after the local table (0), before main (32766)
# rxe keeps up to 64 skbs per QP in flight below it (RXE_INFLIGHT_SKBS_PER_QP_HIGH)
RXE_HOST_FIFO_KB = 128
GID_WAIT_S = 10.0
SERVER_LISTEN_WAIT_S = 30.0
# RoCE v2's traffic class: DSCP 26 (the lab's RoCE priority) with ECT(0), as DCQCN NICs send
TCLASS_ROCE_ECT0 = (26 << 2) | 0b10
IB_WRITE_BW_PORT = 18515     # perftest's default; one more per concurrent server


def soft_roce_missing() -> str | None:
    """Why this machine cannot run rxe hosts, or None when it can (loads rdma_rxe)."""
    tools = [t for t in ("rdma", "ib_write_bw", "ib_send_bw", "tcpdump")
             if shutil.which(t) is None]
    if tools:
        return f"missing {', '.join(tools)}"
    if not Path("/sys/module/rdma_rxe").exists():
        r = subprocess.run(["modprobe", "rdma_rxe"], capture_output=True, text=True) \
            if shutil.which("modprobe") else None
        if r is None or r.returncode or not Path("/sys/module/rdma_rxe").exists():
            return "this kernel has no rdma_rxe (Soft-RoCE)"
    return None


def require_soft_roce(what: str) -> None:
    why = soft_roce_missing()
    if why:
        raise LabError(f"{what} needs Soft-RoCE, and {why}. {RUN_IN_VM}")


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(args, capture_output=True, text=True)
    if check and r.returncode:
        raise LabError(f"{' '.join(args)} failed: {r.stderr.strip()[:300]}")
    return r


@dataclass
class RxeHost:
    name: str
    intf: HostInterface
    gateway: str
    device: str = ""
    gid_index: int = -1

    @property
    def ip(self) -> str:
        return self.intf.ip


class RxeHosts:
    """The named GPU hosts as rxe hosts (see the module's docstring); a dict-like
    name -> RxeHost while active. Everything is undone on exit, in reverse."""

    def __init__(self, net, names: list[str]):
        self.net = net
        self.hosts = {n: RxeHost(n, net.fabric.host(n).interface(), net.fabric.host(n).gateway)
                      for n in names}
        self.pids = {n: net.host_pid(n) for n in names}   # their namespaces, to return to
        self.stack = ExitStack()

    def __getitem__(self, name: str) -> RxeHost:
        return self.hosts[name]

    def __enter__(self) -> "RxeHosts":
        require_soft_roce("rxe hosts")
        try:
            for h in self.hosts.values():
                self.stack.enter_context(self._in_root_namespace(h))
                self._nic_queues(h)
            self._policy_routing()
            for h in self.hosts.values():
                h.device = self.stack.enter_context(self._rxe_device(h))
                h.gid_index = roce_v2_gid_index(h.device, h.ip)
        except BaseException:
            self.stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()

    @contextmanager
    def _in_root_namespace(self, h: RxeHost):
        pid = self.pids[h.name]
        sh("mnexec", "-a", str(pid), "ip", "link", "set", h.intf.name, "netns", "1")
        try:
            if self.net.dataplane:      # the move shut the NIC's programs down too
                self.net.dataplane.reattach_host(h.name, None)
            sh("ip", "addr", "add", f"{h.ip}/{h.intf.prefix_len}", "dev", h.intf.name)
            sh("ip", "link", "set", h.intf.name, "up")
            for key, value in (("rp_filter", "0"), ("accept_local", "1")):
                # packets from the fabric carry a source that is local here too
                sh("sysctl", "-qw", f"net.ipv4.conf.{h.intf.name}.{key}={value}")
            yield
        finally:
            # back home so that the fabric's teardown finds it; the lab's queues go with
            # the move, and a namespace's routes with its addresses: both put back
            sh("ip", "link", "set", h.intf.name, "netns", str(pid), check=False)
            self._restore_in_namespace(h, pid)

    def _restore_in_namespace(self, h: RxeHost, pid: int) -> None:
        ns = ["mnexec", "-a", str(pid)]
        sh(*ns, "ip", "addr", "add", f"{h.ip}/{h.intf.prefix_len}", "dev", h.intf.name,
           check=False)
        sh(*ns, "ip", "link", "set", h.intf.name, "up", check=False)
        if h.gateway:
            sh(*ns, "ip", "route", "replace", "default", "via", h.gateway, check=False)
        lines = queues.port_commands(h.intf.name, h.intf.rate_mbps, self.net.queue_params,
                                     host=True)
        subprocess.run(ns + ["tc", "-batch", "-"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True)
        if self.net.dataplane:
            self.net.dataplane.reattach_host(h.name, pid)

    def _nic_queues(self, h: RxeHost) -> None:
        q = dataclasses.replace(self.net.queue_params, host_buffer_kb=RXE_HOST_FIFO_KB, red=None)
        lines = queues.port_commands(h.intf.name, h.intf.rate_mbps, q, host=True)
        sh("ethtool", "-K", h.intf.name, "tso", "off", "gso", "off", check=False)
        r = subprocess.run(["tc", "-batch", "-"], input="\n".join(lines) + "\n",
                           capture_output=True, text=True)
        if r.returncode:
            raise LabError(f"could not shape {h.intf.name}: {r.stderr.strip()[:200]}")

    def _policy_routing(self) -> None:
        sh("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
        for i, h in enumerate(self.hosts.values()):
            table = str(TABLE_BASE + i)
            for peer in self.hosts.values():
                if peer is h:
                    continue
                sh("ip", "route", "add", peer.ip, "via", h.gateway, "dev", h.intf.name,
                   "onlink", "table", table)
                rule = ["pref", str(RULE_PREF), "iif", "lo", "from", h.ip, "to", peer.ip]
                sh("ip", "rule", "add", *rule, "lookup", table)
                self.stack.callback(sh, "ip", "rule", "del", *rule, check=False)
            self.stack.callback(sh, "ip", "route", "flush", "table", table, check=False)

    @contextmanager
    def _rxe_device(self, h: RxeHost):
        name = f"rxe_{h.name}"
        sh("rdma", "link", "add", name, "type", "rxe", "netdev", h.intf.name)
        try:
            yield name
        finally:
            sh("rdma", "link", "delete", name, check=False)


def roce_v2_gid_index(device: str, ip: str, timeout_s: float = GID_WAIT_S) -> int:
    """The GID table index of the interface's IPv4 address as a RoCE v2 GID."""
    a, b, c, d = map(int, ip.split("."))
    want = f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"   # IPv4-mapped
    port = Path(f"/sys/class/infiniband/{device}/ports/1")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for gid in sorted(port.glob("gids/*")):
            try:
                kind = (port / "gid_attrs/types" / gid.name).read_text().strip()
                if gid.read_text().strip() == want and kind == "RoCE v2":
                    return int(gid.name)
            except OSError:
                continue   # unused entries cannot be read
        time.sleep(0.2)
    raise LabError(f"{device} got no RoCE v2 GID for {ip} within {timeout_s:.0f} s")


def hw_counters(device: str) -> dict[str, int]:
    """rxe's own counters (sent_pkts, duplicate_request, rcvd_seq_err, ...)."""
    out = {}
    for f in Path(f"/sys/class/infiniband/{device}/ports/1/hw_counters").iterdir():
        try:
            out[f.name] = int(f.read_text())
        except (OSError, ValueError):
            continue
    return out


def counter_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in sorted(after.items()) if k != "lifespan"}


def qp_timeout_ms(exponent: int) -> float:
    """An RC QP's local ACK timeout: 4.096 us * 2^exponent (IBTA)."""
    return 4.096e-3 * 2 ** exponent


@dataclass
class WriteBw:
    size_bytes: int
    iterations: int
    bw_gbps: float          # ib_write_bw's own average (first post to last completion)
    wall_s: float           # the client's whole run, connection set-up included
    report: str


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise LabError(f"ib_write_bw server exited: {proc.stdout.read()[-400:]}")
        if f":{port} " in sh("ss", "-Hltn", check=False).stdout:
            return
        time.sleep(0.1)
    raise LabError(f"ib_write_bw server did not listen on port {port} in {timeout_s:.0f} s")


def ib_write_bw(server: RxeHost, client: RxeHost, size_bytes: int, iterations: int,
                tclass: int = 0, qp_timeout_exp: int = 14, port: int = IB_WRITE_BW_PORT,
                tx_depth: int = 0, timeout_s: float = 300.0) -> WriteBw:
    """`iterations` RDMA WRITEs of `size_bytes` from client to server over one RC QP
    (perftest's ib_write_bw; its own TCP connection exchanges the QP numbers).
    tx_depth: WRITEs outstanding at once (perftest's -t; 0: its default, 128), which
    with the size bounds what the QP has in flight below rxe's own cap."""
    common = ["-s", str(size_bytes), "-n", str(iterations), "-m", "1024", "-F",
              "-p", str(port), "-u", str(qp_timeout_exp), "--report_gbits"]
    if tx_depth:
        common += ["-t", str(tx_depth)]
    if tclass:
        common += ["--tclass", str(tclass)]
    srv = subprocess.Popen(["ib_write_bw", "-d", server.device, "-x", str(server.gid_index),
                            *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        _wait_listening(port, srv, SERVER_LISTEN_WAIT_S)
        t0 = time.monotonic()
        cli = subprocess.run(["ib_write_bw", "-d", client.device, "-x", str(client.gid_index),
                              *common, server.ip], capture_output=True, text=True,
                             timeout=timeout_s)
        wall = time.monotonic() - t0
        out, _ = srv.communicate(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    if cli.returncode or srv.returncode:
        raise LabError(f"ib_write_bw {client.name} -> {server.name} failed: "
                       f"{(cli.stdout + cli.stderr)[-600:]} / server: {out[-300:]}")
    return WriteBw(size_bytes, iterations, _average_gbps(cli.stdout, size_bytes), wall,
                   cli.stdout)


def _average_gbps(report: str, size_bytes: int) -> float:
    """The 'BW average' column of perftest's result row (#bytes #iterations peak avg ...)."""
    for line in report.splitlines():
        f = line.split()
        if len(f) >= 4 and f[0] == str(size_bytes) and re.fullmatch(r"[\d.]+", f[3]):
            return float(f[3])
    raise LabError(f"no result row in ib_write_bw's report: {report[-400:]}")


# --- captures ---------------------------------------------------------------------
class Capture:
    """tcpdump on one interface (root namespace) until exit; waits until it listens,
    so that a transfer's first frames are in it. Recorded for `fabriclab clean`.
    It writes to local disk and the pcap moves to `pcap` at the end: written straight
    to the lab VM's 9p share, tcpdump fell behind, and what it had not read when
    stopped was lost (measured: the last third of a 320-packet transfer)."""

    def __init__(self, intf: str, pcap: Path, bpf: str = ""):
        self.intf, self.pcap, self.bpf = intf, Path(pcap), bpf
        self.local = Path(tempfile.mkdtemp(prefix="fl-capture-")) / self.pcap.name
        self.proc: subprocess.Popen | None = None
        self.kernel_drops: int | None = None

    def __enter__(self) -> "Capture":
        # a 32 MB buffer: under a software CPU, busy neighbours starve tcpdump for a while
        cmd = ["tcpdump", "-i", self.intf, "-B", "32768", "-U", "-w", str(self.local)] + \
            (self.bpf.split() if self.bpf else [])
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        state.record_process(self.proc.pid, f"-w {self.local}", "capture")
        for line in self.proc.stderr:
            if "listening on" in line:
                return self
        raise LabError(f"tcpdump on {self.intf} did not start: {self.proc.wait()}")

    def _caught_up(self, quiet_s: float = 1.0, timeout_s: float = 20.0) -> None:
        """Until the pcap stops growing: tcpdump has written what the kernel handed it."""
        deadline, size, since = time.monotonic() + timeout_s, -1, time.monotonic()
        while time.monotonic() < deadline:
            now = self.local.stat().st_size if self.local.exists() else 0
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        self._caught_up()
        self.proc.send_signal(signal.SIGINT)
        try:
            _, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        m = re.search(r"(\d+) packets? dropped by kernel", err or "")
        self.kernel_drops = int(m[1]) if m else None   # frames the capture missed
        self.pcap.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(self.local), self.pcap)
        self.local.parent.rmdir()


def pcap_frames(pcap: Path) -> list[tuple[float, bytes]]:
    from scapy.utils import RawPcapReader   # scapy is slow to import: only when needed
    return [(meta.sec + meta.usec / 1e6, bytes(data)) for data, meta in RawPcapReader(str(pcap))]


@dataclass
class RoceFlowStats:
    """One RC flow as seen on the wire (a capture that holds both directions)."""
    data_frames: int = 0
    distinct_psns: int = 0
    payload_bytes: int = 0           # of distinct PSNs: what was delivered
    ce_marked: int = 0               # data frames with IP ECN = CE
    ect_frames: int = 0              # data frames sent ECN-capable
    acks: int = 0
    naks: int = 0                    # PSN sequence error NAKs
    max_in_flight: int = 0           # data PSNs past the last acknowledged one
    first_data_t: float | None = None
    last_ack_t: float | None = None
    malformed: int = 0

    @property
    def retransmitted(self) -> int:
        return self.data_frames - self.distinct_psns

    @property
    def goodput_mbps(self) -> float | None:
        if self.first_data_t is None or self.last_ack_t is None \
                or self.last_ack_t <= self.first_data_t:
            return None
        return self.payload_bytes * 8 / (self.last_ack_t - self.first_data_t) / 1e6

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("first_data_t"), d.pop("last_ack_t")
        d["retransmitted"] = self.retransmitted
        d["goodput_mbps"] = round(self.goodput_mbps, 3) if self.goodput_mbps else None
        return d


def roce_flow_stats(frames: list[tuple[float, bytes]], sender_ip: str) -> RoceFlowStats:
    """Data frames from `sender_ip` and the ACKs/NAKs back to it, decoded by traffic/roce.py
    (every ICRC checked); retransmissions are data frames whose PSN was already seen."""
    s = RoceFlowStats()
    seen: dict[int, int] = {}        # PSN -> payload bytes
    highest = acked = None
    for t, frame in frames:
        try:
            p = roce.parse(frame)
        except roce.Malformed:
            s.malformed += 1
            continue
        if p is None or p.opcode == Opcode.CNP:
            continue
        if p.opcode == Opcode.ACKNOWLEDGE:
            if socket.inet_ntoa(frame[30:34]) != sender_ip:   # another flow's, or its own
                continue
            s.acks += 1
            s.naks += p.syndrome == AethSyndrome.NAK_PSN_SEQUENCE_ERROR
            s.last_ack_t = t
            acked = p.psn
            continue
        if p.src_ip != sender_ip:
            continue
        s.data_frames += 1
        s.first_data_t = t if s.first_data_t is None else s.first_data_t
        s.ce_marked += p.ce
        s.ect_frames += (frame[15] & 0b11) != 0
        seen.setdefault(p.psn, len(p.payload))
        highest = p.psn if highest is None or (p.psn - highest) % (1 << 24) < (1 << 23) \
            else highest
        if acked is not None:
            s.max_in_flight = max(s.max_in_flight, (highest - acked) % (1 << 24))
    s.distinct_psns = len(seen)
    s.payload_bytes = sum(seen.values())
    return s


def pfc_frames(frames: list[tuple[float, bytes]]) -> list[dict[int, int]]:
    """The 802.1Qbb frames in a capture: {priority: pause quanta} each."""
    out = []
    for _, frame in frames:
        if pause.is_mac_control(frame):
            q = pause.parse(frame)
            if q is not None:
                out.append(q)
    return out


# --- the controller's view ------------------------------------------------------------
@contextmanager
def without_lab_mac(net, names: list[str]):
    """While active, set_congestion() tells the controller these hosts have no lab MAC
    (no namespace pid): PFC frames toward them are sent and counted, and nothing
    pretends to honour them, which is the truth for rxe."""
    real = net.host_pid
    hidden = set(names)
    net.host_pid = lambda name: None if name in hidden else real(name)
    try:
        yield
    finally:
        del net.host_pid      # the instance attribute shadowed the method

