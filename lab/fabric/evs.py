"""The MRC controller's side of EV events: a host's controller application registers for
its NIC's EV state changes and may deny EVs (OCP MRC's mrc_ctl: EV event CQs, EV
profiles). Here the GPU agents report each change as it happens (an "ev" event, read by
lab/fabric/gpus.py), an EvController decides what to deny, and the agents deny it at
once on every QP of the running collective.

The policy is the one MRC's own examples motivate: deny an EV that maps to a failed link,
on every host whose traffic it steers there, instead of letting each QP find out by
losses and keep probing a dead path. An explicit EV (EXPLICIT_EV_BASE + i) leaves a leaf
on the i-th port of the leaf's equal-cost set (controllers/fabric_router.py maps it so),
to a spine, which has one way on to the peer's leaf. When a host reports EV i assumed bad
on a QP and the routing controller has reported a link of that path down (its
routing-events.jsonl: the leaf's port i, or the spine's port to the peer's leaf), EV i is
denied on every host of that leaf (EVs are a host's, not a QP's: MRC denies them in the
EV profile). A hashed EV maps to no link anyone knows: it is watched, never denied. The
decision is pure (link state and the event in, denials out), tested without a fabric.
"""
from __future__ import annotations

import logging
from pathlib import Path

from controllers.routes import Forward, routes_for
from lab.fabric import events
from topologies.fabric import Fabric
from traffic.constants import EV_FIELD_BITS, EV_TIERS, EXPLICIT_EV_BASE, EXPLICIT_EV_MAX_PATHS

log = logging.getLogger(__name__)
ROUTING_EVENTS = "routing-events.jsonl"


def links_down(routing_events: list[dict]) -> set[tuple[str, int]]:
    """(switch, port) the routing controller reported down and not up again since."""
    down: set[tuple[str, int]] = set()
    for e in routing_events:
        if e["event"] == "link_down":
            down.add((e["switch"], e["port"]))
        elif e["event"] == "link_up":
            down.discard((e["switch"], e["port"]))
    return down


def explicit_path(fabric: Fabric, leaf: str, ev: int, peer_leaf: str) -> list[tuple[str, int]]:
    """The (switch, port) hops an explicit EV takes from `leaf` toward `peer_leaf` on a
    leaf-spine: the port its tier-0 field names, then the spine's port to the peer's
    leaf ([]: not an explicit EV of this leaf, or no such path)."""
    i = (ev - EXPLICIT_EV_BASE) % EXPLICIT_EV_MAX_PATHS     # the leaf's field (tier 0)
    fwd = [r for r in routes_for(fabric)[leaf] if isinstance(r, Forward)]
    if not 0 <= ev - EXPLICIT_EV_BASE < 1 << EV_FIELD_BITS * EV_TIERS or not fwd \
            or leaf == peer_leaf:
        return []
    ports = max(fwd, key=lambda r: len(r.ports)).ports
    if i >= len(ports):
        return []
    spine, _ = fabric.switch_ports(leaf)[ports[i]]
    down = [p for p, (peer, _) in fabric.switch_ports(spine).items() if peer == peer_leaf]
    return [(leaf, ports[i])] + ([(spine, down[0])] if down else [])


def decide(fabric: Fabric, hosts: list[str], down: set[tuple[str, int]], host: str,
           event: dict, denied: set[tuple[str, int]]) -> list[tuple[str, int, str]]:
    """What to deny for one EV event from `host`: [(host, EV, why)] for every host of
    its leaf (among `hosts`), once per (leaf, EV) (`denied` records it)."""
    if event["state"] != "assumed_bad":
        return []
    leaf = fabric.host(host).interface().switch
    peer = next((h for h in fabric.hosts if any(i.ip == event["peer"] for i in h.interfaces)),
                None)
    if peer is None or (leaf, event["ev"]) in denied:
        return []
    dead = [hop for hop in explicit_path(fabric, leaf, event["ev"], peer.interface().switch)
            if hop in down]
    if not dead:
        return []
    denied.add((leaf, event["ev"]))
    why = "the controller: " + ", ".join(f"{sw} port {p}" for sw, p in dead) + " down"
    return [(h, event["ev"], why) for h in hosts if fabric.host(h).interface().switch == leaf]


class EvController:
    """Watches the agents' EV events of one run and denies EVs of failed links."""

    def __init__(self, fabric: Fabric, workdir: Path, hosts: list[str]):
        self.fabric, self.workdir, self.hosts = fabric, Path(workdir), hosts
        self.denied: set[tuple[str, int]] = set()
        self.decisions: list[dict] = []          # what it denied, when, why (the record)

    def on_event(self, host: str, event: dict) -> list[tuple[str, int, str]]:
        down = links_down(events.read(self.workdir / ROUTING_EVENTS))
        out = decide(self.fabric, self.hosts, down, host, event, self.denied)
        for h, ev, why in out:
            log.info(f"  EV controller: {h} denies EV {ev:#x} ({why}; {host} reported it "
                     f"{event['state']})")
            self.decisions.append({"t": event["t"], "host": h, "ev": ev, "why": why})
        return out
