"""The transports' byte path (traffic/roce.py) against Scapy's build and the spec."""
import pytest
from scapy.layers.inet import IP

from test_packets import QP, icrc_by_spec, write
from traffic import roce
from traffic.constants import PSN_MODULUS, AethSyndrome, Opcode
from traffic.mrc import EXT_BYTES
from traffic.packets import ack, cnp, mrc_data, mrc_sack, nak_seq_error


def scapy_frames(psn: int) -> dict:
    frames = dict(zip(["first", "middle", "last"], write(2 * 1024 + 8, psn=psn, imm=7)))
    frames["only"] = write(100, psn=psn)[0]
    frames["ack"] = ack(psn, 3, dst_qp=QP)
    frames["nak"] = nak_seq_error(psn, 3, dst_qp=QP)
    frames["cnp"] = cnp(QP)
    frames["mrc-data"] = mrc_data(bytes(range(200)), dst_qp=QP, psn=psn, ev=0xE001, va=0x4000,
                                  rkey=9, message_id=5, packets_in_message=3)
    frames["mrc-sack"] = mrc_sack(psn, dst_qp=QP, received_psns=[psn + 2, psn + 5],
                                  ev=0xE001, ecn_echo=True, credit_psn=psn + 64)
    return frames


def rebuild(scapy_frame) -> tuple[bytes, bytes]:
    """(Scapy's bytes, the same frame parsed and composed again by roce.Framer)."""
    wire = bytes(scapy_frame)
    p = roce.parse(wire, EXT_BYTES)
    ip = scapy_frame[IP]
    path = roce.Path(scapy_frame.src, scapy_frame.dst, ip.src, ip.dst)
    framer = roce.Framer(path, ip.tos >> 2, ip.tos & 0b11)
    framer.ip_id = ip.id - 1                # the framer numbers its frames from there
    return wire, framer.frame(p.sport, p.opcode, p.dqpn, p.psn, ackreq=p.ackreq, becn=p.becn,
                              ext=bytes(p.ext), payload=bytes(p.payload))


@pytest.mark.parametrize("psn", [0, 1000, PSN_MODULUS - 2, PSN_MODULUS - 1])
@pytest.mark.parametrize("kind", list(scapy_frames(0)))
def test_framer_is_byte_identical_to_scapy(kind, psn):
    wire, ours = rebuild(scapy_frames(psn)[kind])
    assert ours == wire


def test_framer_icrc_matches_an_independent_computation():
    path = roce.Path("02:fa:00:00:00:00", "02:fe:00:00:00:03", "10.1.0.1", "10.1.1.1")
    framer = roce.Framer(path, 26, 2)
    for psn in (0, PSN_MODULUS - 1, PSN_MODULUS):
        frame = framer.frame(0xC123, Opcode.RDMA_WRITE_FIRST, QP, psn,
                             ext=roce.reth(0x1000, 9, 3000), payload=bytes(range(256)) * 4)
        on_wire, computed = icrc_by_spec(frame)
        assert on_wire == computed


def test_parse_reads_what_the_framer_wrote():
    path = roce.Path("02:fa:00:00:00:00", "02:fe:00:00:00:03", "10.1.0.1", "10.1.1.1")
    frame = roce.Framer(path, 26, 3).frame(0xC001, Opcode.ACKNOWLEDGE, 77, PSN_MODULUS + 5,
                                           ext=roce.aeth(AethSyndrome.ACK, 9))
    p = roce.parse(frame)
    assert (p.opcode, p.dqpn, p.psn, p.syndrome, p.msn, p.ce, p.src_ip) == \
        (Opcode.ACKNOWLEDGE, 77, 5, AethSyndrome.ACK, 9, True, "10.1.0.1")


def test_linux_qp_source_ports_are_in_the_roce_range_and_stable():
    ports = {roce.udp_sport_for_qp(q, 0x101) for q in range(0x100, 0x200)}
    assert all(0xC000 <= p <= 0xFFFF for p in ports) and len(ports) > 200
    assert roce.udp_sport_for_qp(0x123, 0x456) == roce.udp_sport_for_qp(0x123, 0x456)
