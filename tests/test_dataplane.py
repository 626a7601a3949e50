"""The per-packet data path (lab/dataplane.bpf.c) on one veth pair, without a fabric:
two namespaces, a 10 Mb/s htb port like a switch's, the egress program on one end and
the ingress program on the other, UDP at twice the port's rate. What the programs count
is held against the wire (a capture at the far end) and against the kernel's qdisc."""
from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

from conftest import requires_root
from controllers.protocol import CongestionConfig
from lab import bpf, dataplane, netns, queues, tcnl
from traffic import pause
from traffic.constants import DSCP_ROCE_DATA, PRIORITY_ROCE_DATA

NS_A, NS_B = "fl-dpa", "fl-dpb"
INTF_A, INTF_B = f"{NS_A}-eth0", f"{NS_B}-eth0"
BUFFER = 32 * 1024
KMIN, KMAX, PMAX = 2048, 16384, 0.2
XOFF, XON = 8192, 4096


def sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True)


def test_protocol_config_round_trips_and_refuses_unknown_fields(tmp_path):
    c = CongestionConfig(version=3, ecn="bpf", kmin_bytes=KMIN, pfc=True,
                         lossless={"3": [XOFF, XON]}, dataplane=True)
    c.write(tmp_path)
    back = CongestionConfig.read(tmp_path / "congestion.json")
    assert back == c and back.thresholds == {3: (XOFF, XON)}
    assert back.realtime and not back.sampling          # the data path reacts, no sampling
    assert CongestionConfig(ecn="controller").sampling
    (tmp_path / "congestion.json").write_text('{"version": 1, "brand_new": 2}')
    with pytest.raises(ValueError, match="brand_new"):
        CongestionConfig.read(tmp_path / "congestion.json")


def test_red_weight_follows_tc():
    # tc-red(8) for min 2 KB, max 16 KB, avpkt 1000: burst 6, and its ewma rule gives 4
    assert queues.red_burst(KMIN, KMAX) == 6 and queues.red_wlog(KMIN, KMAX) == 4


class Pair:
    """Two namespaces joined by a veth: A's end is a 10 Mb/s port (htb, a byte FIFO
    far larger than the program's buffer), B's end receives."""

    def __enter__(self):
        self.__exit__()
        sh(f"ip netns add {NS_A}; ip netns add {NS_B}")
        sh(f"ip link add {INTF_A} netns {NS_A} type veth peer name {INTF_B} netns {NS_B}")
        for ns, intf, ip in ((NS_A, INTF_A, "10.99.0.1"), (NS_B, INTF_B, "10.99.0.2")):
            sh(f"ip -n {ns} link set {intf} up; ip -n {ns} addr add {ip}/24 dev {intf}")
        sh(f"ip netns exec {NS_A} tc qdisc add dev {INTF_A} root handle 1: htb default 10;"
           f"ip netns exec {NS_A} tc class add dev {INTF_A} parent 1: classid 1:10 htb "
           f"rate 10mbit; ip netns exec {NS_A} tc qdisc add dev {INTF_A} parent 1:10 "
           f"bfifo limit 1000000")
        # a process in each namespace: the lab reaches namespaces by PID
        self.procs = [subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "600"])
                      for ns in (NS_A, NS_B)]
        time.sleep(0.2)
        obj = bpf.ElfObject(dataplane.build())
        self.ports = bpf.Map.create(bpf.BPF_MAP_TYPE_ARRAY, 4, dataplane.PORT_BYTES, 2,
                                    flags=bpf.BPF_F_MMAPABLE, name="fl_test")
        self.events = bpf.Map.create(bpf.BPF_MAP_TYPE_RINGBUF, 0, 0, dataplane.EVENTS_BYTES,
                                     name="fl_test")
        self.table = dataplane.PortTable(self.ports)
        self.ring = bpf.RingBuffer(self.events)
        self.table.set_queues(0, {DSCP_ROCE_DATA: PRIORITY_ROCE_DATA},
                              {0: BUFFER, PRIORITY_ROCE_DATA: BUFFER})
        maps = {"ports": self.ports.fd, "events": self.events.fd}
        for pid, intf, section, hook, consts in (
                (self.procs[0].pid, INTF_A, "tc/egress", tcnl.CLSACT_EGRESS, {"port_slot": 0}),
                (self.procs[1].pid, INTF_B, "tc/ingress", tcnl.CLSACT_INGRESS,
                 {"port_slot": 1, "peer_slot": 0})):
            nl = tcnl.Netlink(netns.socket_in_netns(pid, socket.SOCK_RAW, tcnl.NETLINK_ROUTE,
                                                    family=socket.AF_NETLINK))
            ifindex = netns.ifindex_in_netns(pid, intf)
            nl.add_clsact(ifindex)
            fd = obj.load(section, maps, consts, name="fl_test")
            nl.attach_bpf(ifindex, hook, fd, "fl-test")
            os.close(fd)
            nl.close()
        return self

    def __exit__(self, *exc):
        for p in getattr(self, "procs", []):
            p.kill()
            p.wait()
        subprocess.run(f"ip netns del {NS_A}; ip netns del {NS_B}", shell=True,
                       capture_output=True)

    def send_udp(self, n: int, gap_s: float, tos: int) -> None:
        code = ("import socket,time\n"
                "s=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n"
                f"s.setsockopt(socket.IPPROTO_IP,socket.IP_TOS,{tos})\n"
                f"for i in range({n}):\n"
                "    s.sendto(b'x'*1000,('10.99.0.2',4791))\n"
                f"    time.sleep({gap_s})\n")
        sh(f"ip netns exec {NS_A} python3 -c \"{code}\"")


