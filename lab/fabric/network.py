"""A fabric, up and torn down: OVS, the controller, Mininet, kernel queues.

    with FabricNetwork(topo, workdir) as net:
        net.mininet["g0"].cmd("ping -c1 10.1.1.1")

Teardown runs on success, on error, on Ctrl-C and on SIGTERM; it is itself
shielded from a second Ctrl-C, and a final sweep removes any lab object that
Mininet left behind.
"""
from __future__ import annotations

import codecs
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import mininet.node
from mininet.link import Intf, Link
from mininet.log import setLogLevel
from mininet.net import Mininet
from mininet.node import Host, OVSSwitch, RemoteController
from mininet.topo import Topo

from lab.core import state
from lab.core.errors import LabError, Terminated
from lab.fabric import cleanup, congestion, spawner
from lab.fabric.controller import CONGESTION_APP, Controller
from lab.kernel import dataplane, ovs, queues, rcu, tunnel
from topologies.base import PLANE_OCTET_BASE, FabricTopo, plane_of
from topologies.fabric import interface_name
from topologies.partition import Partition

log = logging.getLogger(__name__)

# OVS's send socket (userspace datapath) gets this many times what the switch ports'
# queues hold together: a queued frame is charged its truesize (a 1 KB frame ~2.3 KB)
OVS_SEND_BUFFER_FACTOR = 4
OVS_SEND_BUFFER_MIN_BYTES = 4 << 20
OVS_SEND_BUFFER_MAX_BYTES = 256 << 20

# Mininet decodes its host shells' terminal output as strict UTF-8; a stray
# non-UTF-8 byte there (seen intermittently in CI) raised inside Mininet and
# aborted the whole run. Replace such bytes instead.
mininet.node.getincrementaldecoder = \
    lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")


def _raise_terminated(signum, frame):
    raise Terminated()


def _ip_batch(node, ops: list[str], before: str = "") -> None:
    """`ip` commands in one process run by the node's shell: Mininet configures a link
    end with five processes (ifconfig down, hw ether, up, address, up again) and a host
    with seven more; under a software CPU a process start costs ~40 ms, which made
    Mininet's part of a fabric's build 6-13 s in the lab VM."""
    cmd = before + "printf '%s\\n' " + " ".join(f"'{op}'" for op in ops) + " | ip -b -"
    out = node.cmd(cmd).strip()
    if out:
        raise LabError(f"configuring {node.name}: `{cmd}` said: {out}")


class FabricIntf(Intf):
    """A link end without IPv6: a fabric port speaks IPv4 (RoCE v2) and PFC, and a
    kernel's IPv6 on it sends router solicitations, neighbour solicitations and MLD
    reports for seconds after the link comes up: frames no switch of the fabric sends,
    which showed in captures and in the ports' byte counters. Off before the port is
    first up, in its own namespace (the shell's /proc/sys/net is its namespace's)."""

    def config(self, mac=None, ip=None, up=True, **_params):
        ops = []
        if mac:
            self.mac = mac
            ops.append(f"link set dev {self.name} address {mac}")
        if ip:
            self.ip, self.prefixLen = ip.split("/")
            ops.append(f"addr add {ip} dev {self.name}")
        if not self.node.inNamespace:     # a switch port: teardown deletes the group
            ops.append(f"link set dev {self.name} group {cleanup.LINK_GROUP}")
        if up:
            ops.append(f"link set dev {self.name} up")
        _ip_batch(self.node, ops,
                  before=f"echo 1 > /proc/sys/net/ipv6/conf/{self.name}/disable_ipv6; ")
        return {}


class FabricHost(Host):
    """A GPU host: its ports already have their MACs and addresses (FabricIntf); what
    is left, the loopback and the default route, in one process."""

    def config(self, mac=None, ip=None, defaultRoute=None, lo="up", **_params):
        intf = self.defaultIntf()
        if (mac and mac != intf.mac) or (ip and ip.split("/")[0] != intf.ip):
            raise LabError(f"{self.name}: the host's address {ip} {mac} differs from its "
                           f"port's {intf.ip} {intf.mac} (topologies/base.py sets both)")
        ops = [f"link set dev lo {lo}"]
        if defaultRoute:
            ops.append(f"route replace default {defaultRoute}")
        _ip_batch(self, ops)
        return {}


