"""Soft-RoCE (rdma_rxe) across the emulated fabric: real RoCE v2 from the kernel's
RDMA stack (RDMA WRITEs by ib_write_bw, SENDs by ib_send_bw), and the lab's decoder
(traffic/roce.py) reads every frame of it, its ICRC agreeing with rxe's on every one.

The Debian 12 kernel's rxe (6.1) works in the initial network namespace only (its
UDP socket and route lookups are init_net's), so the two GPU hosts' interfaces are
moved out of their namespaces into the root one for the test, and policy routing
makes traffic between them leave over the fabric instead of being delivered locally:
locally sent packets to the peer use a table routing via the host's own gateway;
packets arriving from the fabric are delivered as usual (accept_local, since their
source is an address of this namespace too).
"""
import re
import signal
import subprocess
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from scapy.utils import RawPcapReader

from kernel_lab import leaf_spine
from lab.fabric.rxe import roce_v2_gid_index, sh
from traffic import roce
from traffic.constants import ROCE_V2_UDP_PORT, Opcode

pytestmark = pytest.mark.kernel

MESSAGE_BYTES = 16384
ITERATIONS = 50
MTU = 1024
TABLE_BASE = 4791   # policy-routing tables 4791, 4792 (any unused numbers)


@contextmanager
def in_root_namespace(net, host: str):
    """Move the host's interface into the root namespace (its address and MAC kept),
    and back into the host's namespace afterwards so teardown finds it there."""
    h = net.fabric.host(host)
    intf = h.interface()
    sh("mnexec", "-a", str(net.host_pid(host)), "ip", "link", "set", intf.name, "netns", "1")
    try:
        if net.dataplane:   # the move shut the NIC's port programs down: put them back
            net.dataplane.reattach_host(host, None)
        sh("ip", "addr", "add", f"{intf.ip}/{intf.prefix_len}", "dev", intf.name)
        sh("ip", "link", "set", intf.name, "up")
        yield intf
    finally:
        sh("ip", "link", "set", intf.name, "netns", str(net.host_pid(host)), check=False)


@contextmanager
def over_the_fabric(pairs):
    """pairs: (interface, its gateway, peer ip). Locally sent packets to the peer go
    out of the interface to its gateway; the local table is consulted after that."""
    undo = []
    try:
        for i, (intf, gateway, peer) in enumerate(pairs):
            table = str(TABLE_BASE + i)
            sh("ip", "route", "add", peer, "via", gateway, "dev", intf.name, "onlink",
               "table", table)
            sh("ip", "rule", "add", "pref", "100", "iif", "lo", "to", peer, "lookup", table)
            undo.append(["ip", "rule", "del", "pref", "100", "iif", "lo", "to", peer])
            undo.append(["ip", "route", "flush", "table", table])
            for key, value in (("rp_filter", "0"), ("accept_local", "1")):
                sh("sysctl", "-qw", f"net.ipv4.conf.{intf.name}.{key}={value}")
        sh("sysctl", "-qw", "net.ipv4.conf.all.rp_filter=0")
        yield
    finally:
        for cmd in reversed(undo):
            sh(*cmd, check=False)


@contextmanager
def rxe_device(intf) -> str:
    name = f"rxe_{intf.name.split('-')[0]}"
    sh("rdma", "link", "add", name, "type", "rxe", "netdev", intf.name)
    try:
        yield name
    finally:
        sh("rdma", "link", "delete", name, check=False)


