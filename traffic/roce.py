"""RoCE v2 frames as bytes: the transports' data path (build, parse, ICRC).

Scapy (packets.py) builds ~1k frames/s; transports need tens of thousands,
with real payloads, so they compose headers with struct and compute the ICRC
with zlib. tests/test_roce.py checks these bytes against Scapy's build.
"""
from __future__ import annotations

import socket
import struct
import zlib
from dataclasses import dataclass

from traffic.constants import (AETH_BYTES, BTH_BYTES, DSCP_TRIMMED, ICRC_BYTES, IMMDT_BYTES,
                               PSN_MODULUS, RETH_BYTES, ROCE_V2_UDP_PORT, Opcode)

ETH_BYTES, IPV4_BYTES, UDP_BYTES = 14, 20, 8
# what a full RDMA WRITE MIDDLE adds to its payload on the wire: the frame of an MTU
WRITE_OVERHEAD_BYTES = ETH_BYTES + IPV4_BYTES + UDP_BYTES + BTH_BYTES + ICRC_BYTES
ETH_P_IP = 0x0800
IP_TTL = 64
_ETH = struct.Struct("!6s6sH")
_IP = struct.Struct("!BBHHHBBH4s4s")
_UDP = struct.Struct("!HHHH")
_BTH = struct.Struct("!BBHII")          # opcode, SE|M|PadCnt|TVer, P_Key, FECN|BECN|resv|DestQP, AckReq|resv|PSN
_RETH = struct.Struct("!QII")
_IMM = struct.Struct("!I")
_AETH = struct.Struct("!I")             # syndrome (8) | MSN (24)
_ICRC = struct.Struct("<I")             # sent least significant byte first
_HDRS = struct.Struct("!" + _IP.format[1:] + _UDP.format[1:] + _BTH.format[1:])
ICRC_SEED = zlib.crc32(b"\xff" * 8)     # the ICRC starts over 8 bytes of ones (see icrc)
PADDING = (b"", b"\0", b"\0\0", b"\0\0\0")
DEFAULT_PKEY = 0xFFFF
BTH_OFFSET = ETH_BYTES + IPV4_BYTES + UDP_BYTES

# Which extension headers follow the BTH, by opcode.
HAS_RETH = {Opcode.RDMA_WRITE_FIRST, Opcode.RDMA_WRITE_ONLY, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE}
HAS_IMM = {Opcode.RDMA_WRITE_LAST_WITH_IMMEDIATE, Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE,
           Opcode.SEND_LAST_WITH_IMMEDIATE, Opcode.SEND_ONLY_WITH_IMMEDIATE}
HAS_AETH = {Opcode.ACKNOWLEDGE}


def mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def udp_sport_for_qp(local_qpn: int, remote_qpn: int) -> int:
    """The UDP source port Linux gives a RoCE v2 QP (rdma_get_udp_sport): a flow
    label hashed from both QP numbers, folded into 0xC000-0xFFFF. One QP, one port:
    which is why an RC flow stays on one ECMP path."""
    fl = local_qpn * remote_qpn
    fl ^= fl >> 20
    fl ^= fl >> 40
    fl &= 0xFFFFF
    low, high = fl & 0x3FFF, fl & 0xFC000
    return ((low ^ (high >> 14)) & 0x3FFF) | 0xC000


def internet_checksum(data: bytes) -> int:
    """RFC 1071: the IPv4 header checksum (over a header whose checksum is zero), ICMP's too."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total & 0xFFFF) + (total >> 16)
    total += total >> 16
    return ~total & 0xFFFF


def icrc(ip_udp_bth: bytes, rest: bytes) -> int:
    """The RoCE v2 ICRC: CRC-32 over 8 bytes of 0xFF, then IP/UDP/BTH with the
    fields routers may rewrite masked to ones (TOS, TTL, IP checksum, UDP checksum,
    the FECN/BECN/reserved byte of the BTH), then the rest of the packet."""
    h = bytearray(ip_udp_bth)
    h[1] = h[8] = 0xFF
    h[10:12] = h[26:28] = b"\xff\xff"
    h[IPV4_BYTES + UDP_BYTES + 4] = 0xFF
    return zlib.crc32(rest, zlib.crc32(bytes(h), ICRC_SEED))


@dataclass(frozen=True)
class Path:
    """One direction between two GPU NICs: addresses and the next hop's MAC."""
    src_mac: str
    next_hop_mac: str
    src_ip: str
    dst_ip: str


