"""The packet layer: RoCE v2 layers and builders, the byte fast path, and what tshark makes of them.

No root and no network: frames are built in memory and, for tshark, written to a pcap.
"""
import shutil
import subprocess
import zlib

import pytest
from scapy.contrib.roce import BTH
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import wrpcap

from traffic.constants import (DSCP_CNP, DSCP_ROCE_DATA, MAC_CONTROL_OPCODE_PAUSE,
                               MAC_CONTROL_OPCODE_PFC, PSN_MODULUS, ROCE_V2_UDP_PORT,
                               AethSyndrome, Ecn, Opcode)
from traffic.packets import (RETH, ImmDt, ack, cnp, nak_seq_error,
                             pause_8023x, pfc_pause, pfc_resume, rc_write_packets)

MTU = 256
QP = 0x0000AB
VA = 0x7F00_1234_5000
RKEY = 0xC0FFEE


def message(length: int) -> bytes:
    return bytes(i % 251 for i in range(length))


def write(length: int, psn: int = 100, **kw) -> list:
    return rc_write_packets(message(length), dst_qp=QP, psn=psn, va=VA, rkey=RKEY, mtu=MTU, **kw)


def icrc_by_spec(frame: bytes) -> tuple[bytes, bytes]:
    """(ICRC on the wire, ICRC computed) for an Ethernet/IPv4 RoCE v2 frame, from bytes alone.

    IBA Annex A17: CRC-32 over 8 bytes of 0xFF (the absent LRH), then IP header to
    the end of the transport payload, with IPv4 TOS, TTL and header checksum, the
    UDP checksum and BTH byte 4 (FECN, BECN, reserved) all set to ones. The ICRC
    is the last 4 bytes of the UDP payload, least significant byte first.
    """
    ip = 14
    ihl = (frame[ip] & 0x0F) * 4
    udp = ip + ihl
    udp_end = udp + int.from_bytes(frame[udp + 4:udp + 6], "big")
    masked = bytearray(frame[ip:udp_end - 4])
    masked[1] = 0xFF                        # TOS
    masked[8] = 0xFF                        # TTL
    masked[10:12] = b"\xff\xff"             # IPv4 header checksum
    masked[ihl + 6:ihl + 8] = b"\xff\xff"   # UDP checksum
    masked[ihl + 8 + 4] = 0xFF              # BTH FECN/BECN/resv6
    computed = zlib.crc32(b"\xff" * 8 + masked).to_bytes(4, "little")
    return frame[udp_end - 4:udp_end], computed


# --- RETH / ImmDt layers ---------------------------------------------------

@pytest.mark.parametrize("length, imm, layers", [
    (40, None, [BTH, RETH, Raw]),
    (40, 0xDEADBEEF, [BTH, RETH, ImmDt, Raw]),
    (0, 0x01020304, [BTH, RETH, ImmDt]),     # a zero-length write carrying only the immediate
], ids=["write-only", "write-only-with-imm", "empty-write-with-imm"])
def test_reth_immdt_round_trip(length, imm, layers):
    [frame] = write(length, imm=imm)
    wire = bytes(frame)
    back = Ether(wire)

    found = []
    layer = back[BTH]
    while layer:
        found.append(type(layer))
        layer = layer.payload
    assert found == layers
    assert (back[RETH].va, back[RETH].rkey, back[RETH].dma_len) == (VA, RKEY, length)
    if imm is not None:
        assert back[ImmDt].imm == imm
    if length:
        assert back[Raw].load == message(length)
    assert bytes(back) == wire


def test_immediate_goes_on_the_last_packet_only():
    frames = [Ether(bytes(f)) for f in write(3 * MTU, imm=0xABCD)]
    assert [f[BTH].opcode for f in frames] == [
        Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_MIDDLE, Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE]
    assert [ImmDt in f for f in frames] == [False, False, True]
    assert [RETH in f for f in frames] == [True, False, False]
    assert frames[-1][ImmDt].imm == 0xABCD
    assert frames[-1][Raw].load == message(3 * MTU)[2 * MTU:]


