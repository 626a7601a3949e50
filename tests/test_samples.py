"""The MRC wire format, the sample pcap, and what tshark makes of both with the lab's Lua dissector.

No root and no network: frames are built in memory and, for tshark, written to a pcap.
"""
import shutil
import struct

import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import rdpcap, wrpcap

from conftest import fabriclab
from test_packets import icrc_by_spec, tshark
from traffic import mrc, roce
from traffic.constants import (DSCP_ROCE_DATA, DSCP_TRIMMED, MAC_CONTROL_OPCODE_PAUSE,
                               MAC_CONTROL_OPCODE_PFC, MRC_NACK_CODE_TRIMMED, MRC_SACKX_BYTES,
                               PSN_MODULUS, ROCE_V2_UDP_PORT, TRIMMED_FRAME_BYTES, Ecn, Opcode)
from traffic.packets import (RETH, Endpoints, ImmDt, MrcNack, MrcSack, mrc_data, mrc_nack,
                             mrc_sack, rc_write_packets, trimmed)
from traffic.samples import WIRESHARK_LUA, sample_frames, write_samples

needs_tshark = pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed")

QP = 0x0000AB
DATA = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE   # the opcode of MRC data
IB, MACC = "infiniband.bth.opcode", "macc.opcode"   # tshark fields of the opcodes


def tshark_fields(pcap, fields: list[str]) -> list[dict[str, str]]:
    """One dict per frame: field -> value as tshark prints it ('' if absent, repeats joined by ',')."""
    args = ["-X", f"lua_script:{WIRESHARK_LUA}", "-r", str(pcap), "-T", "fields",
            "-E", "occurrence=a", "-E", "aggregator=,"]
    for field in fields:
        args += ["-e", field]
    return [dict(zip(fields, line.split("\t"))) for line in tshark(*args).splitlines()]


def assert_decodes_clean(pcap) -> None:
    """Nothing malformed and no expert info of any severity, with the Lua dissector loaded."""
    assert tshark("-X", f"lua_script:{WIRESHARK_LUA}", "-r", str(pcap),
                  "-Y", "_ws.malformed || _ws.expert") == ""


def opcode(row: dict[str, str]) -> int | None:
    """The BTH opcode of a tshark_fields row, None for a frame without one."""
    return int(row[IB]) if row[IB] else None


def flag(text: str) -> bool:
    return {"0": False, "1": True, "False": False, "True": True}[text]   # tshark 4.0 prints 0/1


# --- MRC data --------------------------------------------------------------

def test_mrc_data_is_a_self_describing_write_only_with_immediate():
    payload = bytes(range(37))   # not a multiple of 4: padded
    frame = Ether(bytes(mrc_data(payload, dst_qp=QP, psn=PSN_MODULUS + 9, ev=0xD00D, va=0x7000_0400,
                                 rkey=0xBEEF, message_id=0x1_0005, packets_in_message=300)))
    assert frame[IP].tos == DSCP_ROCE_DATA << 2 | Ecn.ECT_0
    assert (frame[UDP].sport, frame[UDP].dport) == (0xD00D, ROCE_V2_UDP_PORT)
    bth = frame[BTH]
    assert (bth.opcode, bth.dqpn, bth.psn, bth.ackreq, bth.padcount) == \
        (Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, QP, 9, 0, 3)
    assert (frame[RETH].va, frame[RETH].rkey, frame[RETH].dma_len) == (0x7000_0400, 0xBEEF, 37)
    assert frame[ImmDt].imm == 0x0005_012C   # message id mod 2**16, then 300 packets
    assert frame[Raw].load == payload + bytes(3)


@pytest.mark.parametrize("count", [0, 0x10000])
def test_mrc_data_rejects_packet_counts_the_immediate_cannot_hold(count):
    with pytest.raises(ValueError):
        mrc_data(b"x", dst_qp=QP, psn=0, ev=1, va=0, rkey=0, message_id=0, packets_in_message=count)


# --- MRC SACK --------------------------------------------------------------

def sack(cum_psn: int, **kw):
    return mrc_sack(cum_psn, **{"dst_qp": QP, "ev": 0xC123, "credit_psn": 500,
                                "received_psns": [], **kw})