def _capture():
    pcap = f"/tmp/{NS_B}.pcap"
    proc = subprocess.Popen(["ip", "netns", "exec", NS_B, "tcpdump", "-i", INTF_B, "-w", pcap,
                             "-U", "udp or ether proto 0x8808"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)
    return proc, pcap


def _tshark_count(pcap: str, flt: str) -> int:
    r = subprocess.run(["tshark", "-o", "ip.check_checksum:TRUE", "-r", pcap, "-Y", flt],
                       capture_output=True, text=True, check=True)
    return len(r.stdout.splitlines())


@requires_root
def test_the_port_program_counts_marks_drops_and_signals_as_the_wire_shows():
    with Pair() as pair:
        t = pair.table
        t.set_ecn(0, 1 << PRIORITY_ROCE_DATA, KMIN, KMAX, PMAX, queues.red_wlog(KMIN, KMAX),
                  int(queues.AVERAGE_PACKET_BYTES * 8e3 / 10))
        t.set_pfc(0, PRIORITY_ROCE_DATA, XOFF, XON)
        cap, pcap = _capture()
        # 600 frames of 1042 bytes, ~2x the port's rate: the queue fills past Kmax and
        # the buffer, then drains once the sender stops
        pair.send_udp(600, 0.0004, DSCP_ROCE_DATA << 2 | 0b10)          # ECT(0)
        # a PFC frame arriving at B: its port must stop priority 3 (an event at once)
        t.set_link(1, 10)       # B's link: 10 Mb/s, a pause quantum 51.2 us
        frame = pause.pfc_frame("02:fc:00:00:00:01", {PRIORITY_ROCE_DATA: 0xFFFF})
        sh(f"ip netns exec {NS_A} python3 -c \"import socket; s=socket.socket("
           f"socket.AF_PACKET, socket.SOCK_RAW); s.bind(('{INTF_A}', 0)); "
           f"s.send(bytes.fromhex('{frame.hex()}'))\"")
        time.sleep(1.5)
        cap.terminate()
        cap.wait()
        c = t.counters(0, PRIORITY_ROCE_DATA)
        b = t.counters(1, PRIORITY_ROCE_DATA)
        events = [dataplane.parse_event(r) for r in pair.ring.records()]
        kernel = [q for q in tcnl.Netlink(netns.socket_in_netns(
            pair.procs[0].pid, socket.SOCK_RAW, tcnl.NETLINK_ROUTE, family=socket.AF_NETLINK)
        ).qdiscs() if q.kind == "bfifo"]
    sent_on_wire = _tshark_count(pcap, "udp.dstport == 4791")
    ce_on_wire = _tshark_count(pcap, "udp.dstport == 4791 && ip.dsfield.ecn == 3")
    good_checksums = _tshark_count(pcap, 'udp.dstport == 4791 && ip.checksum.status == "Good"')
    # every frame: admitted (and sent, and seen leaving) or dropped at the buffer limit
    assert c["in_packets"] + c["drop_packets"] == 600, c
    assert c["drop_packets"] > 0 and c["in_packets"] == c["out_packets"] == sent_on_wire, c
    assert c["in_bytes"] == c["out_bytes"] and c["backlog_bytes"] == 0
    assert kernel and kernel[0].drops == 0           # the program drops first, and counts it
    # CE: counted on frames that were sent, rewritten with a valid header checksum
    assert 0 < c["ce_marked"] == ce_on_wire < sent_on_wire
    assert good_checksums == sent_on_wire
    # one XOFF as the queue passed 8 KB, one XON as it drained below 4 KB, in order
    kinds = [(e["kind"], e["slot"], e["prio"]) for e in events
             if e["kind"] != dataplane.EV_PAUSE_RX]
    assert kinds == [(dataplane.EV_XOFF, 0, PRIORITY_ROCE_DATA),
                     (dataplane.EV_XON, 0, PRIORITY_ROCE_DATA)], events
    xoff, xon = (e for e in events if e["kind"] != dataplane.EV_PAUSE_RX)
    assert xoff["value"] >= XOFF and xon["value"] <= XON and xon["t_ns"] > xoff["t_ns"]
    # the pause frame: signalled for B's port, its priority and its quanta, and counted
    [rx] = [e for e in events if e["kind"] == dataplane.EV_PAUSE_RX]
    assert rx["slot"] == 1 and rx["value"] == 1 << PRIORITY_ROCE_DATA
    assert rx["quanta"][PRIORITY_ROCE_DATA] == 0xFFFF
    # ...and held as its MAC would: paused for 0xFFFF quanta from its arrival
    assert b["paused_until_ns"] == rx["t_ns"] + 0xFFFF * 51200
    assert c["pfc_tx_pause"] == 1 and b["pfc_rx_pause"] == 1 and c["pfc_rx_pause"] == 0


@requires_root
def test_a_pause_a_transport_honours_is_counted_but_asks_for_no_gate():
    """A GPU agent's transport stops RoCE data itself when a pause arrives (lab/gpus.py
    marks its host's port): the program counts the frame and signals only the
    priorities nobody there honours, for which user space closes a gate."""
    with Pair() as pair:
        pair.table.set_nic_honours(1, PRIORITY_ROCE_DATA, True)
        assert pair.table.nic_honours(1, PRIORITY_ROCE_DATA) and \
            not pair.table.nic_honours(1, 0)
        for quanta in ({PRIORITY_ROCE_DATA: 0xFFFF}, {PRIORITY_ROCE_DATA: 0, 0: 0xFFFF}):
            frame = pause.pfc_frame("02:fc:00:00:00:01", quanta)
            sh(f"ip netns exec {NS_A} python3 -c \"import socket; s=socket.socket("
               f"socket.AF_PACKET, socket.SOCK_RAW); s.bind(('{INTF_A}', 0)); "
               f"s.send(bytes.fromhex('{frame.hex()}'))\"")
        time.sleep(0.3)
        events = [dataplane.parse_event(r) for r in pair.ring.records()]
        roce, default = (pair.table.counters(1, p) for p in (PRIORITY_ROCE_DATA, 0))
    assert [(e["kind"], e["slot"], e["value"]) for e in events] == \
        [(dataplane.EV_PAUSE_RX, 1, 1 << 0)]
    assert (roce["pfc_rx_pause"], roce["pfc_rx_resume"], default["pfc_rx_pause"]) == (1, 1, 1)