class Framer:
    """Builds RoCE v2 frames for one Path. Per frame it packs the IPv4/UDP/BTH headers
    twice, as sent and with the ICRC's masked fields set to ones, and joins the
    pieces once: no header is copied or edited byte by byte (the transports' packet
    rate rests on it)."""

    def __init__(self, path: Path, dscp: int, ecn: int):
        self.eth = _ETH.pack(mac_bytes(path.next_hop_mac), mac_bytes(path.src_mac), ETH_P_IP)
        self.src_ip, self.dst_ip = socket.inet_aton(path.src_ip), socket.inet_aton(path.dst_ip)
        self.tos = dscp << 2 | ecn
        self.ip_id = 0
        # the IPv4 checksum's sum over the words that are the same in every frame
        # (all but the total length and the identification)
        fixed = _IP.pack(0x45, self.tos, 0, 0, 0x4000, IP_TTL, socket.IPPROTO_UDP, 0,
                         self.src_ip, self.dst_ip)
        self.fixed_sum = sum(struct.unpack("!10H", fixed))

    def frame(self, sport: int, opcode: int, dqpn: int, psn: int, *, ackreq: bool = False,
              becn: bool = False, ext: bytes = b"", payload: bytes = b"") -> bytes:
        pad = -len(payload) % 4
        udp_len = UDP_BYTES + BTH_BYTES + len(ext) + len(payload) + pad + ICRC_BYTES
        ip_len = IPV4_BYTES + udp_len
        self.ip_id = ip_id = (self.ip_id + 1) & 0xFFFF
        csum = self.fixed_sum + ip_len + ip_id
        csum = (csum & 0xFFFF) + (csum >> 16)
        csum = ~(csum + (csum >> 16)) & 0xFFFF
        qp_word, psn_word = dqpn & 0xFFFFFF, ackreq << 31 | psn % PSN_MODULUS
        hdrs = _HDRS.pack(0x45, self.tos, ip_len, ip_id, 0x4000, IP_TTL, socket.IPPROTO_UDP,
                          csum, self.src_ip, self.dst_ip, sport, ROCE_V2_UDP_PORT, udp_len, 0,
                          opcode, pad << 4, DEFAULT_PKEY, becn << 30 | qp_word, psn_word)
        # the same with what icrc() masks set to ones: TOS, TTL, both checksums, the
        # FECN/BECN byte
        masked = _HDRS.pack(0x45, 0xFF, ip_len, ip_id, 0x4000, 0xFF, socket.IPPROTO_UDP,
                            0xFFFF, self.src_ip, self.dst_ip, sport, ROCE_V2_UDP_PORT, udp_len,
                            0xFFFF, opcode, pad << 4, DEFAULT_PKEY, 0xFF000000 | qp_word,
                            psn_word)
        crc = zlib.crc32(payload, zlib.crc32(ext, zlib.crc32(masked, ICRC_SEED)))
        if pad:
            crc = zlib.crc32(PADDING[pad], crc)
        return b"".join((self.eth, hdrs, ext, payload, PADDING[pad], _ICRC.pack(crc)))


def reth(va: int, rkey: int, length: int) -> bytes:
    return _RETH.pack(va, rkey, length)


def immdt(imm: int) -> bytes:
    return _IMM.pack(imm)


def aeth(syndrome: int, msn: int) -> bytes:
    return _AETH.pack(syndrome << 24 | (msn % PSN_MODULUS))


