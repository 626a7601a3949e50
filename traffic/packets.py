"""Scapy layers and frame builders for the lab's RoCE v2, PFC and PAUSE traffic.

scapy.contrib.roce already provides BTH (with the ICRC as a trailer computed at
build time), AETH and the CNP layout, and binds UDP port 4791 to BTH and the
ACKNOWLEDGE opcode to AETH. This module adds what RDMA WRITE needs: RETH and
ImmDt, bound after BTH by opcode so raw frames dissect back into them, and the
lab's MRC convention: data packets and the SACK with its SACKX header (see the
MRC section below; traffic/wireshark/fabriclab_mrc.lua shows both in Wireshark).

Builders return complete Ether frames as Scapy packets, for captures, samples
and tests. Scapy builds only about a thousand RoCE frames a second (its ICRC code
rebuilds the packet): the transports compose their frames as bytes instead
(traffic/roce.py), byte for byte what these builders make (tests/test_roce.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from scapy.contrib import roce
from scapy.contrib.mac_control import MACControlClassBasedFlowControl, MACControlPause
from scapy.contrib.roce import AETH, BTH
from scapy.fields import ByteField, FlagsField, IntField, ShortField, XIntField, XLongField
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Packet, Raw, bind_bottom_up

from traffic.constants import (DEFAULT_MTU_BYTES, DSCP_CNP, DSCP_ROCE_DATA, DSCP_TRIMMED,
                               MAC_CONTROL_DST_MAC, MAC_CONTROL_ETHERTYPE, MRC_IMM_COUNT_BITS,
                               MRC_MAX_PACKETS_PER_MESSAGE, MRC_MESSAGE_ID_MODULUS,
                               MRC_NACK_CODE_TRIMMED, MRC_PROBE_FLAG_REPLY, MRC_SACK_BITMAP_BITS,
                               MRC_SACK_FLAG_ECN_ECHO, PAUSE_QUANTA_MAX, PAYLOAD_ALIGN_BYTES,
                               PFC_PRIORITY_COUNT, PSN_MODULUS, ROCE_V2_UDP_PORT,
                               TRIMMED_FRAME_BYTES, AethSyndrome, Ecn, Opcode)


class ImmDt(Packet):
    """Immediate Data: 4 bytes handed to the responder's completion, not written to memory."""
    name = "ImmDt"
    fields_desc = [XIntField("imm", 0)]


class RETH(Packet):
    """RDMA Extended Transport Header: where the whole message lands in responder memory."""
    name = "RETH"
    fields_desc = [
        XLongField("va", 0),        # virtual address of the first byte of the message
        XIntField("rkey", 0),       # remote key authorizing access to that memory
        IntField("dma_len", 0),     # length of the whole message, not of this packet
    ]

    def guess_payload_class(self, payload: bytes):
        # Nothing in RETH says whether ImmDt follows; the opcode of the BTH below does.
        bth = self.underlayer
        if isinstance(bth, BTH) and bth.opcode == Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE:
            return ImmDt
        return super().guess_payload_class(payload)


# The WRITE packets that open a message, the only ones carrying a RETH.
_RETH_OPCODES = (Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY,
                 Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE)

# Dissection only: RETH follows three different opcodes, so no one opcode could be
# implied when building; the builders below always set the opcode themselves.
for _op in _RETH_OPCODES:
    bind_bottom_up(BTH, RETH, opcode=_op)
bind_bottom_up(BTH, ImmDt, opcode=Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE)


@dataclass(frozen=True)
class Endpoints:
    """Addressing of one direction of a RoCE v2 flow, Ethernet to UDP."""
    src_mac: str = "02:00:00:00:00:01"
    dst_mac: str = "02:00:00:00:00:02"
    src_ip: str = "10.0.0.1"
    dst_ip: str = "10.0.0.2"
    # RoCE v2 leaves the UDP source port free as flow entropy for ECMP hashing;
    # NICs pick it from the dynamic range.
    src_port: int = 0xC000


DEFAULT_ENDPOINTS = Endpoints()


def _roce_udp(ep: Endpoints, dscp: int, ecn: Ecn) -> Packet:
    """Ether/IPv4/UDP headers of a RoCE v2 frame, to put a BTH on."""
    return (Ether(src=ep.src_mac, dst=ep.dst_mac)
            / IP(src=ep.src_ip, dst=ep.dst_ip, tos=dscp << 2 | ecn, flags="DF")
            # The ICRC protects the payload end to end, so RoCE v2 over IPv4 sends
            # no UDP checksum (zero, as NICs do).
            / UDP(sport=ep.src_port, dport=ROCE_V2_UDP_PORT, chksum=0))