# --- segmentation ----------------------------------------------------------

def test_segmentation_psns_wrap_and_payload_reassembles():
    length = 4 * MTU + 13   # not a multiple of 4: the last packet is padded
    frames = [Ether(bytes(f)) for f in write(length, psn=PSN_MODULUS - 2)]
    bths = [f[BTH] for f in frames]
    assert [b.opcode for b in bths] == [Opcode.RDMA_WRITE_FIRST] + [Opcode.RDMA_WRITE_MIDDLE] * 3 \
        + [Opcode.RDMA_WRITE_LAST]
    assert [b.psn for b in bths] == [PSN_MODULUS - 2, PSN_MODULUS - 1, 0, 1, 2]
    assert [b.ackreq for b in bths] == [0, 0, 0, 0, 1]
    assert [b.padcount for b in bths] == [0, 0, 0, 0, 3]
    assert {b.dqpn for b in bths} == {QP}
    assert frames[0][RETH].dma_len == length

    payloads = [f[Raw].load for f in frames]
    assert [len(p) for p in payloads] == [MTU] * 4 + [16]
    assert b"".join(payloads)[:length] == message(length)
    assert payloads[-1][-3:] == bytes(3)


def test_frames_carry_the_lab_qos_marking():
    frame = write(MTU)[0]
    assert frame[IP].tos == DSCP_ROCE_DATA << 2 | Ecn.ECT_0
    assert frame[UDP].dport == ROCE_V2_UDP_PORT
    assert cnp(QP)[IP].tos == DSCP_CNP << 2 | Ecn.NOT_ECT
    assert ack(1, 1)[IP].tos == DSCP_ROCE_DATA << 2 | Ecn.NOT_ECT


# --- ICRC ------------------------------------------------------------------

def test_icrc_matches_an_independent_computation():
    frames = [bytes(f) for f in write(3 * MTU + 6, imm=0x55AA55AA) + write(8, imm=1) + write(8)]
    frames += [bytes(ack(5, 3)), bytes(nak_seq_error(6, 3)), bytes(cnp(QP))]
    frames += [bytes(f) for f in write(100, psn=PSN_MODULUS - 1)]
    for i, frame in enumerate(frames):
        on_wire, computed = icrc_by_spec(frame)
        assert on_wire == computed, f"frame {i}: {Ether(frame).summary()}"


def test_icrc_ignores_what_routers_rewrite():
    """A switch marking CE or decrementing TTL must not invalidate the ICRC."""
    frame = write(MTU)[0]
    rewritten = frame.copy()
    rewritten[IP].tos = DSCP_ROCE_DATA << 2 | Ecn.CE
    rewritten[IP].ttl = 3
    rewritten[BTH].fecn = 1
    assert bytes(rewritten)[-4:] == bytes(frame)[-4:]
    assert bytes(rewritten) != bytes(frame)


# --- PFC / PAUSE ----------------------------------------------------------

@pytest.mark.parametrize("quanta", [{8: 1}, {-1: 1}, {3: 0x10000}, {3: -1}])
def test_pfc_rejects_bad_priorities_and_quanta(quanta):
    with pytest.raises(ValueError):
        pfc_pause(quanta)


# --- tshark ----------------------------------------------------------------

# Numeric fields tshark 4.0 reports for the frames below (names from `tshark -G fields`).
TSHARK_FIELDS = ["infiniband.bth.opcode", "infiniband.bth.psn", "infiniband.bth.destqp",
                 "infiniband.reth.dmalen", "infiniband.aeth.syndrome", "infiniband.aeth.msn",
                 "macc.opcode", "macc.cbfc.enbv", "macc.cbfc.pause_time.c3",
                 "macc.cbfc.pause_time.c6", "macc.pause_time"]


def tshark(*args: str) -> str:
    return subprocess.run(["tshark", *args], capture_output=True, text=True, check=True,
                          timeout=60).stdout


