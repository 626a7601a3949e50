"""What this machine can do, measured, and what each missing piece disables.

Kernel features are probed for real (a qdisc is added to a veth in a scratch
namespace, fl-doctor), not read from a config file that may not match.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from shutil import which

from lab.fabric import calibrate
from lab.kernel import dataplane, ovs, queues

SCRATCH_NS = "fl-doctor"


@dataclass
class Capability:
    name: str
    available: bool
    detail: str
    disables: str            # what the lab cannot do without it (and any fallback)
    required: bool = False   # the lab cannot run at all without it


def _run(args: list[str], ns: str | None = None) -> subprocess.CompletedProcess:
    if ns:
        args = ["ip", "netns", "exec", ns] + args
    return subprocess.run(args, capture_output=True, text=True)


QDISC_PROBES = {
    "htb": "htb default 1",
    "tbf": "tbf rate 10mbit burst 10kb latency 50ms",
    # (nodrop, as the lab's RED queues use it: Linux 5.9 and later)
    "red": "red limit 400000 min 30000 max 90000 avpkt 1000 burst 55 ecn nodrop "
           "probability 0.02 bandwidth 100mbit",
    "netem": "netem delay 1ms",
    "fq_codel": "fq_codel",
}


@functools.cache
def qdisc_available(name: str) -> bool:
    """One live probe (e.g. "red"): what ECN mode 'auto' asks. Once per process: the
    kernel's qdiscs do not change under a run, and each probe builds a namespace (every
    variant's set_congestion asked again)."""
    return _qdisc_probes({name: QDISC_PROBES[name]}).get(name, False)


def _qdisc_probes(tests: dict[str, str] = QDISC_PROBES) -> dict[str, bool]:
    """Try each qdisc / nftables feature on a veth inside a scratch namespace."""
    _run(["ip", "netns", "del", SCRATCH_NS])
    if _run(["ip", "netns", "add", SCRATCH_NS]).returncode:
        return {k: False for k in (*tests, "nftables")}
    try:
        _run(["ip", "link", "add", "fl-doc0", "type", "veth", "peer", "name", "fl-doc1"],
             SCRATCH_NS)
        out = {}
        for name, spec in tests.items():
            r = _run(["tc", "qdisc", "replace", "dev", "fl-doc0", "root"] + spec.split(),
                     SCRATCH_NS)
            out[name] = r.returncode == 0
        out["nftables"] = bool(which("nft")) and _run(
            ["nft", "add table netdev fl_doctor; add chain netdev fl_doctor c "
             "{ type filter hook ingress device fl-doc0 priority 0; }"], SCRATCH_NS
        ).returncode == 0
        return out
    finally:
        _run(["ip", "netns", "del", SCRATCH_NS])


def _module_loadable(name: str) -> bool:
    if Path(f"/sys/module/{name}").exists():
        return True
    return bool(which("modprobe")) and Path("/proc/modules").exists() and \
        _run(["modprobe", "-n", "-q", name]).returncode == 0


