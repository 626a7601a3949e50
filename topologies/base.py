"""Common ground of the fabric topologies: parameters, addressing, naming.

A topology is a Mininet `Topo` subclass whose `build()` says what the fabric is,
in the vocabulary of this module (`add_switch`, `add_gpu`, `add_fabric_link`,
...). While it builds the Mininet graph it also records the plain `Fabric`
description (fabric.py) that the controller and the lab read.

Addressing (IPv4):
  scale-out   10.1.S.H/24, one /24 per leaf (or edge) switch S, gateway 10.1.S.254
  scale-up    10.2.R.H/24, one flat L2 domain per rack R (no gateway)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mininet.topo import Topo

from topologies.fabric import (NAME_PREFIX, Fabric, Host, HostInterface, Link, Subnet, Switch,
                               interface_name)
from topologies.params import ParamError

# Emulated links run at Mb/s; real ones at Gb/s. One emulated Mb/s stands for
# RATE_SCALE real Mb/s: with the default 1000, a 100 Mb/s host link is a
# 100 Gb/s NIC. Every run records the scale it used (see `real_rate_gbps`).
DEFAULT_RATE_SCALE = 1000

ROLE_CODES = {"spine": "sp", "leaf": "lf", "core": "co", "agg": "ag", "edge": "ed",
              "nvswitch": "nv"}
MAX_SUBNETS = 254          # third octet of 10.1.S.0/24
MAX_HOSTS_PER_SUBNET = 253  # .1 .. .253; .254 is the gateway
# The longest names must fit Linux's 15-character interface names ("fl-lf253-eth300").
MAX_SWITCH_PORTS = 999



@dataclass
class FabricParams:
    """Parameters every topology has."""
    rate_scale: int = DEFAULT_RATE_SCALE

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ParamError(f"{f.name} must be positive, got {value}")

    def real_rate_gbps(self, emulated_mbps: float) -> float:
        return emulated_mbps * self.rate_scale / 1000.0


def switch_name(role: str, index: int) -> str:
    return f"{NAME_PREFIX}{ROLE_CODES[role]}{index}"


PLANE_OCTET_BASE = 10        # plane p's addresses: 10.(10+p).S.H (scale-out 10.1, scale-up 10.2)


def plane_network(plane: int) -> str:
    """The network name of a multi-plane fabric's plane (plane 0 is "scale-out")."""
    return "scale-out" if plane == 0 else f"plane{plane}"


def plane_of(network: str) -> int | None:
    """The plane a network is (0: scale-out), None for scale-up."""
    if network == "scale-out":
        return 0
    return int(network.removeprefix("plane")) if network.startswith("plane") else None


def host_mac(index: int, network: str) -> str:
    plane = plane_of(network)
    kind = 0xfb if plane is None else 0xfa if plane == 0 else 0xf0 + plane
    return f"02:{kind:02x}:00:{(index >> 16) & 0xff:02x}:{(index >> 8) & 0xff:02x}:{index & 0xff:02x}"


def router_mac(dpid: int) -> str:
    return f"02:fe:00:{(dpid >> 16) & 0xff:02x}:{(dpid >> 8) & 0xff:02x}:{dpid & 0xff:02x}"