@dataclass
class Parsed:
    """What a transport needs of a received RoCE v2 frame."""
    opcode: int
    dqpn: int
    psn: int
    ackreq: bool
    becn: bool
    ce: bool               # the IP ECN field says Congestion Experienced
    sport: int
    src_ip: str
    ext: memoryview        # bytes between BTH and payload (by opcode)
    payload: memoryview    # padding removed
    va: int = 0
    rkey: int = 0
    dma_len: int = 0
    imm: int | None = None
    syndrome: int | None = None
    msn: int | None = None
    trimmed: bool = False  # a switch cut it to its headers (its DSCP says so): no payload
    plane: int = 0         # the NIC port (plane) it came in on: the NIC says


class Malformed(ValueError):
    """Not a valid RoCE v2 frame for the lab (counted and dropped, never fatal)."""


def parse(frame: bytes, ext_bytes: dict[int, int] | None = None) -> Parsed | None:
    """Parse a frame; None if it is not RoCE v2 (not for the transports at all);
    Malformed if it claims to be and is broken (bad ICRC, truncated, bad lengths).
    `ext_bytes` gives the extension length for opcodes beyond the standard ones."""
    if len(frame) < BTH_OFFSET or frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_UDP:
        return None
    if frame[14] != 0x45:
        return None                       # IP options: the lab never sends them
    sport, dport, udp_len, _ = _UDP.unpack_from(frame, ETH_BYTES + IPV4_BYTES)
    if dport != ROCE_V2_UDP_PORT:
        return None
    end = ETH_BYTES + IPV4_BYTES + udp_len   # Ethernet padding excluded
    # a trimmed packet kept its headers only: its ICRC was cut with its payload
    trimmed = frame[15] >> 2 == DSCP_TRIMMED
    icrc_bytes = 0 if trimmed else ICRC_BYTES
    if udp_len < UDP_BYTES + BTH_BYTES + icrc_bytes or end > len(frame):
        raise Malformed("truncated")
    mv = memoryview(frame)
    if not trimmed and icrc(frame[ETH_BYTES:BTH_OFFSET + BTH_BYTES],
                            mv[BTH_OFFSET + BTH_BYTES:end - ICRC_BYTES]) != \
            _ICRC.unpack_from(frame, end - ICRC_BYTES)[0]:
        raise Malformed("bad ICRC")
    opcode, flags, _, word1, word2 = _BTH.unpack_from(frame, BTH_OFFSET)
    pos = BTH_OFFSET + BTH_BYTES
    p = Parsed(opcode=opcode, dqpn=word1 & 0xFFFFFF, psn=word2 & 0xFFFFFF,
               ackreq=bool(word2 >> 31), becn=bool(word1 >> 30 & 1),
               ce=(frame[15] & 0b11) == 0b11, sport=sport,
               src_ip=socket.inet_ntoa(frame[26:30]), ext=mv[pos:pos], payload=mv[pos:pos],
               trimmed=trimmed)
    ext_len = 0
    if opcode in HAS_RETH:
        p.va, p.rkey, p.dma_len = _RETH.unpack_from(frame, pos)
        ext_len += RETH_BYTES
    if opcode in HAS_IMM:
        (p.imm,) = _IMM.unpack_from(frame, pos + ext_len)
        ext_len += IMMDT_BYTES
    if opcode in HAS_AETH:
        (a,) = _AETH.unpack_from(frame, pos)
        p.syndrome, p.msn = a >> 24, a & 0xFFFFFF
        ext_len += AETH_BYTES
    if ext_bytes and opcode in ext_bytes:
        ext_len += ext_bytes[opcode]
    pad = 0 if trimmed else flags >> 4 & 0b11
    pay_end = end - icrc_bytes - pad
    if pos + ext_len > pay_end:
        raise Malformed("headers longer than the packet")
    p.ext = mv[pos:pos + ext_len]
    p.payload = mv[pos + ext_len:pos + ext_len] if trimmed else mv[pos + ext_len:pay_end]
    return p
