"""Proactive L3 routes of a fabric, computed from its plain description.

Pure functions (no OpenFlow): the controller app turns them into flows and
groups, and tests check them without a network.

Every switch delivers the hosts of the subnets it owns by /32 (rewriting the
MACs as a router does) and forwards every other reachable subnet towards the
switch that owns it, over all the ports that lie on a shortest path: when
there are several, they form one ECMP set. When links fail or come back, a
switch's routes change where they must and nowhere else (route_update).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from topologies.fabric import Fabric
from traffic.constants import EXPLICIT_EV_MAX_PATHS


@dataclass(frozen=True)
class Deliver:
    """Send a packet for `ip` out of `port` to the host itself."""
    ip: str
    host_mac: str
    router_mac: str | None   # source MAC of routed packets; None in an L2 domain
    port: int


@dataclass(frozen=True)
class Forward:
    """Send packets for `cidr` towards its owner over `ports` (ECMP if > 1)."""
    cidr: str
    ports: tuple[int, ...]


def switch_graph(fabric: Fabric) -> dict[str, dict[str, list[int]]]:
    """switch -> neighbour switch -> the local ports of the links between them."""
    names = {sw.name for sw in fabric.switches}
    graph: dict[str, dict[str, list[int]]] = {n: {} for n in names}
    for ln in fabric.links:
        if ln.a in names and ln.b in names:
            graph[ln.a].setdefault(ln.b, []).append(ln.a_port)
            graph[ln.b].setdefault(ln.a, []).append(ln.b_port)
    return graph


def hop_distances(graph: dict[str, dict[str, list[int]]], target: str) -> dict[str, int]:
    dist = {target: 0}
    queue = deque([target])
    while queue:
        node = queue.popleft()
        for peer in graph[node]:
            if peer not in dist:
                dist[peer] = dist[node] + 1
                queue.append(peer)
    return dist


def routes_for(fabric: Fabric) -> dict[str, list[Deliver | Forward]]:
    """switch name -> its routes."""
    graph = switch_graph(fabric)
    routes: dict[str, list[Deliver | Forward]] = {sw.name: [] for sw in fabric.switches}
    for subnet in fabric.subnets:
        for host in fabric.hosts:
            for intf in host.interfaces:
                if intf.switch == subnet.switch and fabric.subnet_of(intf.ip) is subnet:
                    routes[subnet.switch].append(
                        Deliver(intf.ip, intf.mac, subnet.gateway_mac, intf.port))
        if subnet.gateway_ip is None:
            continue   # an L2 domain (scale-up): reachable only on its own switch
        dist = hop_distances(graph, subnet.switch)
        for sw, d in dist.items():
            if d == 0:
                continue
            ports = sorted(p for peer, plist in graph[sw].items()
                           if dist.get(peer) == d - 1 for p in plist)
            routes[sw].append(Forward(subnet.cidr, tuple(ports)))
    return routes


def without_links(fabric: Fabric, down: set[tuple[str, int]]) -> Fabric:
    """The fabric minus every link with an end (node, port) in `down`."""
    return replace(fabric, links=[ln for ln in fabric.links
                                  if (ln.a, ln.a_port) not in down
                                  and (ln.b, ln.b_port) not in down])


@dataclass(frozen=True)
class RouteUpdate:
    """How a switch goes from its old routes to its new ones, make before break: the
    routes to install (new, or their ports changed: a flow installed with the match
    and priority of an old one replaces it in place, as OpenFlow's add does), then
    the routes withdrawn (no longer reachable) and the explicit paths no longer
    installed, (cidr, index) as forward_paths numbers them, to delete. Rerouting
    once deleted every flow of every switch and installed them all again: under the
    lab VM's software CPU each switch then dropped what it carried for ~1 s, the
    failed plane's surviving twin as well (plane-failure: MRC's resends on plane 1
    went unanswered and timed out). Host routes stay: they hang on host links, which
    a reroute does not count."""
    install: tuple[Forward, ...]
    withdraw: tuple[Forward, ...]
    stale_paths: tuple[tuple[str, int], ...]

    def __bool__(self) -> bool:
        return bool(self.install or self.withdraw or self.stale_paths)


def forward_paths(route: Forward) -> range:
    """The explicit paths a route installs, by index into its ports: one per equal-cost
    port (up to EXPLICIT_EV_MAX_PATHS), none for a single port."""
    return range(min(len(route.ports), EXPLICIT_EV_MAX_PATHS) if len(route.ports) > 1 else 0)


def route_update(old: list[Deliver | Forward], new: list[Deliver | Forward]) -> RouteUpdate:
    """What changes between a switch's `old` and `new` routes (RouteUpdate)."""
    before = {r.cidr: r for r in old if isinstance(r, Forward)}
    after = {r.cidr: r for r in new if isinstance(r, Forward)}
    return RouteUpdate(
        install=tuple(r for cidr, r in after.items() if before.get(cidr) != r),
        withdraw=tuple(r for cidr, r in before.items() if cidr not in after),
        stale_paths=tuple((cidr, i) for cidr, r in before.items()
                          for i in forward_paths(r)
                          if cidr not in after or i not in forward_paths(after[cidr])))


def arp_table(fabric: Fabric) -> dict[str, dict[str, str]]:
    """subnet cidr -> {ip: mac} of what a host in that subnet may ARP for:
    its gateway and its subnet's other hosts."""
    table: dict[str, dict[str, str]] = {sn.cidr: {} for sn in fabric.subnets}
    for sn in fabric.subnets:
        if sn.gateway_ip:
            table[sn.cidr][sn.gateway_ip] = sn.gateway_mac
    for host in fabric.hosts:
        for intf in host.interfaces:
            table[fabric.subnet_of(intf.ip).cidr][intf.ip] = intf.mac
    return table


def arp_answers(fabric: Fabric) -> dict[str, list[tuple[str, str, str]]]:
    """switch -> the ARP requests it answers itself: (subnet cidr of the asker, ip asked
    for, its mac), for every subnet with a host port on the switch."""
    table = arp_table(fabric)
    cidrs: dict[str, set[str]] = {}
    for host in fabric.hosts:
        for intf in host.interfaces:
            cidrs.setdefault(intf.switch, set()).add(fabric.subnet_of(intf.ip).cidr)
    return {sw: [(cidr, ip, mac) for cidr in sorted(cs) for ip, mac in table[cidr].items()]
            for sw, cs in cidrs.items()}


class RerouteSchedule:
    """When the routes are computed again after links change: a reroute is due each
    change's delay after it (the convergence time it stands for) and is computed from
    the links as they are then; one reroute covers every one due by its start or within
    merge_s after (both ends of a link report its change, a few ms apart). Times are the
    caller's clock; the controller runs one reroute at a time over this."""

    def __init__(self, merge_s: float = 0.02):
        self.merge_s = merge_s
        self.due: list[float] = []

    def changed(self, now: float, delay_s: float) -> None:
        self.due.append(now + delay_s)

    def wait_s(self, now: float) -> float | None:
        """How long until a reroute is due (0: now); None when none is."""
        return max(0.0, min(self.due) - now) if self.due else None

    def start(self, now: float) -> None:
        """A reroute starts at `now`: it covers what is due by now + merge_s."""
        self.due = [t for t in self.due if t > now + self.merge_s]
