"""The README's Vagrant path, run for real on this machine: `vagrant up` with the
libvirt provider, then `sudo make demo` in the guest, and what a user would check.

    sudo .venv/bin/python bench/vagrant_up.py [--command 'cd /fabriclab && sudo make demo']

The box is the lab VM's image made bootable by Vagrant (lab/vm/box.py, cached), named
to the Vagrantfile through FABRICLAB_VAGRANT_BOX. Where no libvirt daemon runs (this
machine has no systemd), the bench starts libvirtd and virtlogd itself inside the
network namespace fl-vagrant, recorded by PID: libvirt's NAT networks, their bridges,
dnsmasq and firewall rules then exist only in that namespace, and vagrant runs there
too (it reaches the guest's management address). Where /dev/kvm is missing the guest
runs on a software CPU (libvirt's qemu driver). Vagrant's state lives under the lab's
cache (VAGRANT_HOME), never in the user's home. At the end: `vagrant destroy`, the
libvirt networks, pool and volumes this run made, the daemons (by PID), the namespace.

Prints each stage's time and checks: the synced folder (a file the guest writes in
/fabriclab appears in this tree), provision.sh in the guest, Open vSwitch's kernel
datapath and RED in the guest (the demo's doctor), and the demo's results here.

Measured (12-05, 2 cores, software CPU): box 48 s (cached after), box add 6 s,
vagrant up 63 s, `sudo make demo` 996 s (the tour 48/50 claims), teardown 4 s; every
check ok. Needs: apt-get install vagrant vagrant-libvirt libvirt-daemon-system qemu-utils
(on a machine without systemd, with a policy-rc.d that answers 101 while installing, so
nothing starts in the root namespace).
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lab.core import state
from lab.core.paths import CACHE_DIR
from lab.vm import box, image, machine

REPO = Path(__file__).resolve().parent.parent
NETNS = "fl-vagrant"
VAGRANT_HOME = CACHE_DIR / "vagrant.d"
LIBVIRT_SOCK = Path("/run/libvirt/libvirt-sock")
IMAGES = Path("/var/lib/libvirt/images")     # libvirt's "default" pool
LOGS = REPO / "results"                      # the bench's logs, beside the demo's results
DEFAULT_COMMAND = "cd /fabriclab && sudo make demo"
REQUIRED = {"vagrant": "vagrant", "libvirtd": "libvirt-daemon-system",
            "virsh": "libvirt-clients", "qemu-img": "qemu-utils"}


def run(args, timeout=600, check=True, netns=False, **kw) -> subprocess.CompletedProcess:
    if netns:
        args = ["ip", "netns", "exec", NETNS, *args]
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode:
        sys.exit(f"{' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return r


def virsh(*args, check=True) -> subprocess.CompletedProcess:
    return run(["virsh", "-c", "qemu:///system", *args], check=check)


def names(kind: str) -> set[str]:
    """Defined libvirt objects of a kind (net, pool), active or not."""
    out = virsh(f"{kind}-list", "--all", "--name", check=False).stdout
    return {n.strip() for n in out.splitlines() if n.strip()}


def libvirt_config() -> set[Path]:
    """libvirt's definitions of pools, networks and domains (files under /etc/libvirt)."""
    return {f for d in ("storage", "qemu") for f in (Path("/etc/libvirt") / d).rglob("*.xml")}


