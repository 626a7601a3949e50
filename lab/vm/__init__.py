"""`fabriclab vm`: the lab VM, a full Debian kernel under qemu for what this kernel lacks
(netem, RED, the OVS kernel datapath, Soft-RoCE).

    fabriclab vm build            build (or reuse) the image
    fabriclab vm run -- COMMAND   run COMMAND as root in the shared working tree
    fabriclab vm shell            an interactive shell in the VM
    fabriclab vm test             the kernel-feature tests (tests/kernel) in the VM
    fabriclab vm kernel-check     exit 0 when THIS kernel can run tests/kernel itself

Modules: image.py (the image and its cache), machine.py (qemu), cpio.py (initramfs);
the guest's scripts are lab/vm/guest/initrd-init and lab/vm/guest/guest-init.
"""
from __future__ import annotations

import argparse
import logging
import shlex
import subprocess
import time

from lab.core import console
from lab.core.errors import LabError, UsageError

log = logging.getLogger(__name__)

# What tests/kernel needs from a kernel: feature -> what it gives.
KERNEL_FEATURES = {
    "netem": "link delay and loss",
    "ovs-kernel-datapath": "OVS switching in the kernel",
    "soft-roce": "rdma_rxe with ib_write_bw/ib_send_bw (perftest) and the rxe verbs provider",
    "qdisc-red": "kernel RED for the ECN 'red' mode",
}
PYTEST_KERNEL_TIER = "python -m pytest -p no:cacheprovider -m kernel tests/kernel"


def add_parser(sub) -> None:
    vm = sub.add_parser("vm", help="the lab VM: a full Debian kernel under qemu (netem, RED, "
                                   "OVS kernel datapath, Soft-RoCE)")
    cmds = vm.add_subparsers(dest="vm_command", required=True, parser_class=type(vm))
    b = cmds.add_parser("build", help="build the VM image (cached; rebuilt when its inputs "
                                      "change)")
    b.add_argument("--rebuild", action="store_true", help="build even if cached")
    b.set_defaults(func=cmd_build)
    r = cmds.add_parser("run", help="boot the VM, run COMMAND as root in the shared working "
                                    "tree, return its exit code")
    _vm_options(r)
    r.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="a shell command (one quoted string, or words)")
    r.set_defaults(func=cmd_run)
    s = cmds.add_parser("shell", help="an interactive root shell in the VM (serial console)")
    _vm_options(s, timeout=False)
    s.set_defaults(func=cmd_shell)
    t = cmds.add_parser("test", help="run the kernel-feature tests (tests/kernel) in the VM")
    _vm_options(t)
    t.add_argument("pytest_args", nargs=argparse.REMAINDER, metavar="-- PYTEST ARGS")
    t.set_defaults(func=cmd_test)
    k = cmds.add_parser("kernel-check", help="exit 0 when this machine's kernel can run "
                                             "tests/kernel itself (else use the VM)")
    k.set_defaults(func=cmd_kernel_check)


def _vm_options(p, timeout: bool = True) -> None:
    if timeout:
        p.add_argument("--timeout", type=float, default=30, metavar="MIN",
                       help="stop the VM after MIN minutes (default 30)")
    p.add_argument("--memory-mb", type=int, default=3072)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--accel", choices=["auto", "kvm", "tcg"], default="auto",
                   help="auto: KVM when it boots the kernel, else the software CPU")
    p.add_argument("--nic", metavar="NETDEV", help="a NIC (the guest's eth0) on this qemu "
                   "-netdev, e.g. socket,listen=127.0.0.1:7100 in one VM and "
                   "socket,connect=127.0.0.1:7100 in another: a network between two lab VMs")


def _options(args):
    from lab.vm.machine import VMOptions
    if args.memory_mb < 512 or args.cpus < 1:
        raise UsageError("--memory-mb must be at least 512 and --cpus at least 1")
    timeout = getattr(args, "timeout", None)
    if timeout is not None and timeout <= 0:
        raise UsageError("--timeout must be a positive number of minutes")
    return VMOptions(memory_mb=args.memory_mb, cpus=args.cpus, accel=args.accel,
                     timeout_s=(timeout or 30) * 60, nic=args.nic)