@contextmanager
def capture(intf: str, pcap: Path, stats: list):
    """tcpdump on intf while the block runs; stats gets tcpdump's own counters.
    tcpdump stops reading its ring at SIGINT, and under the lab VM's software CPU it
    lags the wire by a hundred frames or more (twice the pcap held 666 of 800 data
    frames), so it is stopped only once the pcap has stopped growing."""
    proc = subprocess.Popen(["tcpdump", "-i", intf, "-U", "-B", "32768", "-w", str(pcap),
                             f"udp port {ROCE_V2_UDP_PORT}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:   # tcpdump says when it listens
            if "listening on" in line:
                break
        yield
    finally:
        wait_until_stable(pcap)
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
        stats.extend(line for line in rest.splitlines() if "packets" in line)


def wait_until_stable(path: Path, quiet_s: float = 2.0, timeout_s: float = 60) -> None:
    size, since = -1, time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        now_size = path.stat().st_size if path.exists() else 0
        if now_size != size:
            size, since = now_size, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


def perftest(tool, server_dev, server_gid, client_dev, client_gid, server_ip) -> str:
    common = ["-s", str(MESSAGE_BYTES), "-n", str(ITERATIONS), "-m", str(MTU), "-F"]
    server = subprocess.Popen([tool, "-d", server_dev, "-x", str(server_gid), *common],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2)   # the server listens for the client's connection
        client = subprocess.run([tool, "-d", client_dev, "-x", str(client_gid),
                                 *common, server_ip], capture_output=True, text=True,
                                timeout=180)
        out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert client.returncode == 0 and server.returncode == 0, client.stdout + client.stderr + out
    return client.stdout


def roce_frames(pcap: Path) -> list[bytes]:
    return [bytes(frame) for frame, _ in RawPcapReader(str(pcap))]


# what each perftest tool puts on the wire: its data opcodes, and which carry a RETH
WRITES = {Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST,
          Opcode.RDMA_WRITE_ONLY}
SENDS = {Opcode.SEND_FIRST, Opcode.SEND_MIDDLE, Opcode.SEND_LAST, Opcode.SEND_ONLY}
WITH_RETH = {Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY}


@pytest.mark.parametrize("tool,kinds", [("ib_write_bw", WRITES), ("ib_send_bw", SENDS)])
def test_soft_roce_across_the_fabric_decodes_with_matching_icrc(tmp_path, tool, kinds):
    sh("modprobe", "rdma_rxe")   # a clear failure where the kernel has no Soft-RoCE
    pcap = tmp_path / "rxe.pcap"
    with leaf_spine(tmp_path, spines=2, leaves=2, hosts_per_leaf=1) as net, ExitStack() as s:
        g0, g1 = net.fabric.host("g0"), net.fabric.host("g1")
        i0 = s.enter_context(in_root_namespace(net, "g0"))
        i1 = s.enter_context(in_root_namespace(net, "g1"))
        s.enter_context(over_the_fabric([(i0, g0.gateway, i1.ip), (i1, g1.gateway, i0.ip)]))
        d0, d1 = s.enter_context(rxe_device(i0)), s.enter_context(rxe_device(i1))
        x0, x1 = roce_v2_gid_index(d0, i0.ip), roce_v2_gid_index(d1, i1.ip)
        tcpdump: list[str] = []
        with capture(i1.name, pcap, tcpdump):
            report = perftest(tool, d1, x1, d0, x0, i1.ip)
    print(report)
    print("tcpdump:", "; ".join(tcpdump))
    frames = roce_frames(pcap)
    parsed = [roce.parse(f) for f in frames]   # raises roce.Malformed on a bad ICRC
    assert all(p is not None for p in parsed), "a captured UDP 4791 frame was not RoCE v2"
    for frame in frames:   # the ICRC recomputed by the lab = the one rxe sent, every frame
        end = 14 + 20 + int.from_bytes(frame[38:40], "big")
        sent = int.from_bytes(frame[end - 4:end], "little")
        assert roce.icrc(frame[14:54], frame[54:end - 4]) == sent
    opcodes = {p.opcode for p in parsed}
    data = [p for p in parsed if p.opcode != Opcode.ACKNOWLEDGE]
    src = {p.src_ip for p in data}
    print(f"{len(frames)} RoCE v2 frames from rxe; opcodes {sorted(map(hex, opcodes))}")
    assert Opcode.ACKNOWLEDGE in opcodes and data, opcodes
    assert {p.opcode for p in data} <= kinds, opcodes      # only this tool's kind of data
    assert src == {g0.ip}   # the data came from g0 over the fabric, not a local shortcut
    # a WRITE's first packet carries the RETH: the whole message's length, one rkey
    reths = [p for p in data if p.opcode in WITH_RETH]
    assert bool(reths) == (kinds is WRITES)
    assert all(p.dma_len == MESSAGE_BYTES for p in reths), {p.dma_len for p in reths}
    assert len({p.rkey for p in reths}) <= 1
    payload = sum(len(p.payload) for p in data)
    assert payload >= MESSAGE_BYTES * ITERATIONS, (payload, tcpdump)
    assert re.search(r"\b%d\b" % MESSAGE_BYTES, report)
