"""The lab's side of the GPU agents: start one per host, drive collectives.

Each agent (traffic/agent.py) runs inside its host's namespace, forked there by the
fabric's spawner (lab/fabric/spawner.py), recorded by PID for cleanup, and spoken to
over JSON lines.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from controllers.routes import Forward, routes_for
from lab.core import paths
from lab.core.errors import LabError
from lab.fabric.network import FabricNetwork
from topologies.base import plane_of
from topologies.fabric import Fabric, Host, HostInterface
from traffic.agent import qpn_for
from traffic.constants import EV_TIER_OF_ROLE, EXPLICIT_EV_BASE, EXPLICIT_EV_MAX_PATHS
from traffic.mrc import generated_evs

log = logging.getLogger(__name__)


CPU_BOUND_FRACTION = 0.9
# set to a directory: every agent runs under cProfile, its profile there as HOST.prof
MIN_JUDGED_S = 0.05          # collectives shorter than this say nothing about CPU


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = fields[3] + fields[4]          # idle + iowait
    return sum(fields) - idle, sum(fields)


def scaleup(host: Host) -> HostInterface | None:
    return next((i for i in host.interfaces if i.network == "scale-up"), None)


def planes(host: Host) -> list[HostInterface]:
    """A multi-plane fabric's host: its NIC ports on planes 1, 2, ... (plane 0's is its
    scale-out interface); none on other fabrics."""
    return sorted((i for i in host.interfaces if plane_of(i.network)),
                  key=lambda i: plane_of(i.network))


def innermost(hosts: list[Host]) -> str:
    """The network a group of GPUs talks over: the scale-up domain when they all sit in
    one rack's (the chattiest traffic kept on the innermost tier), else scale-out."""
    if len({h.rack for h in hosts}) == 1 and all(scaleup(h) for h in hosts):
        return "scale-up"
    return "scale-out"


def next_hop_mac(fabric: Fabric, src: Host, dst: Host, network: str) -> str:
    """The MAC a frame from src to dst is addressed to: the peer in the same subnet,
    else the gateway (the leaf routes it, rewriting MACs hop by hop)."""
    s, d = src.interface(network), dst.interface(network)
    subnet = fabric.subnet_of(s.ip)
    if fabric.subnet_of(d.ip) is subnet or subnet.gateway_mac is None:
        return d.mac
    return subnet.gateway_mac


def explicit_evs(fabric: Fabric, host: Host) -> list[int]:
    """One EV per path up the fabric from `host`, as MRC's generated EV profile: a field
    per tier (the leaf's or edge's uplinks, then an aggregation switch's), every
    combination (traffic/mrc.generated_evs; the controller maps field k at the k-th
    switch up). A leaf-spine: EXPLICIT_EV_BASE + i for its leaf's i-th uplink."""
    routes, counts = routes_for(fabric), []
    switch = host.interface().switch
    while EV_TIER_OF_ROLE.get(fabric.switch(switch).role) == len(counts):
        up = [r for r in routes[switch] if isinstance(r, Forward)]
        if not up:
            break
        widest = max(up, key=lambda r: len(r.ports))
        counts.append(min(len(widest.ports), EXPLICIT_EV_MAX_PATHS))
        switch = fabric.switch_ports(switch)[widest.ports[0]][0]    # on up, the first way
    return list(generated_evs(tuple((0, n - 1) for n in counts))) if counts \
        else [EXPLICIT_EV_BASE]


@dataclass
class CollectiveResult:
    results: list[np.ndarray]
    elapsed_s: list[float]
    counters: list[dict]
    nic: list[dict]
    phase_s: list[dict]          # per host: its algorithm's phases, if it has any
    rate_samples: list[dict]     # per host: {"t", "sent": {qpn: [...]}, "delivered": {...}}
    evs: list[dict]              # per host: MRC QP -> its entropy values' health

    @property
    def time_s(self) -> float:
        return max(self.elapsed_s)