def test_sackx_bytes_follow_the_documented_layout():
    frame = mrc_sack(0x123456, dst_qp=QP, received_psns=[0x123457, 0x123457 + 63], ev=0xC123,
                     ecn_echo=True, credit_psn=0x123456 + 200)
    wire = bytes(frame)
    sackx = wire[-4 - MRC_SACKX_BYTES:-4]
    assert sackx == struct.pack("!QHBBI", 1 << 63 | 1, 0xC123, 0x01, 0, 0x123456 + 200)
    back = Ether(wire)
    assert back[BTH].opcode == Opcode.MRC_SACK == 0xC1
    assert (back[BTH].psn, back[BTH].dqpn) == (0x123456, QP)
    assert len(back[MrcSack]) == MRC_SACKX_BYTES   # dissected, with the ICRC left in the BTH
    assert (back[MrcSack].bitmap, back[MrcSack].ev, back[MrcSack].credit_psn) == \
        (1 << 63 | 1, 0xC123, 0x123456 + 200)
    assert back[IP].tos == DSCP_ROCE_DATA << 2 | Ecn.NOT_ECT
    assert bytes(back) == wire


@pytest.mark.parametrize("kw", [
    {"received_psns": [100]},          # the cumulative ACK itself has not arrived
    {"received_psns": [99]},           # already covered by the cumulative ACK
    {"received_psns": [165]},          # beyond the 64-bit window
    {"received_psns": None},           # neither form
    {"bitmap": 1},                     # both forms
    {"received_psns": None, "bitmap": 1 << 64},
])
def test_sack_rejects_what_the_bitmap_cannot_say(kw):
    with pytest.raises(ValueError):
        sack(100, **kw)


SACK_CASES = [   # cum_psn, received_psns, ev, ecn_echo, credit_psn
    (100, [101, 103, 164], 0xC001, True, 164),        # bits 0, 2 and 63
    (PSN_MODULUS - 2, [PSN_MODULUS - 1, PSN_MODULUS, PSN_MODULUS + 3], 0xFFFF, False, 30),  # wraps
    (0, [], 1024, False, 0),                          # nothing beyond the cumulative ACK
]


@needs_tshark
def test_lua_decodes_sacks_as_built(tmp_path):
    pcap = tmp_path / "sacks.pcap"
    wrpcap(str(pcap), [mrc_sack(cum, dst_qp=QP, received_psns=got, ev=ev, ecn_echo=ecn,
                                credit_psn=credit) for cum, got, ev, ecn, credit in SACK_CASES])
    fields = ["infiniband.bth.opcode", "fabriclab_mrc.sack.cum_psn", "fabriclab_mrc.sack.bitmap",
              "fabriclab_mrc.sack.acked_psn", "fabriclab_mrc.sack.ev",
              "fabriclab_mrc.sack.ecn_echo", "fabriclab_mrc.sack.reserved",
              "fabriclab_mrc.sack.credit_psn"]
    rows = tshark_fields(pcap, fields)
    assert len(rows) == len(SACK_CASES)
    for row, (cum, got, ev, ecn, credit) in zip(rows, SACK_CASES):
        bitmap = sum(1 << (psn - cum - 1) for psn in got)   # got lies within 64 past cum here
        acked = [str(psn % PSN_MODULUS) for psn in got]
        assert opcode(row) == Opcode.MRC_SACK
        assert int(row["fabriclab_mrc.sack.cum_psn"]) == cum
        assert int(row["fabriclab_mrc.sack.bitmap"], 16) == bitmap
        assert row["fabriclab_mrc.sack.acked_psn"].split(",") == (acked or [""])
        assert int(row["fabriclab_mrc.sack.ev"]) == ev
        assert flag(row["fabriclab_mrc.sack.ecn_echo"]) == ecn
        assert int(row["fabriclab_mrc.sack.reserved"], 16) == 0
        assert int(row["fabriclab_mrc.sack.credit_psn"]) == credit
    assert_decodes_clean(pcap)


@needs_tshark
def test_lua_labels_mrc_data_but_not_rc_writes_with_immediate(tmp_path):
    """Both have opcode 0x0B; RC's asks for an ACK (it ends a message), MRC data never does."""
    [rc] = rc_write_packets(bytes(64), dst_qp=QP, psn=1, va=0, rkey=0, imm=0x0007_0004)
    data = mrc_data(bytes(64), dst_qp=QP, psn=2, ev=0xD001, va=0, rkey=0, message_id=7,
                    packets_in_message=4)
    pcap = tmp_path / "imm.pcap"
    wrpcap(str(pcap), [rc, data])
    rows = tshark_fields(pcap, [IB, "fabriclab_mrc.msg_id", "fabriclab_mrc.msg_packets"])
    assert [(opcode(r), r["fabriclab_mrc.msg_id"], r["fabriclab_mrc.msg_packets"]) for r in rows] \
        == [(DATA, "", ""), (DATA, "7", "4")]
    assert_decodes_clean(pcap)