def bth(opcode: Opcode, psn: int, **more: int) -> dict[str, int]:
    return {"infiniband.bth.opcode": opcode, "infiniband.bth.psn": psn,
            "infiniband.bth.destqp": QP, **more}


@pytest.mark.skipif(shutil.which("tshark") is None, reason="tshark not installed")
def test_tshark_decodes_every_frame_kind(tmp_path):
    first, middle, last = write(2 * MTU + 8, psn=PSN_MODULUS - 1)
    [only] = write(16, psn=40)
    dmalen, syndrome, msn = "infiniband.reth.dmalen", "infiniband.aeth.syndrome", "infiniband.aeth.msn"
    frames_and_decodes = [   # frame, protocol column, the TSHARK_FIELDS present and their values
        (first, "RRoCE", bth(Opcode.RDMA_WRITE_FIRST, PSN_MODULUS - 1, **{dmalen: 2 * MTU + 8})),
        (middle, "RRoCE", bth(Opcode.RDMA_WRITE_MIDDLE, 0)),
        (last, "RRoCE", bth(Opcode.RDMA_WRITE_LAST, 1)),
        (only, "RRoCE", bth(Opcode.RDMA_WRITE_ONLY, 40, **{dmalen: 16})),
        (ack(41, 2, dst_qp=QP), "RRoCE",
         bth(Opcode.ACKNOWLEDGE, 41, **{syndrome: AethSyndrome.ACK, msn: 2})),
        (nak_seq_error(42, 2, dst_qp=QP), "RRoCE",
         bth(Opcode.ACKNOWLEDGE, 42, **{syndrome: AethSyndrome.NAK_PSN_SEQUENCE_ERROR, msn: 2})),
        # tshark 4.0 does not know the CNP opcode (shows "Unknown"); it still parses the BTH.
        (cnp(QP), "RRoCE", bth(Opcode.CNP, 0)),
        (pfc_pause({3: 0xFFFF, 6: 10}), "MAC CTRL",
         {"macc.opcode": MAC_CONTROL_OPCODE_PFC, "macc.cbfc.enbv": 1 << 3 | 1 << 6,
          "macc.cbfc.pause_time.c3": 0xFFFF, "macc.cbfc.pause_time.c6": 10}),
        (pfc_resume([3]), "MAC CTRL",   # the enabled class's time is 0; unenabled ones also read 0
         {"macc.opcode": MAC_CONTROL_OPCODE_PFC, "macc.cbfc.enbv": 1 << 3,
          "macc.cbfc.pause_time.c3": 0, "macc.cbfc.pause_time.c6": 0}),
        (pause_8023x(100), "MAC CTRL", {"macc.opcode": MAC_CONTROL_OPCODE_PAUSE, "macc.pause_time": 100}),
    ]
    pcap = tmp_path / "kinds.pcap"
    wrpcap(str(pcap), [frame for frame, _, _ in frames_and_decodes])

    columns = ["frame.number", "_ws.col.Protocol", *TSHARK_FIELDS, "_ws.expert.message"]
    args = ["-r", str(pcap), "-T", "fields", "-E", "occurrence=f"]
    for column in columns:
        args += ["-e", column]
    rows = [dict(zip(columns, line.split("\t"))) for line in tshark(*args).splitlines()]
    assert len(rows) == len(frames_and_decodes)
    for number, (row, (_, protocol, fields)) in enumerate(zip(rows, frames_and_decodes), start=1):
        assert int(row["frame.number"]) == number
        assert row["_ws.col.Protocol"] == protocol, f"frame {number}"
        decoded = {f: int(row[f], 0) for f in TSHARK_FIELDS if row[f]}
        assert decoded == fields, f"frame {number}"
        assert row["_ws.expert.message"] == "", f"frame {number}"

    # Nothing malformed and no expert info of any severity, anywhere in the file.
    assert tshark("-r", str(pcap), "-Y", "_ws.malformed || _ws.expert") == ""
