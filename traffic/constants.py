"""Protocol constants of the lab's packet layer: the one place they are written down.

RoCE v2 values follow the InfiniBand Architecture Specification (IBA) vol. 1 and
its Annex A17 (RoCE v2); PFC and PAUSE follow IEEE 802.1Qbb and 802.3 Annex 31B.
The DSCP/priority plan is the lab's own, chosen to match common RoCE deployments;
so is MRC, a multipath transport carried in RoCE v2 frames (see traffic/packets.py).
"""
from __future__ import annotations

from enum import IntEnum

# --- RoCE v2 encapsulation -------------------------------------------------

ROCE_V2_UDP_PORT = 4791   # IANA-assigned UDP destination port of RoCE v2


class Opcode(IntEnum):
    """BTH opcodes the lab sends or decodes: RC transport (IBA vol. 1), the RoCE v2 CNP
    (Annex A17) and the lab's MRC selective ACK. The lab's transports write; SENDs are
    decoded in real RoCE peers' traffic (Soft-RoCE's ib_send_bw)."""
    SEND_FIRST = 0x00
    SEND_MIDDLE = 0x01
    SEND_LAST = 0x02
    SEND_LAST_WITH_IMMEDIATE = 0x03
    SEND_ONLY = 0x04
    SEND_ONLY_WITH_IMMEDIATE = 0x05
    RDMA_WRITE_FIRST = 0x06
    RDMA_WRITE_MIDDLE = 0x07
    RDMA_WRITE_LAST = 0x08
    RDMA_WRITE_LAST_WITH_IMMEDIATE = 0x09
    RDMA_WRITE_ONLY = 0x0A
    RDMA_WRITE_ONLY_WITH_IMMEDIATE = 0x0B
    ACKNOWLEDGE = 0x11
    CNP = 0x81
    # IBA reserves 0xC0-0xFF for manufacturer-specific opcodes: the lab takes four for
    # MRC's control packets, so no standard RoCE stack mistakes them for its own.
    MRC_SACK = 0xC1
    MRC_NACK = 0xC2
    MRC_PROBE = 0xC3
    MRC_CREDIT_REQUEST = 0xC4


# The data opcodes (SENDs and RDMA WRITEs): every opcode up to this one. Above it, the
# ACKs, CNPs and MRC's control packets.
LAST_DATA_OPCODE = Opcode.RDMA_WRITE_ONLY_WITH_IMMEDIATE

# Transport header sizes, in bytes.
BTH_BYTES = 12     # Base Transport Header
RETH_BYTES = 16    # RDMA Extended Transport Header: VA, R_Key, DMA length
IMMDT_BYTES = 4    # Immediate Data
AETH_BYTES = 4     # ACK Extended Transport Header: syndrome, MSN
ICRC_BYTES = 4     # Invariant CRC, the last bytes of the UDP payload

# The payload of every IB packet is padded to a multiple of this (BTH PadCnt).
PAYLOAD_ALIGN_BYTES = 4

PSN_MODULUS = 2 ** 24   # PSNs (and MSNs) are 24-bit and wrap


class AethSyndrome(IntEnum):
    """AETH syndrome byte: bits 6-5 select ACK/RNR/NAK, bits 4-0 qualify it."""
    # ACK whose credit count is 0b11111, "invalid": this responder advertises no
    # end-to-end credits, so the requester must not throttle on them.
    ACK = 0x1F
    NAK_PSN_SEQUENCE_ERROR = 0x60   # NAK (0b11) with code 0: out-of-order PSN


DEFAULT_MTU_BYTES = 1024   # IB path MTU: payload bytes per packet, headers excluded


# --- MRC (Multipath Reliable Connection): the lab's convention -----------

# Data: RDMA WRITE ONLY WITH IMMEDIATE, one per packet, each sprayed on its own
# UDP source port (the entropy value, EV) with a RETH for its own bytes, so the
# receiver places packets in any order. Its immediate is not application data
# but (message id << 16) | packets in the message: the receiver counts packets
# to know when a message is complete.
MRC_IMM_COUNT_BITS = 16               # low half: packets in the message
MRC_MESSAGE_ID_MODULUS = 2 ** 16      # high half: the message id
MRC_MAX_PACKETS_PER_MESSAGE = 2 ** MRC_IMM_COUNT_BITS - 1

# SACK: a BTH with opcode MRC_SACK (PSN = cumulative ACK, the next PSN expected)
# then the 16-byte SACKX header: bitmap (64 bits; bit i set when PSN psn+1+i has
# arrived), EV (16, the UDP source port of the packet that triggered it),
# flags (8), reserved (8), credit PSN (32 bits, a 24-bit PSN in the low bits:
# the sender may send the PSNs below it).
MRC_SACKX_BYTES = 16
MRC_SACK_BITMAP_BITS = 64
MRC_SACK_FLAG_ECN_ECHO = 0x01         # the triggering packet arrived CE-marked

