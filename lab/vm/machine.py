"""Booting the lab VM under qemu: run one command in it, or open a shell.

The working tree is shared into the VM at /fabriclab over 9p, writable, so what a
command writes there (results, pcaps) is on the host when it returns. A second,
private share carries the command in and its exit code out. The disk is a
snapshot: every boot starts from the image as built, and nothing persists but
what is written to the shared tree.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from lab.core import paths
from lab.core.errors import LabError
from lab.vm import image
from lab.vm.image import Image

log = logging.getLogger(__name__)

KERNEL_ARGS = ("console=ttyS0 root=/dev/vda rw panic=-1 quiet loglevel=3 "
               "mitigations=off")   # mitigations=off: faster under a software CPU
KVM_PROBE_TIMEOUT_S = 15   # a working KVM reaches the panic in 1-2 s


@dataclass
class VMOptions:
    memory_mb: int = 3072
    cpus: int = 2
    timeout_s: float = 30 * 60
    accel: str = "auto"        # "kvm", "tcg", or "auto": KVM when it really works
    nice: int = 10             # the host keeps some CPU for its own work
    nic: str | None = None     # a qemu -netdev spec: one virtio NIC on it, the guest's eth0
                               # (a network between lab VMs: a cluster)


# --- accelerator ------------------------------------------------------------------------
def _qemu_base(img: Image, accel: str, opts: VMOptions) -> list[str]:
    cpu = ["-accel", "kvm", "-cpu", "host"] if accel == "kvm" else \
        ["-accel", "tcg,thread=multi", "-cpu", "max"]
    return ["nice", "-n", str(opts.nice), "qemu-system-x86_64", "-name", "fabriclab-vm",
            "-machine", "pc", *cpu, "-smp", str(opts.cpus), "-m", str(opts.memory_mb),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(img.vmlinux)]


def _kvm_boots(img: Image) -> tuple[bool, str]:
    """Boot the image's kernel with KVM to its first panic (no root: it panics and,
    with -no-reboot, qemu exits). /dev/kvm can open and still fail on the first
    64-bit instruction a kernel runs (seen here: 'KVM internal error'), so only a
    real boot tells."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "no usable /dev/kvm"
    args = _qemu_base(img, "kvm", VMOptions(memory_mb=512, cpus=1)) + \
        ["-serial", "stdio", "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    seen = b""
    deadline = time.monotonic() + KVM_PROBE_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            chunk = os.read(proc.stdout.fileno(), 65536) if ready else b""
            seen = (seen + chunk)[-4096:]
            if b"Kernel panic" in seen:
                return True, "KVM boots the kernel"
            if b"KVM internal error" in seen or (ready and not chunk):
                line = next((ln for ln in seen.decode(errors="replace").splitlines()
                             if "KVM" in ln), "qemu exited")
                return False, f"KVM cannot boot the kernel ({line.strip()})"
        return False, f"a KVM boot did not finish in {KVM_PROBE_TIMEOUT_S} s"
    finally:
        _stop(proc)


def accelerator(img: Image, requested: str = "auto") -> tuple[str, str]:
    """('kvm' or 'tcg', why). The KVM probe's answer is cached per host kernel, qemu
    and image kernel, since it costs up to 15 s when KVM hangs."""
    requested = paths.env(paths.VM_ACCEL_ENV) or requested
    if requested in ("kvm", "tcg"):
        return requested, "requested"
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True,
                          text=True).stdout.split("\n")[0]
    key = f"{os.uname().release}|{qemu}|{img.describe()['kernel_package']}"
    cache = image.CACHE / "accel.json"
    known = json.loads(cache.read_text()) if cache.exists() else {}
    if key not in known:
        ok, why = _kvm_boots(img)
        known[key] = {"kvm": ok, "why": why}
        cache.write_text(json.dumps(known, indent=1))
    found = known[key]
    return ("kvm", found["why"]) if found["kvm"] else \
        ("tcg", f"software CPU (TCG): {found['why']}")


# --- one boot ---------------------------------------------------------------------------
@dataclass
class RunResult:
    exit_code: int
    boot_s: float | None      # guest uptime when its init started
    total_s: float            # host wall time, qemu start to exit
    accel: str


def _qemu(img: Image, accel: str, ctl: Path, opts: VMOptions, serial: str) -> list[str]:
    return _qemu_base(img, accel, opts) + [
        "-serial", serial,
        "-initrd", str(img.initrd),
        "-append", f"{KERNEL_ARGS} fabriclab.tree={image.TREE_IN_VM} "
                   f"fabriclab.init={image.TREE_IN_VM}/lab/vm/guest/guest-init",
        "-drive", f"file={img.rootfs},format=raw,if=virtio,snapshot=on",
        "-device", "virtio-rng-pci",
        "-virtfs", f"local,path={image.REPO},mount_tag=fabriclab,security_model=none,id=tree",
        "-virtfs", f"local,path={ctl},mount_tag=fabriclab-ctl,security_model=none,id=ctl",
        *(_nic(opts.nic) if opts.nic else []),
    ]