class LabController(RemoteController):
    """The lab's controller (lab/fabric/controller.py), which the lab waits for itself
    before the switches start. Mininet's own check (a telnet to the port as the network
    is built) would warn: the controller is still loading while the network is built."""

    def checkListening(self) -> None:
        pass


@dataclass
class MachinePart:
    """This machine's share of a fabric spread over machines (lab/cluster.py): what it
    builds, where the others are, and the one controller every machine's switches use."""
    partition: Partition
    machine: int
    addresses: dict[int, str]     # machine -> its address on the network between them
    controller: tuple[str, int] | None    # (address, port) of the controller; None: it
                                          # runs here, on loopback, on controller_port
    controller_port: int | None = None    # (the other machines reach it through ssh)

    @property
    def crossings(self):
        return [c for c in self.partition.crossings if self.machine in c.machines]

    def topo(self, topo: FabricTopo) -> Topo:
        """`topo`'s nodes and links on this machine. A crossing link's switch port is
        made apart (tunnel.make_stubs), since its far end is not here."""
        mine = self.partition.nodes(self.machine)
        out = Topo()
        for name in topo.nodes(sort=False):
            if name in mine:
                out.addNode(name, **topo.nodeInfo(name))
        for a, b, info in topo.links(withInfo=True):
            if a in mine and b in mine:
                out.addLink(**info)
        return out