def _write_opcodes(segments: int, with_imm: bool) -> list[Opcode]:
    """Opcode of each packet of an RDMA WRITE message of `segments` packets."""
    if segments == 1:
        return [Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE if with_imm else Opcode.RDMA_WRITE_ONLY]
    last = Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE if with_imm else Opcode.RDMA_WRITE_LAST
    return [Opcode.RDMA_WRITE_FIRST] + [Opcode.RDMA_WRITE_MIDDLE] * (segments - 2) + [last]


def rc_write_packets(message: bytes, *, dst_qp: int, psn: int, va: int, rkey: int,
                     imm: int | None = None, mtu: int = DEFAULT_MTU_BYTES,
                     endpoints: Endpoints = DEFAULT_ENDPOINTS) -> list[Packet]:
    """One RC RDMA WRITE of `message` to `va`, segmented at `mtu`: FIRST/MIDDLE.../LAST or ONLY.

    Packets take consecutive PSNs from `psn` (mod 2**24). With `imm`, the last
    packet is the WITH_IMMEDIATE variant carrying it. The last packet asks for an
    ACK, as a requester does once per message.
    """
    if mtu <= 0 or mtu % PAYLOAD_ALIGN_BYTES:
        raise ValueError(f"MTU must be a positive multiple of {PAYLOAD_ALIGN_BYTES}, got {mtu}")
    # An empty message is still one WRITE ONLY packet.
    chunks = [message[i:i + mtu] for i in range(0, len(message), mtu)] or [b""]
    opcodes = _write_opcodes(len(chunks), imm is not None)
    frames = []
    for i, (opcode, chunk) in enumerate(zip(opcodes, chunks)):
        last = i == len(chunks) - 1
        pad = -len(chunk) % PAYLOAD_ALIGN_BYTES   # only the last chunk can be short
        pkt = _roce_udp(endpoints, DSCP_ROCE_DATA, Ecn.ECT_0) / BTH(
            opcode=opcode, dqpn=dst_qp, psn=(psn + i) % PSN_MODULUS, padcount=pad, ackreq=last)
        if opcode in _RETH_OPCODES:
            pkt /= RETH(va=va, rkey=rkey, dma_len=len(message))
        if imm is not None and last:
            pkt /= ImmDt(imm=imm)
        if chunk:
            pkt /= Raw(chunk + bytes(pad))
        frames.append(pkt)
    return frames


def _aeth_frame(syndrome: AethSyndrome, psn: int, msn: int, dst_qp: int,
                endpoints: Endpoints) -> Packet:
    # Responses ride the data class so they are not reordered against it, but are
    # not ECN-capable: congestion is signalled on the data path only.
    return (_roce_udp(endpoints, DSCP_ROCE_DATA, Ecn.NOT_ECT)
            / BTH(opcode=Opcode.ACKNOWLEDGE, dqpn=dst_qp, psn=psn % PSN_MODULUS)
            / AETH(syndrome=syndrome, msn=msn % PSN_MODULUS))