def _nic(netdev: str) -> list[str]:
    """A virtio NIC on `netdev`, with a MAC of its own (two VMs on one network differ
    in their netdev specs: one listens, the other connects)."""
    digest = hashlib.sha256(netdev.encode()).digest()
    mac = "52:54:00:" + ":".join(f"{b:02x}" for b in digest[:3])
    return ["-netdev", f"{netdev},id=n0", "-device", f"virtio-net-pci,netdev=n0,mac={mac}"]


def check_memory(need_mb: int, what: str, meminfo: Path = Path("/proc/meminfo")) -> None:
    """Refuse to boot `what` when the host has less than `need_mb` available: qemu takes
    a guest's memory as the guest touches it, so an overcommitted host would not fail
    at boot but kill a VM (or the lab's processes) midway through a run."""
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    available_mb = int(fields["MemAvailable"].split()[0]) // 1024
    if available_mb < need_mb:
        raise LabError(f"{what} needs {need_mb} MB of memory and this machine has "
                       f"{available_mb} MB available: stop what holds it (`free -m`, "
                       f"`ps -eo rss,cmd --sort=-rss`) or run on a machine with more")


def run(img: Image, command: str, opts: VMOptions, out=None) -> RunResult:
    """Boot, run COMMAND as root in the shared tree, stream its output; its exit code."""
    out = out or sys.stdout.buffer
    check_memory(opts.memory_mb, f"a lab VM of {opts.memory_mb} MB")
    accel, why = accelerator(img, opts.accel)
    with tempfile.TemporaryDirectory(prefix="fabriclab-vm-") as tmp:
        ctl = Path(tmp)
        (ctl / "mode").write_text("run\n")
        (ctl / "command").write_text(command + "\n")
        if not sys.stdout.isatty():
            # the guest's console is a tty; the host's output is not (CI logs): no colours
            (ctl / "env").write_text("PY_COLORS=0\nNO_COLOR=1\nTERM=dumb\n")
        log.info(f"[vm] booting ({accel}: {why}; {opts.cpus} CPUs, {opts.memory_mb} MB; "
                 f"timeout {opts.timeout_s / 60:g} min): {command}")
        t0 = time.monotonic()
        proc = subprocess.Popen(_qemu(img, accel, ctl, opts, "stdio"), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            _stream(proc, out, deadline=t0 + opts.timeout_s)
        except BaseException:
            _stop(proc)
            raise
        total = time.monotonic() - t0
        if proc.returncode is None:   # the deadline passed
            _stop(proc)
            raise LabError(f"the VM command did not finish within {opts.timeout_s / 60:g} min;"
                           f" the VM was stopped (give more time with --timeout MINUTES)")
        return RunResult(_exit_code(ctl), _boot_s(ctl), total, accel)


def _stream(proc: subprocess.Popen, out, deadline: float) -> None:
    """Copy qemu's output (the serial console) to `out` until qemu exits or the deadline."""
    fd = proc.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                proc.wait()
                return
            out.write(chunk.replace(b"\r\n", b"\n"))
            out.flush()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()   # qemu, started by us: nothing in it needs a clean shutdown
        proc.wait()


def _exit_code(ctl: Path) -> int:
    try:
        return int((ctl / "rc").read_text().strip())
    except (OSError, ValueError):
        raise LabError("the VM stopped without reporting an exit code (its console output "
                       "above shows why: a kernel panic or a failed setup step)") from None


def _boot_s(ctl: Path) -> float | None:
    try:
        return float((ctl / "booted").read_text())
    except (OSError, ValueError):
        return None


def shell(img: Image, opts: VMOptions) -> int:
    """An interactive root shell on the VM's serial console, in the shared tree."""
    accel, why = accelerator(img, opts.accel)
    with tempfile.TemporaryDirectory(prefix="fabriclab-vm-") as tmp:
        ctl = Path(tmp)
        (ctl / "mode").write_text("shell\n")
        size = shutil.get_terminal_size()
        (ctl / "tty-size").write_text(f"{size.lines} {size.columns}\n")
        (ctl / "term").write_text(os.environ.get("TERM", "vt220") + "\n")
        print(f"[vm] booting ({accel}: {why}); 'exit' powers the VM off, "
              f"Ctrl-A X kills it", file=sys.stderr, flush=True)
        # mon:stdio: Ctrl-C goes to the guest; Ctrl-A X quits qemu
        proc = subprocess.Popen(_qemu(img, accel, ctl, opts, "mon:stdio"))
        try:
            proc.wait()
        except BaseException:
            _stop(proc)
            raise
        return _exit_code(ctl) if (ctl / "rc").exists() else 1