def capabilities() -> list[Capability]:
    caps = []
    root = os.geteuid() == 0
    caps.append(Capability("root", root, "running as root" if root else "not root",
                           "everything: namespaces, OVS and tc need root (a root shell, or sudo)", True))
    mn = importlib.util.find_spec("mininet") is not None and which("mnexec") is not None
    caps.append(Capability("mininet", mn, "python module and mnexec" if mn else "missing",
                           "building fabrics ('make demo' as root installs it)", True))
    ovs_ok = ovs.installed()
    caps.append(Capability("openvswitch", ovs_ok,
                           ("running" if ovs.running() else "installed, not running (the lab "
                            "starts it)") if ovs_ok else "missing",
                           "switches ('make demo' as root installs it)", True))
    kdp = root and ovs.kernel_datapath_available()
    caps.append(Capability("ovs-kernel-datapath", kdp,
                           "openvswitch module loaded" if kdp else
                           "no openvswitch module: the userspace datapath is used",
                           "nothing essential: the userspace datapath forwards more slowly "
                           "(~6 Gbit/s TCP over 3 switches) and its queues sit behind AF_PACKET"))
    osken = importlib.util.find_spec("os_ken") is not None
    caps.append(Capability("controller-os-ken", osken, "importable" if osken else "missing",
                           "routing the fabric ('make demo' as root installs it)", True))
    probes = _qdisc_probes() if root else {}
    notes = {
        "htb": ("per-port rate limits and queues", True),
        "tbf": ("the PFC pause gate of every switch queue", True),
        "red": ("ECN mode 'red' (kernel RED marking); the lab marks with its BPF data "
                "path instead ('bpf')", False),
        "netem": ("link delay; random loss falls back to nftables", False),
        "fq_codel": ("nothing the lab needs; listed for users' experiments", False),
        "nftables": ("loss injection on kernels without netem", False),
    }
    for name, (disables, required) in notes.items():
        ok = probes.get(name, False)
        caps.append(Capability(f"qdisc-{name}" if name != "nftables" else "nftables-netdev", ok,
                               "works (probed)" if ok else "not available in this kernel",
                               disables, required))
    why = dataplane.probe() if root else "needs root"
    caps.append(Capability("bpf-dataplane", why is None,
                           "tc BPF programs load (probed): ECN marks and the PFC trigger "
                           "act per packet" if why is None else why,
                           "per-packet ECN marking and PFC in the kernel's data path; the "
                           "lab falls back to the controller sampling the queues every "
                           "millisecond (PFC can lose frames under load, ECN marks in bursts)"))
    rps = queues.receive_steering()
    caps.append(Capability("receive-steering", rps, "RPS: a flow's frames taken in by one "
                           "CPU" if rps else "no CONFIG_RPS in this kernel",
                           "in-order delivery through veths: two frames of a flow may now "
                           "and then arrive swapped (RC receivers NAK them)"))
    rxe = _module_loadable("rdma_rxe")
    caps.append(Capability("soft-roce", rxe, "rdma_rxe available" if rxe else "no rdma_rxe",
                           "real RoCE peers (Soft-RoCE); use the lab VM or Vagrant"))
    for tool, disables in (("tshark", "decoding captures in tests and reports"),
                           ("tcpdump", "packet captures"),
                           ("iperf3", "TCP baselines and background traffic")):
        ok = which(tool) is not None
        caps.append(Capability(tool, ok, "present" if ok else "missing", disables))
    qemu = which("qemu-system-x86_64") is not None
    kvm = os.access("/dev/kvm", os.R_OK | os.W_OK)
    caps.append(Capability("qemu", qemu, ("present, " + ("KVM usable" if kvm else
                                                         "no KVM: software CPU (slow)"))
                           if qemu else "missing",
                           "the full-kernel lab VM (fabriclab vm)"))
    return caps


def can_run(caps: list[Capability]) -> bool:
    return all(c.available for c in caps if c.required)


def as_dict(caps: list[Capability]) -> dict:
    cal = calibrate.load()
    return {"can_run": can_run(caps),
            "ecn_mode_default": "red" if _get(caps, "qdisc-red") else
            "bpf" if _get(caps, "bpf-dataplane") else "controller",
            "ovs_datapath": "kernel" if _get(caps, "ovs-kernel-datapath") else "user",
            "calibration": {"keep_up_mbps": cal.keep_up_mbps, "machine_factor": cal.factor,
                            "busy_keep_up_mbps": cal.busy_keep_up_mbps,
                            "busy_machine_factor": cal.busy_factor,
                            "measured": cal.measured} if cal else None,
            "capabilities": [asdict(c) for c in caps]}


def calibration_line(d: dict) -> str:
    c = d["calibration"]
    if c is None:
        return ("machine speed: not calibrated (`fabriclab calibrate`, or the first tour, "
                "measures it; until then the experiments run at their defaults)")
    return (f"machine speed: GPU hosts keep up with {c['keep_up_mbps']:g} Mb/s, "
            f"{c['busy_keep_up_mbps']:g} with {2 * calibrate.BUSY_PAIRS} busy at once "
            f"(calibrated {c['measured']}): experiments' default rates and sizes "
            f"x{c['machine_factor']:.2f} with 2 hosts busy, x{c['busy_machine_factor']:.2f} "
            f"with {2 * calibrate.BUSY_PAIRS}")


def _get(caps: list[Capability], name: str) -> bool:
    return next(c.available for c in caps if c.name == name)


def render(caps: list[Capability]) -> str:
    lines = []
    for c in caps:
        mark = "ok " if c.available else ("MISSING" if c.required else "no ")
        line = f"  {mark:7} {c.name:22} {c.detail}"
        if not c.available:
            line += f"\n  {'':7} {'':22} -> disables: {c.disables}"
        lines.append(line)
    d = as_dict(caps)
    lines.append(f"OVS datapath: {d['ovs_datapath']}; ECN marking default: "
                 f"{d['ecn_mode_default']}")
    lines.append(calibration_line(d))
    lines.append("the lab can run" if d["can_run"] else
                 "the lab cannot run: fix the MISSING lines ('make demo' as root installs them)")
    return "\n".join(lines)
