"""One frame of every kind the lab puts on the wire, in a pcap to read in Wireshark.

`fabriclab samples --out FILE.pcap` writes them. Wireshark decodes the RoCE v2,
PFC and PAUSE frames by itself; WIRESHARK_LUA adds the lab's MRC convention.

The frames tell a short story between GPU hosts g0 (10.1.0.1) and g1 (10.1.1.1):
an RC RDMA WRITE of three packets and one of a single packet, their ACK, a NAK, a
CNP; an MRC message of four packets, each sprayed on its own entropy value, and the
SACK reporting that the second was lost; the second resent on another EV, trimmed by
a switch whose queue was full, and g1's NACK asking for it again; then g1 pausing
and resuming the data priority with PFC, and pausing the whole link with 802.3x.
"""
from __future__ import annotations

from pathlib import Path

from scapy.packet import Packet
from scapy.utils import wrpcap

from traffic.constants import DEFAULT_MTU_BYTES, PAUSE_QUANTA_MAX, PRIORITY_ROCE_DATA
from traffic.packets import (Endpoints, ack, cnp, mrc_data, mrc_nack, mrc_sack, nak_seq_error,
                             pause_8023x, pfc_pause, pfc_resume, rc_write_packets, trimmed)

WIRESHARK_LUA = Path(__file__).resolve().parent / "wireshark" / "fabriclab_mrc.lua"

_G0_MAC, _G1_MAC = "02:fa:00:00:00:00", "02:fa:00:00:00:01"
_G0_IP, _G1_IP = "10.1.0.1", "10.1.1.1"

# RC: one QP pair, one UDP source port per direction.
_RC_G0 = Endpoints(src_mac=_G0_MAC, dst_mac=_G1_MAC, src_ip=_G0_IP, dst_ip=_G1_IP, src_port=0xC35A)
_RC_G1 = Endpoints(src_mac=_G1_MAC, dst_mac=_G0_MAC, src_ip=_G1_IP, dst_ip=_G0_IP, src_port=0xE2B1)
_RC_QP_G0, _RC_QP_G1 = 0x000011, 0x000012

# MRC: g0 sprays data from a base port on; g1 SACKs from its own base port.
_MRC_G0 = Endpoints(src_mac=_G0_MAC, dst_mac=_G1_MAC, src_ip=_G0_IP, dst_ip=_G1_IP, src_port=0xD100)
_MRC_G1 = Endpoints(src_mac=_G1_MAC, dst_mac=_G0_MAC, src_ip=_G1_IP, dst_ip=_G0_IP, src_port=0xD200)
_MRC_QP_G0, _MRC_QP_G1 = 0x000021, 0x000022
_MRC_EVS = (0xD101, 0xD102, 0xD103, 0xD104)

_REGION_VA = 0x1000_0000   # base of g1's registered memory
_RKEY = 0x1234
_MTU = DEFAULT_MTU_BYTES


def _message(length: int) -> bytes:
    """Recognizable filler: a byte counter."""
    return bytes(i % 256 for i in range(length))


def _rc_frames() -> list[tuple[str, Packet]]:
    first, middle, last = rc_write_packets(_message(2 * _MTU + 100), dst_qp=_RC_QP_G1, psn=1000,
                                           va=_REGION_VA, rkey=_RKEY, endpoints=_RC_G0)
    [only] = rc_write_packets(_message(64), dst_qp=_RC_QP_G1, psn=1003,
                              va=_REGION_VA + 4 * _MTU, rkey=_RKEY, endpoints=_RC_G0)
    return [
        ("RC RDMA WRITE FIRST, PSN 1000 (message of 3 packets)", first),
        ("RC RDMA WRITE MIDDLE, PSN 1001", middle),
        ("RC RDMA WRITE LAST, PSN 1002, asks for an ACK", last),
        ("RC RDMA WRITE ONLY, PSN 1003 (message of 1 packet)", only),
        ("RC ACK up to PSN 1003, 2 messages complete",
         ack(1003, 2, dst_qp=_RC_QP_G0, endpoints=_RC_G1)),
        ("RC NAK (PSN sequence error): expected PSN 1004, resend from it",
         nak_seq_error(1004, 2, dst_qp=_RC_QP_G0, endpoints=_RC_G1)),
        ("CNP: g1 saw CE marks, g0's QP slows down (DCQCN)", cnp(_RC_QP_G0, endpoints=_RC_G1)),
    ]


def _mrc_frames() -> list[tuple[str, Packet]]:
    message_id, first_psn, count = 7, 500, len(_MRC_EVS)
    frames = []
    for i, ev in enumerate(_MRC_EVS):
        psn = first_psn + i
        frame = mrc_data(_message(_MTU), dst_qp=_MRC_QP_G1, psn=psn, ev=ev,
                         va=_REGION_VA + i * _MTU, rkey=_RKEY, message_id=message_id,
                         packets_in_message=count, endpoints=_MRC_G0)
        frames.append((f"MRC data, message {message_id} packet {i + 1} of {count}, PSN {psn}, "
                       f"EV {ev}", frame))
    # The second packet was lost: the first arrived, then the last two, the last CE-marked.
    cum_psn, sacked = first_psn + 1, [first_psn + 2, first_psn + 3]
    credit_psn = cum_psn + 64   # g1 lets g0 run 64 packets past what it has in order
    sack = mrc_sack(cum_psn, dst_qp=_MRC_QP_G0, received_psns=sacked, ev=_MRC_EVS[-1],
                    ecn_echo=True, credit_psn=credit_psn, endpoints=_MRC_G1)
    frames.append((f"MRC SACK: every PSN before {cum_psn} arrived, and {sacked[0]}, {sacked[1]}; "
                   f"ECN echo; credit up to PSN {credit_psn}", sack))
    # g0 resends the lost packet on another EV; a full queue on the way trims it
    ev = _MRC_EVS[0]
    resent = mrc_data(_message(_MTU), dst_qp=_MRC_QP_G1, psn=cum_psn, ev=ev,
                      va=_REGION_VA + _MTU, rkey=_RKEY, message_id=message_id,
                      packets_in_message=count, endpoints=_MRC_G0)
    frames.append((f"MRC data PSN {cum_psn} resent on EV {ev}, trimmed by a switch: its "
                   f"headers only, DSCP 40", trimmed(resent)))
    frames.append((f"MRC NACK: PSN {cum_psn} arrived trimmed, resend it",
                   mrc_nack(cum_psn, dst_qp=_MRC_QP_G0, ev=ev, endpoints=_MRC_G1)))
    return frames


def _flow_control_frames() -> list[tuple[str, Packet]]:
    return [
        (f"PFC pause of priority {PRIORITY_ROCE_DATA} (RoCE data), {PAUSE_QUANTA_MAX} quanta",
         pfc_pause({PRIORITY_ROCE_DATA: PAUSE_QUANTA_MAX}, src_mac=_G1_MAC)),
        (f"PFC resume of priority {PRIORITY_ROCE_DATA}",
         pfc_resume([PRIORITY_ROCE_DATA], src_mac=_G1_MAC)),
        ("802.3x PAUSE of the whole link, 256 quanta", pause_8023x(256, src_mac=_G1_MAC)),
    ]


def sample_frames() -> list[tuple[str, Packet]]:
    """(description, frame) for one frame of each kind the lab sends, in story order."""
    return _rc_frames() + _mrc_frames() + _flow_control_frames()


def write_samples(path: str | Path) -> list[tuple[str, Packet]]:
    """Write sample_frames() to the pcap `path`; return them."""
    samples = sample_frames()
    wrpcap(str(path), [frame for _, frame in samples])
    return samples