# --- packet trimming --------------------------------------------------------

def test_a_trimmed_packet_keeps_its_headers_and_the_receiver_knows_it():
    data = mrc_data(bytes(range(256)) * 4, dst_qp=QP, psn=77, ev=0xD00D, va=0x7000_0400,
                    rkey=0xBEEF, message_id=5, packets_in_message=9)
    cut = trimmed(data)
    wire = bytes(cut)
    assert len(wire) == TRIMMED_FRAME_BYTES
    assert cut[IP].tos == DSCP_TRIMMED << 2 | Ecn.ECT_0       # the ECN field is kept
    assert cut[IP].len == TRIMMED_FRAME_BYTES - 14 and cut[UDP].len == cut[IP].len - 20
    header = bytearray(wire[14:34])
    header[10:12] = b"\0\0"
    assert roce.internet_checksum(bytes(header)) == cut[IP].chksum
    # the ports, UDP checksum (none), BTH, RETH and ImmDt as sent
    assert wire[34:38] + wire[40:] == bytes(data)[34:38] + bytes(data)[40:TRIMMED_FRAME_BYTES]
    p = roce.parse(wire)
    assert p.trimmed and p.psn == 77 and p.imm == 5 << 16 | 9 and p.va == 0x7000_0400
    assert len(p.payload) == 0
    assert not roce.parse(bytes(data)).trimmed
    with pytest.raises(ValueError, match="nothing to trim"):
        trimmed(mrc_nack(1, dst_qp=QP, ev=1))


def test_nackx_bytes_follow_the_documented_layout_and_the_transport_reads_them():
    frame = mrc_nack(PSN_MODULUS + 12, dst_qp=QP, ev=0xD00D, ecn_echo=True)
    wire = bytes(frame)
    nackx = wire[14 + 20 + 8 + 12:][:4]
    assert struct.unpack("!HBB", nackx) == (0xD00D, MRC_NACK_CODE_TRIMMED, 0x01)
    assert Ether(wire)[MrcNack].ev == 0xD00D
    p = roce.parse(wire, mrc.EXT_BYTES)
    assert p.opcode == Opcode.MRC_NACK and p.psn == 12 and bytes(p.ext) == nackx


@needs_tshark
def test_lua_decodes_trimmed_packets_and_nacks(tmp_path):
    data = mrc_data(bytes(1024), dst_qp=QP, psn=40, ev=0xD001, va=0, rkey=0, message_id=7,
                    packets_in_message=4)
    pcap = tmp_path / "trim.pcap"
    wrpcap(str(pcap), [data, trimmed(data), mrc_nack(40, dst_qp=QP, ev=0xD001)])
    rows = tshark_fields(pcap, [IB, "fabriclab_mrc.trimmed", "fabriclab_mrc.msg_id",
                                "fabriclab_mrc.nack.psn", "fabriclab_mrc.nack.code",
                                "fabriclab_mrc.nack.ev", "ip.dsfield.dscp"])
    assert [(opcode(r), r["fabriclab_mrc.trimmed"], r["fabriclab_mrc.msg_id"],
             r["fabriclab_mrc.nack.psn"], r["fabriclab_mrc.nack.code"],
             r["fabriclab_mrc.nack.ev"]) for r in rows] == [
        (DATA, "", "7", "", "", ""), (DATA, "1", "7", "", "", ""),
        (Opcode.MRC_NACK, "", "", "40", str(MRC_NACK_CODE_TRIMMED), str(0xD001))]
    assert int(rows[1]["ip.dsfield.dscp"]) == DSCP_TRIMMED
    assert_decodes_clean(pcap)


