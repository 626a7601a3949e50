"""The links of a fabric that cross machines, carried by OVS's VXLAN tunnels.

A crossing link keeps its switch port as every other link has it: a veth whose
switch end (`fl-lf0-eth3`) is the port, with its queues, BPF data path and PFC.
Its other end (the stub, `fl-x<key>`) goes into this machine's tunnel bridge
`fl-tun`, which has one VXLAN port per other machine. Two explicit flows per link
move its frames between the stub and the tunnel, with the link's key as VXLAN's
network identifier; nothing is learned (OVS's NORMAL action would drop PFC's
pause frames, sent to a reserved multicast address) and no controller is asked.

Only the kernel datapath carries the tunnels: OVS's userspace datapath needs the
machine's own NIC moved onto an OVS bridge for its tunnels, which the lab does not
do to a user's machine.
"""
from __future__ import annotations

import ipaddress
import logging
import subprocess

from lab.core.errors import LabError
from topologies.fabric import NAME_PREFIX, interface_name
from topologies.partition import Crossing

log = logging.getLogger(__name__)

BRIDGE = f"{NAME_PREFIX}tun"
STUB_PREFIX = f"{NAME_PREFIX}x"
VXLAN_PORT = 4789                  # IANA's VXLAN port
VXLAN_ENCAP_BYTES = 36             # outer IPv4 20 + UDP 8 + VXLAN 8 around the inner frame
FIRST_TUNNEL_OFPORT = 60000        # the bridge's VXLAN ports; stubs count up from 1


def stub_name(key: int) -> str:
    """The tunnel bridge's end of crossing link `key` (at most 15 characters)."""
    return f"{STUB_PREFIX}{key}"


def vxlan_name(machine: int) -> str:
    return f"{NAME_PREFIX}vx{machine}"


def flows(crossings: list[Crossing], machine: int) -> list[str]:
    """The tunnel bridge's flows on `machine` (ovs-ofctl syntax): each stub to its peer's
    VXLAN port with its key, and back."""
    out = []
    for i, c in enumerate(crossings, start=1):
        tunnel = FIRST_TUNNEL_OFPORT + c.peer(machine)
        out.append(f"priority=100,in_port={i},actions=set_field:{c.key}->tun_id,"
                   f"output:{tunnel}")
        out.append(f"priority=100,in_port={tunnel},tun_id={c.key},actions=output:{i}")
    return out


def underlay_mtu(remote_ip: str) -> int:
    """The MTU of this machine's route to `remote_ip`."""
    r = subprocess.run(["ip", "-o", "route", "get", remote_ip], capture_output=True, text=True)
    words = r.stdout.split()
    if r.returncode or "dev" not in words:
        raise LabError(f"this machine has no route to {remote_ip}, the cluster's machine "
                       f"there ({r.stderr.strip() or 'ip route get found none'})")
    dev = words[words.index("dev") + 1]
    return int(open(f"/sys/class/net/{dev}/mtu").read())


def check(datapath: str, peers: dict[int, str], frame_bytes: int) -> None:
    """Before anything is built: OVS's kernel datapath, and every other machine reachable
    with room for a full fabric frame (Ethernet header included) in VXLAN."""
    if datapath != "kernel":
        raise LabError("a fabric across machines needs OVS's kernel datapath (this machine "
                       "runs the userspace one: its tunnels would need the machine's NIC "
                       "on an OVS bridge). Use a kernel with the openvswitch module, e.g. "
                       "the lab VM or the Vagrant VM")
    need = frame_bytes + VXLAN_ENCAP_BYTES
    for m, ip in peers.items():
        ipaddress.ip_address(ip)
        mtu = underlay_mtu(ip)
        if mtu < need:
            raise LabError(f"the route to machine {m} ({ip}) has MTU {mtu}: a fabric frame "
                           f"of {frame_bytes} bytes needs {need} in VXLAN. Raise the MTU of "
                           f"the network between the machines (e.g. `ip link set dev "
                           f"eth0 mtu 9000` on both)")


def make_stubs(crossings: list[Crossing], machine: int, link_group: int) -> None:
    """The veth of each crossing link: its switch port (named as any port is) and its
    stub; both in the lab's device group, so teardown deletes them with the rest."""
    ops = []
    for c in crossings:
        switch, port = c.local_end(machine)
        port_name, stub = interface_name(switch, port), stub_name(c.key)
        ops += [f"link add {port_name} type veth peer name {stub}",
                f"link set dev {stub} group {link_group}",
                f"link set dev {stub} up"]
    _ip_batch(ops)


def _ip_batch(ops: list[str]) -> None:
    if not ops:
        return
    r = subprocess.run(["ip", "-b", "-"], input="\n".join(ops) + "\n",
                       capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"making the crossing links' veths failed: {r.stderr.strip()}")


def build_bridge(crossings: list[Crossing], machine: int, addresses: dict[int, str]) -> None:
    """fl-tun with its stubs, one VXLAN port per other machine, and the flows (check()
    first)."""
    cmd = ["ovs-vsctl", "--timeout=30", "add-br", BRIDGE, "--", "set", "bridge", BRIDGE,
           "fail_mode=secure", "protocols=OpenFlow15"]
    for i, c in enumerate(crossings, start=1):
        cmd += ["--", "add-port", BRIDGE, stub_name(c.key), "--", "set", "interface",
                stub_name(c.key), f"ofport_request={i}"]
    for m in sorted({c.peer(machine) for c in crossings}):
        cmd += ["--", "add-port", BRIDGE, vxlan_name(m), "--", "set", "interface",
                vxlan_name(m), "type=vxlan", f"ofport_request={FIRST_TUNNEL_OFPORT + m}",
                f"options:remote_ip={addresses[m]}", f"options:local_ip={addresses[machine]}",
                "options:key=flow", f"options:dst_port={VXLAN_PORT}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"making the tunnel bridge {BRIDGE} failed: {r.stderr.strip()}")
    r = subprocess.run(["ovs-ofctl", "-O", "OpenFlow15", "add-flows", BRIDGE, "-"],
                       input="\n".join(flows(crossings, machine)) + "\n",
                       capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"the tunnel bridge's flows were refused: {r.stderr.strip()}")
    log.info(f"{len(crossings)} links cross to other machines through {BRIDGE} (VXLAN)")