class FabricNetwork:
    def __init__(self, topo: FabricTopo, workdir: Path, queue_params=None,
                 verbose: bool = False, controller_runtime: str = "os-ken",
                 machine_factor: float = 1.0, use_dataplane: bool = True,
                 part: MachinePart | None = None):
        """part: this machine's share of a fabric over several machines; its switches
        use the controller that part names, or the one this network runs for the whole
        fabric on its cluster address (the head's: part.controller None). Either way
        this machine's own congestion app handles ECN and PFC on its switches."""
        self.topo = topo
        self.part = part
        self.machine_factor = machine_factor   # lab/fabric/calibrate.py: < 1 on a slower machine
        self.fabric = topo.fabric if part is None else part.partition.local(part.machine)
        self.workdir = Path(workdir)
        self.queue_params = queue_params or queues.QueueParams()
        self.verbose = verbose
        self.controller_runtime = controller_runtime
        self.mininet: Mininet | None = None
        self.controller: Controller | None = None
        self.use_dataplane = use_dataplane
        self.dataplane: dataplane.Dataplane | None = None   # ECN and PFC per packet (BPF)
        self.dataplane_missing: str | None = None           # or why it cannot run here
        self.ovs_send_buffer_bytes: int | None = None       # userspace datapath: lifted to
        self.datapath: str | None = None
        self.timings: dict[str, float] = {}
        self.spawner: spawner.Spawner | None = None       # the GPU agents' (start_agent)
        self._old_sigterm = None

    # --- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> "FabricNetwork":
        self._old_sigterm = signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        t0 = time.monotonic()
        stale = cleanup.leftovers()
        if any(stale.values()):
            found = cleanup.clean()
            log.info(f"removed leftovers of an earlier run: {_count(found)}")
        self.datapath = ovs.ensure_running()
        setLogLevel("info" if self.verbose else "warning")
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.part is not None:
            tunnel.check(self.datapath, {m: ip for m, ip in self.part.addresses.items()
                                         if m != self.part.machine}, queues.MAX_FRAME_BYTES)
        if self.part is None or self.part.controller is None:
            # the controller programs the whole fabric, every machine's switches; its
            # congestion app handles this machine's
            full, port = (self.fabric, None) if self.part is None else \
                (self.part.partition.fabric, self.part.controller_port)
            self.controller = Controller(full, self.workdir, self.controller_runtime,
                                         local_fabric=None if self.part is None else
                                         self.fabric, port=port)
            self.controller.launch()
            controller_ip, controller_port = "127.0.0.1", self.controller.port
        else:
            # the head's controller programs these switches; ECN and PFC are this
            # machine's own: its congestion app, on its queues and data path
            controller_ip, controller_port = self.part.controller
            self.controller = Controller(self.fabric, self.workdir, self.controller_runtime,
                                         apps=[CONGESTION_APP])
            self.controller.launch()
        log.info(f"building {self.fabric.summary()} (OVS {self.datapath} datapath, "
                 f"{self.controller_runtime} controller)")
        # the GPU agents' spawner imports them while the fabric is built (2.4 s of a
        # software CPU, when the first agent would otherwise wait for it)
        self.spawner = spawner.Spawner(self.workdir / "agent-spawner.log")
        self.spawner.start()
        # batch: Mininet creates the bridges in a few ovs-vsctl runs of its own (its
        # batchStartup). Unbatched (which is what it does for a partial(), not knowing
        # the class), each bridge is one ovs-vsctl typed into a shell's terminal, whose
        # line holds 4095 characters: a switch of 48 ports (~4.2k) lost its last ports,
        # or the whole bridge when the cut fell mid-option (the 1024-host leaf-spine)
        switch = partial(OVSSwitch, datapath="user" if self.datapath == "user" else "kernel",
                         protocols="OpenFlow15", failMode="secure", batch=True)
        controller = partial(LabController, ip=controller_ip, port=controller_port)
        self.mininet = Mininet(topo=self.topo if self.part is None else self.part.topo(self.topo),
                               host=FabricHost, switch=switch,
                               controller=controller, link=Link, intf=FabricIntf, autoSetMacs=False,
                               autoStaticArp=False, build=False, waitConnected=False)
        self.mininet.build()
        if self.part is not None:
            self.add_crossing_ports()
        self.timings["namespaces_links_s"] = time.monotonic() - t0    # Mininet: hosts, veths, bridges
        for host in self.mininet.hosts:
            state.record_process(host.pid, f"mininet:{host.name}", "host")
        # the switches connect as they start: the controller listens by then, or they
        # back off (OVS waits up to 8 s between attempts)
        if self.controller is not None:
            self.controller.wait_listening()
        t1 = time.monotonic()
        self.mininet.start()
        self.check_switch_ports()
        self.timings["switches_s"] = time.monotonic() - t1    # OVS: bridges and their ports
        for host, routes in plane_routes(self.fabric).items():
            for route in routes:
                self.mininet[host].cmd(f"ip route replace {route}")
        self.timings["build_s"] = time.monotonic() - t0
        pids = {h.name: h.pid for h in self.mininet.hosts}
        t1 = time.monotonic()
        if not queues.receive_steering():
            log.warning("this kernel has no receive packet steering (CONFIG_RPS): two "
                        "frames of a flow may now and then arrive out of order where a "
                        "veth delivers them (README: A fabric across machines)")
        queues.apply(self.fabric, pids, self.queue_params)
        self.timings["queues_s"] = time.monotonic() - t1
        t1 = time.monotonic()
        self.dataplane_missing = dataplane.unavailable() if self.use_dataplane else "turned off"
        if self.dataplane_missing is None:
            # a queue's departures are counted at its link's far end: for a link to
            # another machine, its stub here (what the port sends into the tunnel)
            stubs = None if self.part is None else {
                c.far_end(self.part.machine): tunnel.stub_name(c.key)
                for c in self.part.crossings}
            self.dataplane = dataplane.Dataplane.attach(self.fabric, pids, self.queue_params,
                                                        stubs=stubs)
        elif self.use_dataplane:
            log.warning(f"no per-packet BPF data path here ({self.dataplane_missing}): "
                        f"ECN and PFC fall back to the controller's queue sampling")
        self.timings["dataplane_s"] = time.monotonic() - t1
        if self.programmed_elsewhere:
            self.timings["ready_s"] = time.monotonic() - t0
            return
        t1 = time.monotonic()
        # generous: under a software CPU (the lab VM) a switch may take half a minute
        self.controller.wait_programmed(timeout_s=90 + 0.2 * len(self.fabric.switches),
                                        switches=self.fabric.switches)
        self.timings["programming_s"] = time.monotonic() - t1
        if self.part is None:          # a cluster's head turns it on once all are up
            self.controller.enable_rerouting()
        if self.datapath == "user":
            self.lift_ovs_send_buffer()
        self.timings["ready_s"] = time.monotonic() - t0

    @property
    def programmed_elsewhere(self) -> bool:
        """Another machine's controller (the cluster head's) programs these switches."""
        return self.part is not None and self.part.controller is not None

    def add_crossing_ports(self) -> None:
        """The switch ports of the links to other machines: veths whose far ends go into
        the tunnel bridge (lab/kernel/tunnel.py), given to their Mininet switches before
        these start, so OVS adds them with the rest, at their port numbers."""
        crossings = self.part.crossings
        tunnel.make_stubs(crossings, self.part.machine, cleanup.LINK_GROUP)
        queues.steer([tunnel.stub_name(c.key) for c in crossings])
        tunnel.build_bridge(crossings, self.part.machine, self.part.addresses)
        for c in crossings:
            switch, port = c.local_end(self.part.machine)
            FabricIntf(interface_name(switch, port), node=self.mininet[switch], port=port)

    def check_switch_ports(self) -> None:
        """Every switch port is in OVS: Mininet does not check what ovs-vsctl did."""
        missing = sorted({intf for _, _, intf, _ in queues.switch_ports(self.fabric)}
                         - ovs.interfaces())
        if missing:
            raise LabError(f"OVS lacks {len(missing)} of the fabric's switch ports after "
                           f"Mininet started the switches ({', '.join(missing[:8])}"
                           f"{', ...' if len(missing) > 8 else ''}): see the controller log "
                           f"and 'ovs-vsctl show'")

    def lift_ovs_send_buffer(self) -> None:
        """OVS's userspace datapath sends every port's frames through one packet socket
        whose send buffer (the kernel's default: ~93 full frames) would bound what all
        the switch ports hold together, dropping the excess unseen (lab/kernel/ovs.py). It gets
        room for every port's buffers. The socket appears with OVS's first send: a
        host's ping of its gateway (answered by the router app through OVS) makes one."""
        ports = queues.switch_ports(self.fabric)
        q = self.queue_params
        need = OVS_SEND_BUFFER_FACTOR * len(ports) * sum(q.buffer_bytes(p) for p in q.priorities)
        need = min(max(need, OVS_SEND_BUFFER_MIN_BYTES), OVS_SEND_BUFFER_MAX_BYTES)
        # the switch answers the ping's ARP at once; nothing answers the echo itself, so
        # a long wait for it would be a second of every build
        for _ in range(10):
            if ovs.send_socket() is not None:
                break
            self.mininet.hosts[0].cmd("ping -c 1 -W 0.1 \"$(ip route | awk '/^default/ "
                                      "{print $3; exit}')\" > /dev/null 2>&1")
        got = ovs.lift_send_buffer(need)
        self.ovs_send_buffer_bytes = got
        if got is None or got < need:
            log.warning(f"OVS's send buffer could not be raised to "
                        f"{need >> 20} MB (it has {got or 0} bytes): frames queued on "
                        f"all switch ports together beyond it are dropped inside OVS")

    def stop(self) -> None:
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)   # a 2nd Ctrl-C must not cut teardown short
        t0 = time.monotonic()
        try:
            with rcu.expedited():       # the kernel's waits, one per port (lab/kernel/rcu.py)
                if self.spawner is not None:
                    self.spawner.close()
                    self.spawner = None
                if self.controller is not None:   # first: links going down would reroute
                    self.controller.stop()
                    self.controller = None
                self.timings["teardown_controller_s"] = time.monotonic() - t0
                if self.mininet is not None:
                    try:
                        self._stop_mininet()
                    except Exception as e:   # the sweep below still removes what it left
                        log.warning(f"stopping Mininet's nodes failed ({e}); sweeping")
                    self.mininet = None
                t1 = time.monotonic()
                if self.dataplane is not None:
                    self.dataplane.close()
                    self.dataplane = None
            cleanup.clean()
            self.timings["teardown_sweep_s"] = time.monotonic() - t1
        finally:
            self.timings["teardown_s"] = time.monotonic() - t0
            signal.signal(signal.SIGINT, old_int)
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
                self._old_sigterm = None

    def _stop_mininet(self) -> None:
        """Mininet's own stop deletes each link with an `ip link del` typed into a
        node's shell while OVS still holds the ports, and OVS reconfigures for every
        one: a 1024-host fabric took 100 s. Here the bridges go in one ovs-vsctl
        transaction, then every link in one call (cleanup.delete_links: the kernel
        deletes the lab's device group, the hosts' ends with their peers, in a batch),
        then the nodes' shells end."""
        net = self.mininet
        t0 = time.monotonic()
        ovs.delete_bridges([sw.name for sw in net.switches]
                           + ([tunnel.BRIDGE] if self.part is not None else []))
        t1 = time.monotonic()
        cleanup.delete_links()
        t2 = time.monotonic()
        for node in (*net.hosts, *net.switches):
            node.terminate()
        self.timings.update(teardown_bridges_s=t1 - t0, teardown_links_s=t2 - t1,
                            teardown_nodes_s=time.monotonic() - t2)

    # --- access -------------------------------------------------------------------------
    def popen(self, host: str, args: list[str], marker: str, kind: str,
              **kw) -> subprocess.Popen:
        """A process in `host`'s namespace, recorded by PID for cleanup (`marker`: a part
        of its command line that tells it is still the lab's)."""
        proc = self.mininet[host].popen(args, **kw)
        state.record_process(proc.pid, marker, kind)
        return proc

    def start_agent(self, host: str, args: list[str], profile: str | None = None):
        """A GPU agent (traffic/agent.py with `args`) in `host`, forked by this fabric's
        spawner, recorded by PID for cleanup; `profile`: a path for its cProfile output."""
        if self.spawner is None:
            raise LabError("the fabric is not up")
        return self.spawner.spawn(self.host_pid(host), args, profile)

    def host_pid(self, name: str) -> int:
        if self.mininet is None:
            raise LabError("the fabric is not up")
        return self.mininet[name].pid

    # --- ECN and PFC, as a fabric over several machines offers them too (lab/cluster.py) --
    def set_congestion(self, params: congestion.CongestionParams) -> str:
        """ECN and PFC on this fabric's switches; returns the ECN mode in use."""
        return congestion.set_congestion(self, params)

    def congestion_state(self) -> dict:
        """The congestion app's state: counters per port and priority, reaction, headroom."""
        return congestion.read_state(self)

    def congestion_events(self, since: float = 0.0) -> list[dict]:
        """The congestion app's events (xoff, xon, gates, marking) since `since` (unix s)."""
        return congestion.events(self, since)


def plane_routes(fabric) -> dict[str, list[str]]:
    """A multi-plane fabric's hosts reach the other leaves of plane p through their
    plane-p NIC's gateway (the default route is plane 0's): host -> `ip route` specs."""
    out: dict[str, list[str]] = {}
    for h in fabric.hosts:
        for intf in h.interfaces:
            plane = plane_of(intf.network)
            if plane:
                gateway = fabric.subnet_of(intf.ip).gateway_ip
                out.setdefault(h.name, []).append(
                    f"10.{PLANE_OCTET_BASE + plane}.0.0/16 via {gateway} dev {intf.name}")
    return out


def _count(found: dict[str, list]) -> str:
    return ", ".join(f"{len(v)} {k}" for k, v in found.items() if v)