def test_probe_bytes_are_what_the_transport_sends_and_lua_decodes_them(tmp_path):
    from traffic.mrc import MrcQP
    from traffic.packets import mrc_probe
    from traffic.qp import Region
    from traffic.roce import Path as RocePath
    path = RocePath("02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2")
    qp = MrcQP(path, 0x33, QP, Region(1, bytearray(16)))
    ev = qp.evs[2]
    ev.retired_at = 0.0
    qp.set_ev(ev, "assumed_bad", 0.0, "losses")
    qp.post_write(bytes(1024), 0, 1, tag=1)      # (a QP probes while it has data)
    [sent] = qp.on_timer(10.0)                   # its probe is due
    p = roce.parse(sent, mrc.EXT_BYTES)
    assert (p.opcode, p.sport, bytes(p.ext)) == (Opcode.MRC_PROBE, ev.port,
                                                 struct.pack("!HBB", ev.port, 0, 0))
    [answer] = qp.on_packet(p, 10.0)             # the receiver's side of a QP answers it
    assert roce.parse(answer, mrc.EXT_BYTES).sport == ev.port
    pcap = tmp_path / "probe.pcap"
    wrpcap(str(pcap), [mrc_probe(1, dst_qp=QP, ev=0xD005),
                       mrc_probe(1, dst_qp=QP, ev=0xD005, reply=True)])
    rows = tshark_fields(pcap, [IB, "fabriclab_mrc.probe.ev", "fabriclab_mrc.probe.reply"])
    assert [(opcode(r), r["fabriclab_mrc.probe.ev"], flag(r["fabriclab_mrc.probe.reply"]))
            for r in rows] == [(Opcode.MRC_PROBE, "53253", False), (Opcode.MRC_PROBE, "53253",
                                                                    True)]
    assert_decodes_clean(pcap)


def test_credit_request_bytes_are_what_the_transport_sends_and_lua_decodes_them(tmp_path):
    from traffic.mrc import DATA_OVERHEAD_BYTES, MrcParams, MrcQP
    from traffic.packets import mrc_credit_request
    from traffic.qp import Region
    from traffic.rccc import Rccc, RcccParams
    from traffic.roce import Path as RocePath
    path = RocePath("02:00:00:00:00:01", "02:00:00:00:00:02", "10.0.0.1", "10.0.0.2")
    qp = MrcQP(path, 0x33, QP, Region(1, bytearray(16)), MrcParams(cc="rccc"),
               rccc=Rccc(RcccParams(), 10.0, DATA_OVERHEAD_BYTES + 1024))
    qp.post_write(bytes(20 * 1024), 0, 1, tag=1)
    [sent] = qp.on_timer(0.0)                    # 20 packets, 4 of them unsolicited: ask
    p = roce.parse(sent, mrc.EXT_BYTES)
    assert (p.opcode, p.psn, bytes(p.ext)) == (Opcode.MRC_CREDIT_REQUEST, 20,
                                               struct.pack("!I", 20 * 1024))
    theirs = mrc_credit_request(20, dst_qp=QP, ev=p.sport, backlog_bytes=20 * 1024,
                                endpoints=Endpoints(src_mac=path.src_mac, dst_mac=path.next_hop_mac,
                                                    src_ip=path.src_ip, dst_ip=path.dst_ip,
                                                    src_port=p.sport))
    assert bytes(theirs)[14 + 20 + 8:] == sent[14 + 20 + 8:]   # the RoCE part, ICRC too
    pcap = tmp_path / "creq.pcap"
    wrpcap(str(pcap), [theirs])
    [row] = tshark_fields(pcap, [IB, "fabriclab_mrc.creq.psn", "fabriclab_mrc.creq.backlog"])
    assert (opcode(row), row["fabriclab_mrc.creq.psn"], row["fabriclab_mrc.creq.backlog"]) == (
        Opcode.MRC_CREDIT_REQUEST, "20", str(20 * 1024))
    assert_decodes_clean(pcap)


# --- the sample pcap -------------------------------------------------------

EXPECTED = [(IB, op) for op in (   # per sample frame: its BTH or MAC Control opcode
    Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST,
    Opcode.RDMA_WRITE_ONLY, Opcode.ACKNOWLEDGE, Opcode.ACKNOWLEDGE, Opcode.CNP,
    DATA, DATA, DATA, DATA, Opcode.MRC_SACK, DATA, Opcode.MRC_NACK)] + [
    (MACC, MAC_CONTROL_OPCODE_PFC), (MACC, MAC_CONTROL_OPCODE_PFC), (MACC, MAC_CONTROL_OPCODE_PAUSE)]

SAMPLE_FIELDS = ["frame.number", IB, MACC, "infiniband.aeth.syndrome", "udp.srcport",
                 "infiniband.immdt",
                 "fabriclab_mrc.msg_id", "fabriclab_mrc.msg_packets",
                 "fabriclab_mrc.sack.cum_psn", "fabriclab_mrc.sack.bitmap",
                 "fabriclab_mrc.sack.ev", "fabriclab_mrc.sack.ecn_echo",
                 "fabriclab_mrc.sack.credit_psn", "fabriclab_mrc.trimmed",
                 "fabriclab_mrc.nack.psn"]