class PrivateLibvirt:
    """libvirtd and virtlogd in the namespace NETNS, for a machine where none runs."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        run(["ip", "netns", "add", NETNS])
        run(["ip", "-n", NETNS, "link", "set", "lo", "up"])
        LOGS.mkdir(exist_ok=True)
        for daemon in ("virtlogd", "libvirtd"):
            with open(LOGS / f"vagrant-{daemon}.log", "w") as out:
                p = subprocess.Popen(["ip", "netns", "exec", NETNS, daemon],
                                     stdout=out, stderr=subprocess.STDOUT)
            state.record_process(p.pid, daemon, "vagrant bench")
            self.procs.append(p)
        for _ in range(100):
            if LIBVIRT_SOCK.exists() and virsh("version", check=False).returncode == 0:
                return self
            time.sleep(0.2)
        self.__exit__()
        sys.exit("libvirtd did not answer within 20 s")

    def __exit__(self, *exc):
        for net in names("net"):     # their dnsmasq outlives libvirtd unless destroyed
            virsh("net-destroy", net, check=False)
        for p in reversed(self.procs):
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        state.forget_processes({p.pid for p in self.procs})
        # anything left in the namespace was started there by this bench's daemons
        for pid in run(["ip", "netns", "pids", NETNS], check=False).stdout.split():
            try:
                os.kill(int(pid), 15)
            except ProcessLookupError:
                pass
        run(["ip", "netns", "del", NETNS], check=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--command", default=DEFAULT_COMMAND, help="what runs in the guest")
    ap.add_argument("--timeout-min", type=float, default=75)
    a = ap.parse_args()
    if os.geteuid():
        sys.exit("bench/vagrant_up.py needs root (libvirt, a network namespace): sudo")
    missing = sorted({pkg for tool, pkg in REQUIRED.items() if not shutil.which(tool)})
    if missing:
        sys.exit(f"missing: apt-get install {' '.join(missing)} vagrant-libvirt")
    times: dict[str, float] = {}
    t = time.monotonic()
    box_file = box.ensure()
    times["box"] = time.monotonic() - t
    # /dev/kvm can open and still fail to run a kernel (here): the lab VM's probe says
    accel, why = machine.accelerator(image.ensure())
    driver = "kvm" if accel == "kvm" else "qemu"
    env = {**os.environ, "VAGRANT_HOME": str(VAGRANT_HOME), "VAGRANT_CHECKPOINT_DISABLE": "1",
           "VAGRANT_DEFAULT_PROVIDER": "libvirt", "FABRICLAB_VAGRANT_BOX": box.NAME,
           "FABRICLAB_LIBVIRT_DRIVER": driver, "LIBVIRT_DEFAULT_URI": "qemu:///system"}
    vagrant_dir = REPO / "vagrant"
    own = not (LIBVIRT_SOCK.exists() and virsh("version", check=False).returncode == 0)
    daemons = PrivateLibvirt() if own else None
    print(f"box {box_file}; libvirt: {'started in namespace ' + NETNS if own else 'running'}"
          f"; guest CPU: {why}", flush=True)
    marker = REPO / "results" / f"vagrant-synced-{os.getpid()}"
    checks: dict[str, bool] = {}
    config0 = libvirt_config()
    if daemons:
        daemons.__enter__()
    nets0, pools0 = names("net"), names("pool")
    vols0, files0 = set(), set(IMAGES.glob("*"))
    try:
        if "default" not in pools0:
            virsh("pool-define-as", "default", "dir", "--target", str(IMAGES))
            virsh("pool-build", "default")
            virsh("pool-start", "default")
        vols0 = set(virsh("vol-list", "default", "--name", check=False).stdout.split())
        files0 = set(IMAGES.glob("*"))
        t = time.monotonic()
        run(["vagrant", "box", "add", "--force", "--name", box.NAME, str(box_file)],
            env=env, cwd=vagrant_dir)
        times["box add"] = time.monotonic() - t
        t = time.monotonic()
        up = run(["vagrant", "up", "--provider", "libvirt"], env=env, cwd=vagrant_dir,
                 netns=own, timeout=int(a.timeout_min * 60), check=False)
        times["vagrant up"] = time.monotonic() - t
        (LOGS / "vagrant-up.log").write_text(up.stdout + up.stderr)
        checks["vagrant up"] = up.returncode == 0
        checks["provision.sh ran in the guest"] = "[provision] done" in up.stdout
        if up.returncode:
            print(up.stdout[-4000:], up.stderr[-4000:])
        else:
            guest = ["vagrant", "ssh", "-c"]
            rel = marker.relative_to(REPO)
            run([*guest, f"sudo touch /fabriclab/{rel}"],
                env=env, cwd=vagrant_dir, netns=own)
            checks["a file written in the guest appears here"] = marker.exists()
            marker.unlink(missing_ok=True)
            before = set((REPO / "results").glob("*"))
            t = time.monotonic()
            demo = run([*guest, a.command], env=env, cwd=vagrant_dir, netns=own,
                       timeout=int(a.timeout_min * 60), check=False)
            times["command"] = time.monotonic() - t
            out = demo.stdout + demo.stderr
            (LOGS / "vagrant-demo.log").write_text(out)
            checks["the command succeeded"] = demo.returncode == 0
            # the demo's doctor: a line per feature
            checks["OVS kernel datapath in the guest"] = "OVS datapath: kernel" in out
            checks["kernel RED in the guest"] = re.search(r"ok\s+qdisc-red\b", out) is not None
            new = set((REPO / "results").glob("*")) - before
            checks["results appeared here"] = any(p.is_dir() for p in new)
            print(out[-3000:])
    finally:
        t = time.monotonic()
        run(["vagrant", "destroy", "-f"], env=env, cwd=vagrant_dir, netns=own, check=False)
        for vol in set(virsh("vol-list", "default", "--name", check=False).stdout.split()) - vols0:
            virsh("vol-delete", vol, "--pool", "default", check=False)
        if own:     # what this run's own libvirtd left in its pool (the box's base image)
            for f in set(IMAGES.glob("*")) - files0:
                f.unlink()
        for net in names("net") - nets0:
            virsh("net-destroy", net, check=False)
            virsh("net-undefine", net, check=False)
        if "default" not in pools0:
            virsh("pool-destroy", "default", check=False)
            virsh("pool-undefine", "default", check=False)
        if daemons:
            daemons.__exit__()
            # what this run's libvirtd defined and could not undefine (it died early:
            # seen once) is only in its configuration files
            for f in libvirt_config() - config0:
                f.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)
        times["teardown"] = time.monotonic() - t
    print("\nstage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
    for what, ok in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    sys.exit(0 if checks and all(checks.values()) else 1)


if __name__ == "__main__":
    main()