# NACK: a BTH with opcode MRC_NACK (PSN = the packet the receiver asks for again)
# then the 4-byte NACKX header: EV (16, the UDP source port of the packet it answers),
# code (8), flags (8, the SACK's ECN echo). A receiver sends one for each trimmed
# packet (code TRIMMED): the sender resends that packet at once, without its timer.
MRC_NACKX_BYTES = 4
MRC_NACK_CODE_TRIMMED = 0x01

# Probe: a BTH with opcode MRC_PROBE (PSN = the probe's number) then the 4-byte PROBEX
# header: EV (16, the port probed), flags (8: MRC_PROBE_FLAG_REPLY on the answer),
# reserved (8). A sender probes an EV it assumes bad out of band, on that EV; the
# receiver answers on the same EV: an answer readmits the EV, no data is risked on it.
MRC_PROBEX_BYTES = 4
MRC_PROBE_FLAG_REPLY = 0x01

# Credit request (RCCC, traffic/rccc.py): a BTH with opcode MRC_CREDIT_REQUEST (PSN =
# the credit edge the sender wants: the PSN past its last packet) then the 4-byte CREQX
# header: the sender's backlog in bytes (32: what it has not sent yet). The receiver
# grants credit in its SACKs' credit field, paced at its link's rate.
MRC_CREQX_BYTES = 4

# --- IP QoS ----------------------------------------------------------------

DSCP_ROCE_DATA = 26        # RoCE data, ACKs and NAKs travel in this class...
PRIORITY_ROCE_DATA = 3     # ...mapped to this lossless (PFC-protected) priority
DSCP_CNP = 48              # congestion notifications jump the data queues...
PRIORITY_CNP = 6           # ...on their own strict priority
# A switch that trims a data packet (UET's packet trimming; MRC's TRIM NACK) rewrites
# its DSCP to a configured value; the receiver knows a trimmed packet by it. The lab
# picks 40 (CS5) and queues trimmed headers with the CNPs: both are small signals
# that must not wait behind the data whose congestion they report.
DSCP_TRIMMED = 40
DSCP_PRIORITY = {DSCP_ROCE_DATA: PRIORITY_ROCE_DATA, DSCP_CNP: PRIORITY_CNP,
                 DSCP_TRIMMED: PRIORITY_CNP}  # else 0
# An express class for latency-bound RDMA beside the bulk (an inference server's KV-cache
# transfers beside training): AF41, its own lossy priority, served ahead of RoCE data
# where a fabric has it (lab/kernel/queues.py: QueueParams.express_class)
DSCP_EXPRESS = 34
PRIORITY_EXPRESS = 5
# What a trimmed frame keeps: the headers of an MRC data packet (Ethernet, IPv4, UDP,
# BTH, RETH, ImmDt); payload and ICRC are cut (lab/kernel/dataplane.h says the same)
TRIMMED_FRAME_BYTES = 14 + 20 + 8 + BTH_BYTES + RETH_BYTES + IMMDT_BYTES


class Ecn(IntEnum):
    """ECN codepoints, the low two bits of the IPv4 TOS byte (RFC 3168)."""
    NOT_ECT = 0b00
    ECT_1 = 0b01
    ECT_0 = 0b10
    CE = 0b11


# --- PFC and 802.3x PAUSE (MAC Control frames) -----------------------------

MAC_CONTROL_DST_MAC = "01:80:c2:00:00:01"   # reserved multicast, never forwarded by bridges
MAC_CONTROL_ETHERTYPE = 0x8808
MAC_CONTROL_OPCODE_PAUSE = 0x0001   # 802.3x: pause the whole link
MAC_CONTROL_OPCODE_PFC = 0x0101     # 802.1Qbb class-based flow control: per priority
PFC_PRIORITY_COUNT = 8
PAUSE_QUANTUM_BIT_TIMES = 512       # one pause quantum lasts 512 bit times at link speed
PAUSE_QUANTA_MAX = 0xFFFF           # pause_time fields are 16-bit

# --- Entropy values (EVs) in explicit mode ------------------------------------
# UDP source port EXPLICIT_EV_BASE + i takes the i-th of a switch's equal-cost
# ports (sorted by port number) toward any remote subnet: the controller installs
# that mapping, so a sender picks its path instead of leaving it to the hash.
EXPLICIT_EV_BASE = 0xE000
EXPLICIT_EV_MAX_PATHS = 64
# Generated EVs (MRC's generated EV profile: EVs built from fields, one per tier): an EV
# EXPLICIT_EV_BASE + value reads as EV_TIERS fields of EV_FIELD_BITS, field k naming the
# port at the k-th switch on the way up (EV_TIER_OF_ROLE: the leaf or edge switch's
# uplinks, then the aggregation switch's); EXPLICIT_EV_BASE + i is field 0 = i, the others
# 0. The fields fill the 12 bits below EXPLICIT_EV_BASE's top nibble.
EV_FIELD_BITS = 6                     # 2 ** 6 = EXPLICIT_EV_MAX_PATHS choices a tier
EV_TIERS = 2
EV_TIER_OF_ROLE = {"leaf": 0, "edge": 0, "agg": 1}