class FabricTopo(Topo):
    """A Mininet Topo that also records the plain Fabric description."""

    kind = "fabric"
    Params = FabricParams

    def __init__(self, params: FabricParams):
        params.validate()
        self.params = params
        self.fabric = Fabric(kind=self.kind, params=dataclasses.asdict(params))
        self._next_port: dict[str, int] = {}
        self._subnet_hosts: dict[str, int] = {}
        super().__init__(params)

    # --- vocabulary for build() -----------------------------------------------
    def add_switch(self, role: str, index: int) -> str:
        name = switch_name(role, index)
        dpid = len(self.fabric.switches) + 1
        self.addSwitch(name, dpid=f"{dpid:016x}")
        self.fabric.switches.append(Switch(name=name, dpid=dpid, role=role))
        self._next_port[name] = 1
        return name

    def add_leaf(self, index: int, spines: list[str], rate_mbps: float) -> str:
        """A leaf switch with one uplink to every spine."""
        leaf = self.add_switch("leaf", index)
        for spine in spines:
            self.add_fabric_link(leaf, spine, rate_mbps)
        return leaf

    def add_subnet(self, switch: str, network: str, octet3: int) -> Subnet:
        if octet3 >= MAX_SUBNETS:
            raise ParamError(f"too many subnets for 10.x.S.0/24 addressing (max {MAX_SUBNETS})")
        plane = plane_of(network)
        second = 2 if plane is None else 1 if plane == 0 else PLANE_OCTET_BASE + plane
        routed = plane is not None
        sw = self.fabric.switch(switch)
        subnet = Subnet(cidr=f"10.{second}.{octet3}.0/24", switch=switch,
                        gateway_ip=f"10.{second}.{octet3}.254" if routed else None,
                        gateway_mac=router_mac(sw.dpid) if routed else None)
        self.fabric.subnets.append(subnet)
        self._subnet_hosts[subnet.cidr] = 0
        return subnet

    def add_gpu(self, subnet: Subnet, switch: str, rate_mbps: float,
                rack: int | None = None) -> str:
        """A GPU host with its scale-out NIC on `switch` in `subnet`."""
        index = len(self.fabric.hosts)
        name = f"g{index}"
        intf = self._host_interface(name, 0, index, "scale-out", subnet, switch, rate_mbps)
        self.addHost(name, ip=f"{intf.ip}/{intf.prefix_len}", mac=intf.mac,
                     defaultRoute=f"via {subnet.gateway_ip}")
        self.fabric.hosts.append(Host(name=name, interfaces=[intf],
                                      gateway=subnet.gateway_ip, rack=rack))
        self._next_port[name] = 0
        # the port gets its MAC as it is made and its address as it is configured, like
        # every other NIC's (the host's own mac/ip above are what Mininet reports)
        self._link(name, switch, rate_mbps, "host",
                   addr1=intf.mac, params1={"ip": f"{intf.ip}/{intf.prefix_len}"})
        return name

    def add_scaleup_nic(self, host: str, subnet: Subnet, switch: str, rate_mbps: float) -> None:
        """A second NIC on `host`, into a rack's scale-up switch."""
        self._add_nic(host, "scale-up", subnet, switch, rate_mbps, "scale-up")

    def add_plane_nic(self, host: str, plane: int, subnet: Subnet, switch: str,
                      rate_mbps: float) -> None:
        """One more scale-out NIC on `host`, into a leaf of plane `plane` (a multi-plane
        fabric: one NIC port per plane)."""
        self._add_nic(host, plane_network(plane), subnet, switch, rate_mbps, "host")

    def _add_nic(self, host: str, network: str, subnet: Subnet, switch: str,
                 rate_mbps: float, kind: str) -> None:
        h = self.fabric.host(host)
        intf = self._host_interface(host, len(h.interfaces), int(host[1:]), network, subnet,
                                    switch, rate_mbps)
        h.interfaces.append(intf)
        self._link(host, switch, rate_mbps, kind,
                   addr1=intf.mac, params1={"ip": f"{intf.ip}/{intf.prefix_len}"})

    def add_fabric_link(self, a: str, b: str, rate_mbps: float) -> None:
        self._link(a, b, rate_mbps, "fabric")

    # --- internals --------------------------------------------------------------
    def _host_interface(self, host, ifindex, index, network, subnet, switch, rate_mbps):
        n = self._subnet_hosts[subnet.cidr] + 1
        if n > MAX_HOSTS_PER_SUBNET:
            raise ParamError(f"at most {MAX_HOSTS_PER_SUBNET} hosts per switch")
        self._subnet_hosts[subnet.cidr] = n
        base = subnet.cidr.rsplit(".", 1)[0]
        return HostInterface(name=interface_name(host, ifindex), network=network, ip=f"{base}.{n}",
                             prefix_len=24, mac=host_mac(index, network), switch=switch,
                             port=self._next_port[switch], rate_mbps=rate_mbps)

    def _link(self, a: str, b: str, rate_mbps: float, kind: str, **opts) -> None:
        pa, pb = self._next_port[a], self._next_port[b]
        if max(pa, pb) > MAX_SWITCH_PORTS:
            raise ParamError(f"more than {MAX_SWITCH_PORTS} ports on one switch")
        self._next_port[a], self._next_port[b] = pa + 1, pb + 1
        self.addLink(a, b, port1=pa, port2=pb, **opts)
        self.fabric.links.append(Link(a=a, a_port=pa, b=b, b_port=pb,
                                      rate_mbps=rate_mbps, kind=kind))