def _image(rebuild: bool = False):
    from lab.vm import image
    console.attach("stderr")    # the lab's own lines; stdout carries the guest's output
    t0 = time.monotonic()
    img = image.ensure(rebuild=rebuild)
    return img, time.monotonic() - t0


def _words(rest: list[str]) -> list[str]:
    return rest[1:] if rest[:1] == ["--"] else rest


def cmd_build(args) -> int:
    img, took = _image(args.rebuild)
    print(f"lab VM image: {img.dir} ({(img.dir / 'READY').read_text().strip()}; "
          f"this command {took:.0f} s)")
    return 0


def _run(command: str, args, image_s: float, img) -> int:
    from lab.vm import machine
    result = machine.run(img, command, _options(args))
    boot = f"{result.boot_s:.1f} s" if result.boot_s is not None else "?"
    log.info(f"[vm] exit code {result.exit_code}; VM ran {result.total_s:.0f} s ({result.accel}, "
             f"init started at {boot} of guest uptime); image {image_s:.0f} s")
    return result.exit_code


def cmd_run(args) -> int:
    words = _words(args.command)
    if not words:
        raise UsageError("give the command after --, e.g. fabriclab vm run -- fabriclab doctor")
    command = words[0] if len(words) == 1 else shlex.join(words)
    img, image_s = _image()
    return _run(command, args, image_s, img)


def cmd_shell(args) -> int:
    from lab.vm import machine
    img, _ = _image()
    return machine.shell(img, _options(args))


def cmd_test(args) -> int:
    from lab.vm import image
    extra = shlex.join(_words(args.pytest_args))
    command = f"{image.VENV_IN_VM}/bin/{PYTEST_KERNEL_TIER} {extra}".strip()
    img, image_s = _image()
    return _run(command, args, image_s, img)


def _netem_works() -> bool:
    """Add a netem qdisc in a throwaway network namespace (unshare --net: it is gone
    when the command exits and never shows among the lab's named namespaces)."""
    probe = ("ip link add fl-probe0 type veth peer name fl-probe1 && "
             "tc qdisc add dev fl-probe0 root netem delay 1ms")
    return subprocess.run(["unshare", "--net", "sh", "-c", probe],
                          capture_output=True).returncode == 0


def _soft_roce_ready() -> bool:
    from pathlib import Path
    from shutil import which
    module = Path("/sys/module/rdma_rxe").exists() or (
        which("modprobe") is not None and Path("/proc/modules").exists()
        and subprocess.run(["modprobe", "-n", "-q", "rdma_rxe"]).returncode == 0)
    provider = any(Path(d).glob("librxe*.so") for d in
                   ("/usr/lib/x86_64-linux-gnu/libibverbs", "/usr/lib64/libibverbs"))
    return module and provider and all(which(t) for t in ("ib_write_bw", "ib_send_bw"))


def kernel_missing() -> dict[str, str]:
    """KERNEL_FEATURES this kernel lacks, probed for real."""
    from lab.fabric import doctor
    from lab.kernel import ovs
    have = {"netem": _netem_works(), "ovs-kernel-datapath": ovs.kernel_datapath_available(),
            "soft-roce": _soft_roce_ready(), "qdisc-red": doctor.qdisc_available("red")}
    return {name: why for name, why in KERNEL_FEATURES.items() if not have[name]}


def cmd_kernel_check(args) -> int:
    import os
    if os.geteuid() != 0:
        raise LabError("kernel-check probes the kernel and needs root (sudo)")
    missing = kernel_missing()
    if missing:
        print(f"this kernel lacks {'; '.join(f'{k} ({v})' for k, v in missing.items())}: "
              f"run the kernel tests in the lab VM (fabriclab vm test)")
        return 1
    print(f"this kernel has {', '.join(KERNEL_FEATURES)}: the kernel tests can run here")
    return 0