@pytest.fixture(scope="module")
def samples_pcap(tmp_path_factory):
    pcap = tmp_path_factory.mktemp("samples") / "samples.pcap"
    return pcap, write_samples(pcap)


def test_every_roce_sample_has_a_correct_icrc():
    """(but the trimmed one: a switch cut its ICRC with its payload)"""
    roce = [(d, bytes(f)) for d, f in sample_frames() if BTH in f]
    assert len(roce) == sum(1 for field, _ in EXPECTED if field == IB)
    roce = [(d, wire) for d, wire in roce if wire[15] >> 2 != DSCP_TRIMMED]
    assert len(roce) == sum(1 for field, _ in EXPECTED if field == IB) - 1
    for description, wire in roce:
        on_wire, computed = icrc_by_spec(wire)
        assert on_wire == computed, description


@needs_tshark
def test_samples_decode_as_built(samples_pcap):
    pcap, samples = samples_pcap
    assert len(samples) == len(EXPECTED)
    rows = tshark_fields(pcap, SAMPLE_FIELDS)
    assert [int(r["frame.number"]) for r in rows] == list(range(1, len(EXPECTED) + 1))
    for row, (field, value), (description, _) in zip(rows, EXPECTED, samples):
        decoded = {f: int(row[f], 0) for f in (IB, MACC) if row[f]}
        assert decoded == {field: value}, description
    syndromes = [int(r["infiniband.aeth.syndrome"], 0)
                 for r in rows if r["infiniband.aeth.syndrome"]]
    assert syndromes == [0x1F, 0x60]   # one ACK, one NAK (PSN sequence error)


@needs_tshark
def test_sample_mrc_data_is_sprayed_and_labelled(samples_pcap):
    pcap, _ = samples_pcap
    data = [r for r in tshark_fields(pcap, SAMPLE_FIELDS)
            if opcode(r) == DATA and not r["fabriclab_mrc.trimmed"]]
    assert len(data) >= 4
    assert len({r["udp.srcport"] for r in data}) >= 4
    for row in data:
        # The Lua labels agree with the immediate that tshark's own dissector shows
        # (twice: as the ImmDt header and as its one field, the same 4 bytes).
        imm = int(row["infiniband.immdt"].split(",")[0], 16)
        assert (int(row["fabriclab_mrc.msg_id"]), int(row["fabriclab_mrc.msg_packets"])) == \
            (imm >> 16, imm & 0xFFFF)
        assert int(row["fabriclab_mrc.msg_packets"]) == len(data)


@needs_tshark
def test_sample_sack_decodes_as_built(samples_pcap):
    pcap, samples = samples_pcap
    rows = tshark_fields(pcap, SAMPLE_FIELDS)
    [(row, frame)] = [(r, f) for r, (_, f) in zip(rows, samples) if MrcSack in f]
    built = frame[MrcSack]
    assert int(row["fabriclab_mrc.sack.cum_psn"]) == frame[BTH].psn
    assert int(row["fabriclab_mrc.sack.bitmap"], 16) == built.bitmap
    assert int(row["fabriclab_mrc.sack.ev"]) == built.ev
    assert flag(row["fabriclab_mrc.sack.ecn_echo"]) == bool(built.flags.ECN_ECHO)
    assert int(row["fabriclab_mrc.sack.credit_psn"]) == built.credit_psn
    # The EV names one of the data packets: the one that triggered the SACK.
    assert row["fabriclab_mrc.sack.ev"] in {r["udp.srcport"] for r in rows if opcode(r) == DATA}


@needs_tshark
def test_samples_decode_clean(samples_pcap):
    pcap, _ = samples_pcap
    assert_decodes_clean(pcap)


# --- the CLI ---------------------------------------------------------------

def test_cli_writes_the_samples(tmp_path):
    r = fabriclab("samples", "--out", "tmp.pcap", cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(rdpcap(str(tmp_path / "tmp.pcap"))) == len(EXPECTED)
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines[:len(EXPECTED)]] == \
        [str(n) for n in range(1, len(EXPECTED) + 1)]
    assert f"lua_script:{WIRESHARK_LUA}" in r.stdout