def ack(psn: int, msn: int, *, dst_qp: int = 0,
        endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """ACK of every packet up to `psn`; `msn` counts the messages completed."""
    return _aeth_frame(AethSyndrome.ACK, psn, msn, dst_qp, endpoints)


def nak_seq_error(psn: int, msn: int, *, dst_qp: int = 0,
                  endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """NAK for a PSN gap: `psn` is the one the responder expected; the requester resends from it."""
    return _aeth_frame(AethSyndrome.NAK_PSN_SEQUENCE_ERROR, psn, msn, dst_qp, endpoints)


def cnp(dst_qp: int, *, endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """Congestion Notification Packet telling the sender of QP `dst_qp` to slow down (DCQCN)."""
    return _roce_udp(endpoints, DSCP_CNP, Ecn.NOT_ECT) / roce.cnp(dst_qp)


def pfc_pause(quanta: Mapping[int, int], *, src_mac: str = DEFAULT_ENDPOINTS.src_mac) -> Packet:
    """PFC frame pausing each priority in `quanta` for its number of 512-bit-time quanta."""
    fields = {}
    for prio, q in quanta.items():
        if not 0 <= prio < PFC_PRIORITY_COUNT:
            raise ValueError(f"PFC priority must be 0..{PFC_PRIORITY_COUNT - 1}, got {prio}")
        if not 0 <= q <= PAUSE_QUANTA_MAX:
            raise ValueError(f"pause quanta must be 0..{PAUSE_QUANTA_MAX}, got {q}")
        fields[f"c{prio}_enabled"] = 1
        fields[f"c{prio}_pause_time"] = q
    # Scapy's MAC Control layers pad the frame to the 64-byte minimum themselves.
    return (Ether(dst=MAC_CONTROL_DST_MAC, src=src_mac, type=MAC_CONTROL_ETHERTYPE)
            / MACControlClassBasedFlowControl(**fields))


def pfc_resume(priorities: Iterable[int], *, src_mac: str = DEFAULT_ENDPOINTS.src_mac) -> Packet:
    """PFC frame resuming `priorities` at once: enabled with a pause time of zero."""
    return pfc_pause(dict.fromkeys(priorities, 0), src_mac=src_mac)


def pause_8023x(quanta: int, *, src_mac: str = DEFAULT_ENDPOINTS.src_mac) -> Packet:
    """802.3x PAUSE: stops the whole link, every priority, for `quanta` (0 resumes)."""
    if not 0 <= quanta <= PAUSE_QUANTA_MAX:
        raise ValueError(f"pause quanta must be 0..{PAUSE_QUANTA_MAX}, got {quanta}")
    return (Ether(dst=MAC_CONTROL_DST_MAC, src=src_mac, type=MAC_CONTROL_ETHERTYPE)
            / MACControlPause(pause_time=quanta))


# --- MRC (Multipath Reliable Connection) -----------------------------------
#
# The lab's multipath transport rides RoCE v2 frames, so switches, tshark and Scapy
# handle it unchanged. The lab's own parts: what the data packets' immediate means,
# and the SACK, a manufacturer-specific opcode with its SACKX extension header.
#
# Data: an RDMA WRITE ONLY WITH IMMEDIATE per packet, ECT(0), no AckReq:
#   Ether / IPv4 (DSCP 26, ECT(0)) / UDP (sport = EV, dport 4791) / BTH (0x0B)
#   / RETH (va of THIS packet's bytes, rkey, dma_len = this packet's payload)
#   / ImmDt (message id << 16 | packets in the message) / payload / ICRC
# Each packet takes its own UDP source port, the entropy value (EV), so ECMP
# spreads a message over paths; its RETH makes it placeable in any order.
#
# SACK: Ether / IPv4 (DSCP 26, Not-ECT) / UDP (a fixed sport, dport 4791)
#   / BTH (opcode 0xC1, dqpn = the data sender's QP, psn = cumulative ACK)
#   / SACKX (16 bytes, below) / ICRC
# The ICRC covers the SACKX like any header after the BTH.
#
# Trimmed data: what a switch that trims (instead of dropping) forwards of a data
# packet: its first 74 bytes (Ether to ImmDt), DSCP rewritten to 40, IPv4 and UDP
# lengths to match; no payload, no ICRC.
# NACK: as a SACK, with opcode 0xC2, psn = the trimmed packet's, then NACKX (4 bytes:
# EV, code 1 = trimmed, flags) / ICRC: the receiver asks for that one packet again.


class MrcSack(Packet):
    """SACKX: what arrived past the cumulative ACK (the BTH PSN), and the sender's credit.

    Byte layout, big-endian like every IB header:
      0-7    bitmap      bit i (least significant = 0) set: PSN cum_psn + 1 + i arrived
      8-9    ev          UDP source port of the data packet that triggered this SACK
      10     flags       bit 0: ECN echo, that packet arrived CE-marked; others 0
      11     reserved    0
      12-15  credit_psn  the sender may send PSNs below this one (24-bit PSN, high byte 0)
    """
    name = "MRC SACKX"
    fields_desc = [
        XLongField("bitmap", 0),
        ShortField("ev", 0),
        FlagsField("flags", 0, 8, {MRC_SACK_FLAG_ECN_ECHO: "ECN_ECHO"}),
        ByteField("reserved", 0),
        IntField("credit_psn", 0),
    ]


# Dissection only, like RETH: the builder sets the opcode itself.
bind_bottom_up(BTH, MrcSack, opcode=Opcode.MRC_SACK)


def mrc_imm(message_id: int, packets_in_message: int) -> int:
    """Immediate of an MRC data packet: message id (taken mod 2**16) high, packet count low."""
    if not 1 <= packets_in_message <= MRC_MAX_PACKETS_PER_MESSAGE:
        raise ValueError(f"packets in a message must be 1..{MRC_MAX_PACKETS_PER_MESSAGE}, "
                         f"got {packets_in_message}")
    return (message_id % MRC_MESSAGE_ID_MODULUS) << MRC_IMM_COUNT_BITS | packets_in_message


def mrc_data(payload: bytes, *, dst_qp: int, psn: int, ev: int, va: int, rkey: int,
             message_id: int, packets_in_message: int,
             endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """One MRC data packet: `payload` written at `va`, sent on UDP source port `ev`.

    `ev` replaces endpoints.src_port. The PSN is taken mod 2**24.
    """
    pad = -len(payload) % PAYLOAD_ALIGN_BYTES
    pkt = (_roce_udp(replace(endpoints, src_port=ev), DSCP_ROCE_DATA, Ecn.ECT_0)
           # No AckReq: MRC receivers answer with SACKs, not RC ACKs. It is also what
           # tells this from an RC WRITE ONLY WITH IMMEDIATE, which ends a message and
           # asks for its ACK.
           / BTH(opcode=Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE, dqpn=dst_qp,
                 psn=psn % PSN_MODULUS, padcount=pad, ackreq=0)
           / RETH(va=va, rkey=rkey, dma_len=len(payload))
           / ImmDt(imm=mrc_imm(message_id, packets_in_message)))
    if payload:
        pkt /= Raw(payload + bytes(pad))
    return pkt


def sack_bitmap(cum_psn: int, received_psns: Iterable[int]) -> int:
    """SACKX bitmap of `received_psns`, each one of the 64 PSNs after `cum_psn` (mod 2**24)."""
    bitmap = 0
    for psn in received_psns:
        bit = (psn - cum_psn - 1) % PSN_MODULUS
        if bit >= MRC_SACK_BITMAP_BITS:
            raise ValueError(f"PSN {psn} is not among the {MRC_SACK_BITMAP_BITS} PSNs after "
                             f"the cumulative ACK {cum_psn}")
        bitmap |= 1 << bit
    return bitmap


def mrc_sack(cum_psn: int, *, dst_qp: int, ev: int, credit_psn: int,
             received_psns: Iterable[int] | None = None, bitmap: int | None = None,
             ecn_echo: bool = False, endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """MRC selective ACK to the sender of QP `dst_qp`: every PSN before `cum_psn` arrived.

    What arrived beyond it is given as `received_psns` or as a ready `bitmap`, one
    of the two. `ev` and `ecn_echo` describe the data packet this SACK answers.
    The SACK goes back on that same EV (its UDP source port is `ev`), so SACKs are
    sprayed like the data and a dead path cannot take them all. PSNs are taken
    mod 2**24.
    """
    if (received_psns is None) == (bitmap is None):
        raise ValueError("give either received_psns or bitmap")
    if bitmap is None:
        bitmap = sack_bitmap(cum_psn, received_psns)
    elif not 0 <= bitmap < 1 << MRC_SACK_BITMAP_BITS:
        raise ValueError(f"the SACK bitmap has {MRC_SACK_BITMAP_BITS} bits, got {bitmap:#x}")
    # Like ACKs: in the data class so as not to pass the data, and not ECN-capable.
    return (_roce_udp(replace(endpoints, src_port=ev), DSCP_ROCE_DATA, Ecn.NOT_ECT)
            / BTH(opcode=Opcode.MRC_SACK, dqpn=dst_qp, psn=cum_psn % PSN_MODULUS)
            / MrcSack(bitmap=bitmap, ev=ev, flags=MRC_SACK_FLAG_ECN_ECHO if ecn_echo else 0,
                      credit_psn=credit_psn % PSN_MODULUS))


class MrcNack(Packet):
    """NACKX: which packet the receiver asks for again (the BTH PSN), and why.

    Byte layout, big-endian:
      0-1    ev      UDP source port of the packet this NACK answers
      2      code    1: it arrived trimmed
      3      flags   bit 0: ECN echo, as in the SACKX
    """
    name = "MRC NACKX"
    fields_desc = [
        ShortField("ev", 0),
        ByteField("code", MRC_NACK_CODE_TRIMMED),
        FlagsField("flags", 0, 8, {MRC_SACK_FLAG_ECN_ECHO: "ECN_ECHO"}),
    ]


bind_bottom_up(BTH, MrcNack, opcode=Opcode.MRC_NACK)


def mrc_nack(psn: int, *, dst_qp: int, ev: int, ecn_echo: bool = False,
             endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """MRC NACK to the sender of QP `dst_qp`: packet `psn` arrived trimmed, resend it.
    Sent back on the EV `ev` it came on, like a SACK."""
    return (_roce_udp(replace(endpoints, src_port=ev), DSCP_ROCE_DATA, Ecn.NOT_ECT)
            / BTH(opcode=Opcode.MRC_NACK, dqpn=dst_qp, psn=psn % PSN_MODULUS)
            / MrcNack(ev=ev, code=MRC_NACK_CODE_TRIMMED,
                      flags=MRC_SACK_FLAG_ECN_ECHO if ecn_echo else 0))


def trimmed(frame: Packet) -> Packet:
    """What a trimming switch forwards of RoCE data `frame`: its headers (the first
    TRIMMED_FRAME_BYTES), with DSCP_TRIMMED and lengths and checksum that match."""
    raw = bytes(frame)
    if len(raw) <= TRIMMED_FRAME_BYTES:
        raise ValueError(f"a frame of {len(raw)} bytes has nothing to trim")
    cut = Ether(raw[:TRIMMED_FRAME_BYTES])
    ip = cut[IP]
    ip.tos = DSCP_TRIMMED << 2 | ip.tos & 0b11
    ip.len, ip.chksum = TRIMMED_FRAME_BYTES - 14, None
    cut[UDP].len = TRIMMED_FRAME_BYTES - 14 - 20
    return Ether(bytes(cut))


class MrcProbe(Packet):
    """PROBEX: the EV a sender probes out of band (on that EV), and whether this is the
    receiver's answer. Byte layout: 0-1 ev, 2 flags (bit 0: the answer), 3 reserved."""
    name = "MRC PROBEX"
    fields_desc = [
        ShortField("ev", 0),
        FlagsField("flags", 0, 8, {MRC_PROBE_FLAG_REPLY: "REPLY"}),
        ByteField("reserved", 0),
    ]


bind_bottom_up(BTH, MrcProbe, opcode=Opcode.MRC_PROBE)


def mrc_probe(number: int, *, dst_qp: int, ev: int, reply: bool = False,
              endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """An MRC probe of EV `ev` (sent on it), or with `reply` the receiver's answer (on it
    too): number `number` in the BTH PSN."""
    return (_roce_udp(replace(endpoints, src_port=ev), DSCP_ROCE_DATA, Ecn.NOT_ECT)
            / BTH(opcode=Opcode.MRC_PROBE, dqpn=dst_qp, psn=number % PSN_MODULUS)
            / MrcProbe(ev=ev, flags=MRC_PROBE_FLAG_REPLY if reply else 0))


class MrcCreditRequest(Packet):
    """CREQX: what the sender has not sent yet (RCCC asks the receiver for credit: the
    BTH PSN is the credit edge it wants, the PSN after its last packet).
    Byte layout, big-endian: 0-3 backlog in bytes."""
    name = "MRC CREQX"
    fields_desc = [IntField("backlog", 0)]


bind_bottom_up(BTH, MrcCreditRequest, opcode=Opcode.MRC_CREDIT_REQUEST)


def mrc_credit_request(wanted_psn: int, *, dst_qp: int, ev: int, backlog_bytes: int,
                       endpoints: Endpoints = DEFAULT_ENDPOINTS) -> Packet:
    """An MRC credit request to the receiver of QP `dst_qp`: credit up to `wanted_psn`
    for the `backlog_bytes` not yet sent; sent on EV `ev`, like data."""
    return (_roce_udp(replace(endpoints, src_port=ev), DSCP_ROCE_DATA, Ecn.NOT_ECT)
            / BTH(opcode=Opcode.MRC_CREDIT_REQUEST, dqpn=dst_qp, psn=wanted_psn % PSN_MODULUS)
            / MrcCreditRequest(backlog=backlog_bytes))
