"""Packet trimming on a running fabric: the trimming experiment at its defaults, every
claim held, and every count of metrics.json that a capture can count equal to tshark's
count (the data path's own trimming is tested on one veth in test_dataplane.py, MRC's
NACKs in memory in test_transport.py)."""
import json
from pathlib import Path

import wire
from conftest import fabriclab, requires_root, unexcused_failures
from lab import inspect
from traffic.constants import (DSCP_ROCE_DATA, DSCP_TRIMMED, ROCE_V2_UDP_PORT,
                               TRIMMED_FRAME_BYTES, Opcode)

DATA = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE     # MRC's data packets


def trimmed(f: wire.Frame) -> bool:
    return f.udp_dst == ROCE_V2_UDP_PORT and f.dscp == DSCP_TRIMMED


@requires_root
def test_trimming_at_the_defaults_counts_what_the_wire_shows(tmp_path, machine_factor):
    """Both variants (8 senders x 600 KB over MRC into one port, ~10 s at the defaults)
    with every port of the leaf captured. Per variant, within the span its counters
    cover: the frames of the data class (data, MRC's probes) the senders sent that never
    reached the receiver whole or trimmed (drops), the trimmed headers that reached it (74 bytes each), the NACKs it
    sent, and the data frames a sender sent again (a QP's PSN repeated). Exact, but for
    what tcpdump reports it lost itself."""
    out = tmp_path / "trimming"
    r = fabriclab("run", "trimming", "--capture", "fl-lf0", "--capture-mb", "60",
                  *wire.HEADERS_ONLY, "--out", str(out), timeout=int(300 / machine_factor))
    assert (out / "metrics.json").exists(), r.stdout + r.stderr
    m = json.loads((out / "metrics.json").read_text())
    failed = unexcused_failures(m)
    assert not failed and len(m["claims"]) == 6, failed
    cap = wire.RunCaptures(out)
    mx = cap.metrics
    recv = cap.fabric.host(mx["receiver"]).interface()
    recv_port, sender_ports = cap.host_port(mx["receiver"]), [cap.host_port(s)
                                                             for s in mx["senders"]]
    slack = cap.tcpdump_dropped(cap.ports)

    def to_recv(f):
        return f.dst == recv.ip and f.opcode == DATA

    def queued_with_data(f):
        """What the bottleneck's data queue holds and counts drops of: the data frames
        and MRC's probes (measured: a run dropped 3 of 15 probes beside 606 data frames)."""
        return f.dst == recv.ip and f.udp_dst == ROCE_V2_UDP_PORT and f.dscp == DSCP_ROCE_DATA

    for name in ("drop", "trim"):
        v, span = mx[name], mx[name]["counted_unix_s"]
        sent = cap.within(sender_ports, span, lambda f: f.roce_data and to_recv(f))
        offered = cap.count(sender_ports, span, queued_with_data)
        whole = cap.count([recv_port], span, queued_with_data)
        cut = cap.within([recv_port], span, lambda f: trimmed(f) and to_recv(f))
        assert all(f.length == TRIMMED_FRAME_BYTES for f in cut)
        seen = {"drops": offered - whole - len(cut), "trimmed": len(cut),
                "nacks": cap.count([recv_port], span, lambda f: f.opcode == Opcode.MRC_NACK
                                   and f.src == recv.ip),
                "retransmitted": wire.repeats(sent)}
        counted = {"drops": v["drops_packets"] + sum(v["drops_elsewhere"].values()),
                   "trimmed": v["trimmed_packets"], "nacks": v["trim_nacks_sent"],
                   "retransmitted": v["retransmitted_packets"]}
        off = {k: (counted[k], seen[k]) for k in counted if abs(counted[k] - seen[k]) > slack}
        assert not off, f"{name}: metrics vs tshark {off} (tcpdump lost {slack})"
    assert mx["trim"]["trimmed_packets"] > 0 and mx["drop"]["drops_packets"] > 0
    # `fabriclab inspect` on the receiver's port: MRC broke no rule (it resent nothing a
    # SACK had acknowledged), and it counts the trimmed headers and the NACKs as the run did
    for port in [recv_port, *sender_ports]:
        pcap = Path(cap.ports[port]["file"])
        assert inspect.inspect(pcap, inspect.settings_of_run(pcap))["violations"] == [], port
    pcap = Path(cap.ports[recv_port]["file"])
    report = inspect.inspect(pcap, inspect.settings_of_run(pcap))
    flows = [f for f in report["flows"] if f["dst"] == recv.ip]
    assert len(flows) == 16 and all(f["transport"] == "mrc" for f in flows)   # 8 a variant
    for key, counted in (("trimmed", mx["trim"]["trimmed_packets"]),
                         ("nacks", mx["trim"]["trim_nacks_sent"])):
        assert abs(sum(f[key] for f in flows) - counted) <= slack, key
