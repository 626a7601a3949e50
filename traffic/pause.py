"""PFC (802.1Qbb) and PAUSE (802.3x) frames as bytes: built by switches, read by
switches and NICs. Scapy's MAC Control layers build the same frames (tested).

    Ethernet(dst 01:80:c2:00:00:01, type 0x8808) / opcode(16)
      PFC:   class-enable vector(16), 8 x pause time(16, quanta of 512 bit times)
      PAUSE: pause time(16) for the whole link
    padded to the 60-byte minimum frame (64 with the FCS the NIC adds).
"""
from __future__ import annotations

import struct

from traffic.constants import (MAC_CONTROL_DST_MAC, MAC_CONTROL_ETHERTYPE,
                               MAC_CONTROL_OPCODE_PAUSE, MAC_CONTROL_OPCODE_PFC,
                               PAUSE_QUANTA_MAX, PAUSE_QUANTUM_BIT_TIMES, PFC_PRIORITY_COUNT)

_PFC = struct.Struct("!HH8H")     # opcode, class-enable vector, 8 pause times
MIN_FRAME_BYTES = 60              # without the FCS
_DST = bytes.fromhex(MAC_CONTROL_DST_MAC.replace(":", ""))
_TYPE = MAC_CONTROL_ETHERTYPE.to_bytes(2, "big")


def is_mac_control(frame: bytes) -> bool:
    return frame[12:14] == _TYPE


def port_mac(dpid: int, port: int) -> str:
    """A switch port's MAC, for the frames the switch itself sends (PFC): locally
    administered, from the switch's dpid and the port number."""
    return "02:fc:" + ":".join(f"{b:02x}" for b in (dpid & 0xFFFF).to_bytes(2, "big")
                               + port.to_bytes(2, "big"))


def quantum_s(rate_bps: float) -> float:
    """How long one pause quantum lasts on a link of this rate."""
    return PAUSE_QUANTUM_BIT_TIMES / rate_bps


def parse(frame: bytes) -> dict[int, int] | None:
    """priority -> pause quanta (0 = resume) of a PFC or PAUSE frame; None if malformed."""
    if len(frame) < 14 + _PFC.size:
        return None
    opcode, enable, *times = _PFC.unpack_from(frame, 14)
    if opcode == MAC_CONTROL_OPCODE_PAUSE:   # one pause time, for every priority
        return dict.fromkeys(range(PFC_PRIORITY_COUNT), enable)
    if opcode != MAC_CONTROL_OPCODE_PFC:
        return None
    return {prio: times[prio] for prio in range(PFC_PRIORITY_COUNT) if enable >> prio & 1}


def pfc_frame(src_mac: str, quanta: dict[int, int]) -> bytes:
    """A PFC frame pausing each priority in `quanta` for its quanta (0 resumes it)."""
    times = [0] * PFC_PRIORITY_COUNT
    enable = 0
    for prio, q in quanta.items():
        if not 0 <= q <= PAUSE_QUANTA_MAX:
            raise ValueError(f"pause quanta must be 0..{PAUSE_QUANTA_MAX}, got {q}")
        times[prio] = q
        enable |= 1 << prio
    frame = (_DST + bytes.fromhex(src_mac.replace(":", "")) + _TYPE
             + _PFC.pack(MAC_CONTROL_OPCODE_PFC, enable, *times))
    return frame + b"\0" * (MIN_FRAME_BYTES - len(frame))