class GpuAgents:
    def __init__(self, net: FabricNetwork, hosts: list[str] | None = None,
                 network: str = "scale-out", first_collective_id: int = 1):
        """net: a FabricNetwork, or anything with its `fabric`, `dataplane` and `popen`
        (a fabric across machines: lab/cluster.py, whose agents on other machines are
        spoken to through their workers).
        first_collective_id: a second set of agents on the same hosts (background
        traffic) starts far from the first, so their QP numbers never meet (agent.qpn_for)."""
        self.net, self.fabric, self.network = net, net.fabric, network
        self.hosts = [net.fabric.host(h) for h in (hosts or [h.name for h in net.fabric.hosts])]
        self.procs: dict = {}      # host -> its agent (spawner.Agent; on a cluster, a Popen-like)
        self.sending = threading.Lock()
        self.next_id = first_collective_id
        self.cpu: list[tuple[str, float, float]] = []      # (host, cpu s, elapsed s)
        self.machine_busy: list[float] = []    # per collective: the machine's CPU busy share
        self.honouring: list[str] = []     # hosts whose pauses this set's transports honour
        self.inbox = {h.name: b"" for h in self.hosts}   # what each agent wrote, not yet read
        self.ev_events: list[dict] = []    # every MRC EV change the agents reported
        self.ev_controller = None          # an EvController (lab/fabric/evs.py), or None
        for h in self.hosts:
            intf = h.interface(network)
            profile = paths.env(paths.PROFILE_ENV)   # a developer's view of the agents' CPU
            args = ["--intf", intf.name, "--mac", intf.mac, "--ip", intf.ip,
                    "--rate-mbps", str(intf.rate_mbps), "--rack", str(h.rack or 0)]
            up = scaleup(h)
            if up is not None:
                args += ["--up", up.name, up.mac, up.ip, str(up.rate_mbps)]
            if network == "scale-out":
                for port in planes(h):
                    args += ["--plane", port.name, port.mac, port.ip, str(port.rate_mbps)]
            self.procs[h.name] = net.start_agent(
                h.name, args, f"{profile}/{h.name}.prof" if profile else None)
        for h in self.hosts:   # generous: many Python starts on a slow (emulated) CPU
            self._expect(h.name, "hello", timeout_s=120)
            if net.dataplane is not None:
                net.dataplane.transport_honours_pauses(h.name, True)
                self.honouring.append(h.name)

    def _send(self, host: str, **cmd) -> None:
        with self.sending:       # stop() may come from another thread than a collective's
            self.procs[host].stdin.write(json.dumps(cmd) + "\n")
            self.procs[host].stdin.flush()

    def stop(self) -> None:
        """End the collective these agents run now, as if out of time (a call made with
        allow_timeout returns what its flows did so far). An agent between collectives
        ignores it: a caller racing a collective's start sends it again."""
        for h in self.hosts:
            try:
                self._send(h.name, cmd="stop")
            except (BrokenPipeError, OSError):
                pass

    def _expect(self, host: str, event: str | tuple[str, ...], timeout_s: float) -> dict:
        """The next message from `host`'s agent, which must be `event` (one of them);
        what it reports on the way (EV changes, warnings) is handled first."""
        return self._collect([host], event, timeout_s)[host]

    def _collect(self, hosts: list[str], event: str | tuple[str, ...],
                 timeout_s: float) -> dict[str, dict]:
        """Each host's next `event`, read as the agents write them (a collective's EV
        events must reach the EV controller while it runs, from whichever host). The
        agents' stdout is read raw, a line at a time, here only."""
        ends = (event,) if isinstance(event, str) else event
        out: dict[str, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(out) < len(hosts):
            waiting = [h for h in hosts if h not in out]
            for h in waiting:
                while b"\n" in self.inbox[h] and h not in out:
                    line, self.inbox[h] = self.inbox[h].split(b"\n", 1)
                    msg = json.loads(line)
                    if msg.get("event") == "ev":
                        self._on_ev(h, msg)
                    elif msg.get("event") == "warning":
                        log.warning(f"GPU agent on {h}: {msg['warning']}")
                    elif msg.get("event") == "error":
                        raise LabError(f"GPU agent on {h}: {msg['error']}")
                    elif msg.get("event") not in ends:
                        raise LabError(f"GPU agent on {h}: expected {event}, got "
                                       f"{msg.get('event')}")
                    else:
                        out[h] = msg
            waiting = [h for h in hosts if h not in out and b"\n" not in self.inbox[h]]
            if not waiting:
                continue
            fds = {self.procs[h].stdout.fileno(): h for h in waiting}
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self._gone(waiting[0], event)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._gone(fds[fd], event)
                self.inbox[fds[fd]] += chunk
        return {h: out[h] for h in hosts}         # in host order, as they were asked for

    def _gone(self, host: str, event) -> None:
        proc = self.procs[host]
        try:
            proc.wait(timeout=2)
            err = proc.stderr.read()
        except subprocess.TimeoutExpired:
            err = ""
        raise LabError(f"GPU agent on {host} did not answer ({event}): "
                       f"{err.strip().splitlines()[-1] if err.strip() else 'no output'}")

    def _on_ev(self, host: str, msg: dict) -> None:
        """An MRC QP's EV changed state: recorded; the EV controller may deny the EV."""
        self.ev_events.append({"host": host, **{k: v for k, v in msg.items() if k != "event"}})
        log.debug(f"{host}: QP {msg['qp']} EV {msg['ev']:#x} {msg['state']} ({msg['why']})")
        if self.ev_controller is not None:
            for h, ev, why in self.ev_controller.on_event(host, msg):
                self._send(h, cmd="deny_ev", ev=ev, why=why)

    def _peers(self, h: Host, members: list[Host]) -> list[dict]:
        peers = []
        for r, p in enumerate(members):
            if p is h:
                continue
            peer = {"rank": r, "ip": p.interface(self.network).ip, "rack": p.rack or 0,
                    "next_hop_mac": next_hop_mac(self.fabric, h, p, self.network)}
            if scaleup(p) and scaleup(h) and p.rack == h.rack:
                peer.update(up_ip=scaleup(p).ip, up_mac=scaleup(p).mac)
            if self.network == "scale-out" and planes(h):
                peer["planes"] = [{"ip": p.interface(port.network).ip,
                                   "next_hop_mac": next_hop_mac(self.fabric, h, p, port.network)}
                                  for port in planes(h)]
            peers.append(peer)
        return peers

    def _run(self, commands: dict[str, dict], timeout_s: float,
             allow_timeout: bool = False, groups: list[list[str]] | None = None
             ) -> dict[str, dict]:
        """prepare on every host, wait until all are ready, start, collect (a host that
        ran out of time reports what it did when allow_timeout is set). groups: disjoint
        sets of hosts, each running its own collective at once (ranks and peers count
        within the group); None: one, every host. They share one collective id: no frame
        crosses groups, so their QP numbers never meet."""
        cid = self.next_id
        self.next_id += 1
        groups = groups or [[h.name for h in self.hosts]]
        names = [n for g in groups for n in g]
        for g in groups:
            members = [self.fabric.host(n) for n in g]
            for rank, h in enumerate(members):
                self._send(h.name, cmd="prepare", id=cid, rank=rank,
                           peers=self._peers(h, members), timeout_s=timeout_s,
                           **commands[h.name])
        self._collect(names, "ready", timeout_s=60)
        busy0, total0 = cpu_times()
        for n in names:
            self._send(n, cmd="start", id=cid)
        ends = ("done", "timeout", "stopped") if allow_timeout else "done"
        done = self._collect(names, ends, timeout_s + 10)
        busy1, total1 = cpu_times()
        if max(d["elapsed_s"] for d in done.values()) > MIN_JUDGED_S:
            self.machine_busy.append((busy1 - busy0) / max(1, total1 - total0))
        for name, d in done.items():
            self.cpu.append((name, d["cpu_s"], d["elapsed_s"]))
        return done

    def cpu_bound(self, threshold: float = CPU_BOUND_FRACTION) -> list[str]:
        """Hosts whose agent was busy more than `threshold` of some collective's time
        (their NIC could not keep up), or every host when the whole machine was (more
        agents than cores each get a share below the threshold, yet all starve): the
        emulation was not faithful there."""
        if any(b > threshold for b in self.machine_busy):
            return sorted(h.name for h in self.hosts)
        return sorted({name for name, cpu, elapsed in self.cpu
                       if elapsed > MIN_JUDGED_S and cpu / elapsed > threshold})

    def allreduce(self, data: list[np.ndarray], transport: str = "rc", op: str = "sum",
                  algorithm: str = "ring", params: dict | None = None,
                  timeout_s: float = 120.0, groups: list[list[str]] | None = None,
                  networks: list[str] | None = None) -> CollectiveResult:
        """groups: several all-reduces at once, one per group of hosts (data in the
        groups' order), each over its network (scale-out unless `networks` says)."""
        return self._tensors("allreduce", data, transport, params, timeout_s, groups,
                             networks, op=op, algorithm=algorithm)

    def reduce_scatter(self, data: list[np.ndarray], transport: str = "rc",
                       params: dict | None = None, timeout_s: float = 120.0) -> CollectiveResult:
        """Host r ends with chunk r of the sum (traffic/collectives.chunk_bounds)."""
        return self._tensors("reduce_scatter", data, transport, params, timeout_s)

    def all_gather(self, data: list[np.ndarray], transport: str = "rc",
                   params: dict | None = None, timeout_s: float = 120.0) -> CollectiveResult:
        """Host r gives chunk r of its buffer; every host ends with every host's."""
        return self._tensors("all_gather", data, transport, params, timeout_s)

    def broadcast(self, data: list[np.ndarray], root: int = 0, transport: str = "rc",
                  params: dict | None = None, timeout_s: float = 120.0) -> CollectiveResult:
        """Every host ends with host `root`'s buffer (the others' are overwritten)."""
        return self._tensors("broadcast", data, transport, params, timeout_s, root=root)

    def _tensors(self, collective: str, data: list[np.ndarray], transport: str,
                 params: dict | None, timeout_s: float, groups: list[list[str]] | None = None,
                 networks: list[str] | None = None, **more) -> CollectiveResult:
        """A collective over one float32 tensor per host, in host order, or one per group
        at once (`groups`; `data` then in the groups' order), each over its network
        (`networks`, one per group; default scale-out)."""
        names = [n for g in groups for n in g] if groups else [h.name for h in self.hosts]
        if len(data) != len(names):
            raise LabError(f"{len(data)} tensors for {len(names)} GPU hosts")
        network = self._networks(groups, networks)
        done = self._run({n: dict(collective=collective, transport=transport,
                                  params=params or {}, network=network[n], **more,
                                  data=base64.b64encode(d.astype(np.float32).tobytes())
                                  .decode())
                          for n, d in zip(names, data)}, timeout_s, groups=groups).values()
        return CollectiveResult(
            results=[np.frombuffer(base64.b64decode(d["result"]), np.float32) for d in done],
            elapsed_s=[d["elapsed_s"] for d in done],
            counters=[d["counters"] for d in done], nic=[d["nic"] for d in done],
            phase_s=[d.get("phase_s", {}) for d in done],
            rate_samples=[d["rate_samples"] for d in done],
            evs=[d.get("evs", {}) for d in done])

    def _networks(self, groups: list[list[str]] | None,
                  networks: list[str] | None) -> dict[str, str]:
        """Each host's network for a (grouped) collective; a scale-up group must be one
        rack's GPUs (only they share its scale-up switch)."""
        groups = groups or [[h.name for h in self.hosts]]
        networks = networks or [self.network] * len(groups)
        if len(networks) != len(groups):
            raise LabError(f"{len(networks)} networks for {len(groups)} groups")
        for g, net in zip(groups, networks):
            if net == "scale-up" and innermost([self.fabric.host(n) for n in g]) != net:
                raise LabError(f"group {', '.join(g)}: scale-up needs GPUs of one rack")
        return {n: net for g, net in zip(groups, networks) for n in g}

    def transfers(self, flows: list[tuple[str, str, int]], transport: str = "rc",
                  params: dict | None = None, timeout_s: float = 120.0,
                  allow_timeout: bool = False, groups: list[list[str]] | None = None,
                  networks: list[str] | None = None) -> list[dict]:
        """Send one message per (src, dst, nbytes) flow, all at once; return per flow:
        completion time, and whether the receiver's CRC-32 matches the sender's.
        allow_timeout: flows unfinished after timeout_s are reported (completion_s
        None) instead of failing the call. groups, networks: as for _tensors; a flow
        stays within its group."""
        groups = groups or [[h.name for h in self.hosts]]
        rank = {n: r for g in groups for r, n in enumerate(g)}
        group_of = {n: i for i, g in enumerate(groups) for n in g}
        network = self._networks(groups, networks)
        cmds = {n: dict(collective="transfers", transport=transport, params=params or {},
                        network=network[n], send=[], recv=[]) for n in rank}
        for src, dst, nbytes in flows:
            if group_of[src] != group_of[dst]:
                raise LabError(f"flow {src} -> {dst} leaves its group")
            offset = sum(r["bytes"] for r in cmds[dst]["recv"])
            cmds[dst]["recv"].append({"rank": rank[src], "bytes": nbytes, "offset": offset})
            cmds[src]["send"].append({"rank": rank[dst], "bytes": nbytes, "offset": offset})
        cid = self.next_id
        done = self._run(cmds, timeout_s, allow_timeout, groups)
        out = []
        for src, dst, nbytes in flows:
            s, d = done[src], done[dst]
            # the flow's two ends: at src the QP to dst, at dst the QP to src
            tx_qp, rx_qp = qpn_for(cid, rank[dst]), qpn_for(cid, rank[src])
            key = f"{transport}:{'up:' if network[src] == 'scale-up' else ''}"
            received = d["recv_crc"].get(str(rank[src]))
            out.append({"src": src, "dst": dst, "bytes": nbytes,
                        "completion_s": s["finished_at"].get(str(rank[dst])),
                        "intact": None if received is None else
                        s["sent_crc"][str(rank[dst])] == received,
                        "counters": s["counters"][f"{key}{tx_qp:#x}"],
                        "receiver_counters": d["counters"][f"{key}{rx_qp:#x}"],
                        "sender_nic": s["nic"], "evs": s.get("evs", {}).get(f"{tx_qp:#x}"),
                        "rate_samples": {"t": s["rate_samples"]["t"],
                                         "sent": s["rate_samples"]["sent"][f"{tx_qp:#x}"]},
                        "receiver_samples": {
                            "t": d["rate_samples"]["t"],
                            "delivered": d["rate_samples"]["delivered"][f"{rx_qp:#x}"]}})
        return out

    def incast(self, root: str, nbytes: int, transport: str = "rc",
               params: dict | None = None) -> list[dict]:
        """Every other host sends `nbytes` to `root`, all at once (N to 1)."""
        return self.transfers([(h.name, root, nbytes) for h in self.hosts if h.name != root],
                              transport, params)

    def alltoall(self, nbytes: int, transport: str = "rc",
                 params: dict | None = None) -> list[dict]:
        """Every host sends `nbytes` to every other host, all at once."""
        return self.transfers([(a.name, b.name, nbytes) for a in self.hosts for b in self.hosts
                               if a is not b], transport, params)

    def close(self) -> None:
        while self.honouring:
            self.net.dataplane.transport_honours_pauses(self.honouring.pop(), False)
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    self._send(name, cmd="exit")
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + 3
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "GpuAgents":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iperf3_tcp(net: FabricNetwork, src: str, dst: str, seconds: float = 3,
               streams: int = 1) -> dict:
    """TCP goodput from src to dst with iperf3 (its Python wrapper, in the hosts)."""
    server_ip = net.fabric.host(dst).interface().ip
    server = net.popen(dst, [sys.executable, "-m", "traffic.tcp", "server"],
                       "traffic.tcp server", "iperf3-server",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.3)
        client = net.mininet[src].popen([sys.executable, "-m", "traffic.tcp", "client",
                                         "--server", server_ip, "--seconds", str(seconds),
                                         "--streams", str(streams)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = client.communicate(timeout=seconds + 30)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if client.returncode or not lines:
            raise LabError(f"iperf3 from {src} to {dst} failed: {(lines or [err.strip()])[-1]}")
        return json.loads(lines[-1])
    finally:
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
