"""The plain description of a fabric: what the controller and the lab read.

A topology class (see base.py) builds a Mininet Topo; `describe()` turns it into
this description, which has no Mininet in it, travels as JSON to the controller
and is written into every run's results.
"""
from __future__ import annotations

import ipaddress
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Everything the lab creates in the root namespace carries this prefix
# (OVS bridges, their ports): `fabriclab clean` removes only names of this form.
NAME_PREFIX = "fl-"


def interface_name(node: str, port: int) -> str:
    """A node's port's interface name: Mininet's (its intfName), used by every layer
    that finds a port's device (queues, the data path, captures, the controllers)."""
    return f"{node}-eth{port}"


def interface_port(name: str) -> tuple[str, int] | None:
    """interface_name's inverse: (node, port), or None for a name it does not make."""
    node, _, port = name.rpartition("-eth")
    return (node, int(port)) if node and port.isdigit() else None


@dataclass
class Switch:
    name: str
    dpid: int
    role: str                     # spine, leaf, core, agg, edge, nvswitch


@dataclass
class HostInterface:
    name: str                     # e.g. g0-eth0 (lives inside the host's namespace)
    network: str                  # "scale-out", "scale-up", or "plane<p>" (multi-plane)
    ip: str
    prefix_len: int
    mac: str
    switch: str
    port: int
    rate_mbps: float


@dataclass
class Host:
    name: str
    interfaces: list[HostInterface]
    gateway: str | None = None    # default route (scale-out network), if routed
    rack: int | None = None

    def interface(self, network: str = "scale-out") -> HostInterface:
        for intf in self.interfaces:
            if intf.network == network:
                return intf
        raise KeyError(f"host {self.name} has no {network} interface")

    @property
    def ip(self) -> str:
        return self.interfaces[0].ip


@dataclass
class Link:
    a: str
    a_port: int
    b: str
    b_port: int
    rate_mbps: float
    kind: str                     # host, fabric, scale-up


@dataclass
class Subnet:
    cidr: str
    switch: str                   # the switch that owns (routes for) it
    gateway_ip: str | None        # None: an unrouted L2 domain (scale-up)
    gateway_mac: str | None


@dataclass
class Fabric:
    kind: str
    params: dict
    switches: list[Switch] = field(default_factory=list)
    hosts: list[Host] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    subnets: list[Subnet] = field(default_factory=list)

    # --- lookups -----------------------------------------------------------
    def switch(self, name: str) -> Switch:
        for sw in self.switches:
            if sw.name == name:
                return sw
        raise KeyError(name)

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def subnet_of(self, ip: str) -> Subnet:
        addr = ipaddress.ip_address(ip)
        for sn in self.subnets:
            if addr in ipaddress.ip_network(sn.cidr):
                return sn
        raise KeyError(f"no subnet holds {ip}")

    def switch_ports(self, name: str) -> dict[int, tuple[str, int]]:
        """port number -> (peer node, peer port) for one switch."""
        ports = {}
        for ln in self.links:
            if ln.a == name:
                ports[ln.a_port] = (ln.b, ln.b_port)
            if ln.b == name:
                ports[ln.b_port] = (ln.a, ln.a_port)
        return ports

    def host_pairs(self, network: str = "scale-out") -> list[tuple[Host, Host]]:
        """Ordered pairs of distinct hosts that both have `network`."""
        hs = [h for h in self.hosts if any(i.network == network for i in h.interfaces)]
        return [(a, b) for a in hs for b in hs if a is not b]

    def summary(self) -> str:
        counts = {}
        for sw in self.switches:
            counts[sw.role] = counts.get(sw.role, 0) + 1
        roles = ", ".join(f"{n} {r}" for r, n in counts.items())
        return (f"{self.kind}: {len(self.hosts)} GPU hosts, {roles}, "
                f"{len(self.links)} links")

    # --- serialisation ----------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Fabric":
        return cls(
            kind=d["kind"], params=d["params"],
            switches=[Switch(**s) for s in d["switches"]],
            hosts=[Host(name=h["name"], gateway=h["gateway"], rack=h["rack"],
                        interfaces=[HostInterface(**i) for i in h["interfaces"]])
                   for h in d["hosts"]],
            links=[Link(**ln) for ln in d["links"]],
            subnets=[Subnet(**s) for s in d["subnets"]],
        )

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: Path) -> "Fabric":
        return cls.from_dict(json.loads(Path(path).read_text()))
