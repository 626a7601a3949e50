"""Two lab VMs on one host, joined by a virtual network: a cluster to test the lab's
fabric across machines (lab/cluster.py) on one machine.

qemu's socket netdev links their NICs over a TCP connection on loopback (machine 1's
qemu listens, machine 0's connects: nothing leaves the host). Each guest's eth0 gets
10.99.0.<machine + 1>/24 and MTU 9000 (a full fabric frame in VXLAN needs 1550). Each VM
is a `fabriclab vm run` of its own, in a process group this module starts and, if it
outlives the other, stops.
"""
from __future__ import annotations

import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab.core.errors import LabError
from lab.vm.image import REPO
from lab.vm.machine import VMOptions, check_memory

SUBNET = "10.99.0"
MTU = 9000
LINGER_S = 120      # how long machine 1 may run on once machine 0 is done


def room() -> str | None:
    """None when this host has the memory for two lab VMs, else why not (a Vagrant VM of
    4 GB has not: `make test` skips the cluster tier there, saying this)."""
    each_mb = VMOptions().memory_mb      # `fabriclab vm run`'s default, as _start runs it
    try:
        check_memory(2 * each_mb, f"two lab VMs of {each_mb} MB (a cluster on one host)")
    except LabError as e:
        return str(e)
    return None


def address(machine: int) -> str:
    return f"{SUBNET}.{machine + 1}"


@dataclass
class Outcome:
    exit_code: int
    lines: list[str] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(machine: int, netdev: str, command: str, timeout_min: float) -> subprocess.Popen:
    guest = (f"ip link set dev eth0 mtu {MTU} up && "
             f"ip addr add {address(machine)}/24 dev eth0 && {command}")
    return subprocess.Popen([sys.executable, "-m", "lab", "vm", "run", "--timeout",
                             str(timeout_min), "--nic", netdev, "--", guest],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until a socket listens on loopback `port` (/proc/net/tcp: a connection to find out
    would be taken for the other VM's), or `proc` ended."""
    deadline = time.monotonic() + timeout_s
    want = f":{port:04X} "
    while time.monotonic() < deadline and proc.poll() is None:
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if (local + " ").endswith(want) and state == "0A":    # TCP_LISTEN
                    return
        time.sleep(0.2)
    raise LabError(f"machine 1's VM did not listen on 127.0.0.1:{port} "
                   f"({'it exited' if proc.poll() is not None else 'timed out'})")


def _relay(proc: subprocess.Popen, prefix: str, lines: list[str], echo) -> threading.Thread:
    def run():
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            lines.append(line)
            if echo is not None:
                echo(f"{prefix} {line}")
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def run(head: str, worker: str, timeout_min: float = 30, echo=print) -> tuple[Outcome, Outcome]:
    """Machine 0 runs `head`, machine 1 runs `worker`; both outcomes once machine 0 is
    done (machine 1 is given LINGER_S to finish, then stopped). `echo` gets every line
    of both consoles, prefixed with the machine."""
    why = room()
    if why:
        raise LabError(why)
    port = _free_port()
    procs = [None, None]
    outcomes = (Outcome(-1), Outcome(-1))
    procs[1] = _start(1, f"socket,listen=127.0.0.1:{port}", worker, timeout_min)
    threads = [_relay(procs[1], "[machine 1]", outcomes[1].lines, echo)]
    try:
        _wait_listening(port, procs[1])      # machine 0's qemu connects as it starts
        procs[0] = _start(0, f"socket,connect=127.0.0.1:{port}", head, timeout_min)
        threads.append(_relay(procs[0], "[machine 0]", outcomes[0].lines, echo))
        outcomes[0].exit_code = procs[0].wait()
        try:
            outcomes[1].exit_code = procs[1].wait(timeout=LINGER_S)
        except subprocess.TimeoutExpired:
            pass
    finally:
        for p in procs:
            if p is not None and p.poll() is None:
                subprocess.run(["kill", "--", f"-{p.pid}"])    # its group: started here
                p.wait()
        for t in threads:
            t.join(timeout=5)
    return outcomes


# --- the head reaches machine 1 over ssh, as on real machines (lab/ssh.py) ----------------
KEYS_DIR = "results/.cluster-ssh"       # in the shared tree (results/ is never committed)
DONE_FILE = "/run/fabriclab-head-done"  # on machine 1: the head is done, power off


def target(machine: int) -> str:
    """How the head names a machine of the pair: root, who runs the lab in a lab VM."""
    return f"root@{address(machine)}"


def _keys() -> Path:
    """A fresh key pair for the head and a host key for machine 1's ssh server, made on
    the host for this run (both VMs see them in the shared tree)."""
    keys = REPO / KEYS_DIR
    shutil.rmtree(keys, ignore_errors=True)
    keys.mkdir(parents=True)
    for name in ("head", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                        f"fabriclab lab VM pair {name}", "-f", str(keys / name)], check=True)
    return keys


def run_cluster(head: str, timeout_min: float = 30, echo=print) -> tuple[Outcome, Outcome]:
    """Machine 1 runs an ssh server that lets in the head's key (its own host key known
    to the head) until the head is done; machine 0 runs `head`, which reaches machine 1
    as `target(1)`, and then tells machine 1 to power off. Both outcomes (pair.run)."""
    keys = _keys()
    sshd = (f"install -d -m 700 /root/.ssh /run/sshd && "
            f"install -m 600 {KEYS_DIR}/head.pub /root/.ssh/authorized_keys && "
            f"install -m 600 {KEYS_DIR}/host /run/ssh_host_key && "
            f"/usr/sbin/sshd -h /run/ssh_host_key -o UsePAM=no "
            f"-o PermitRootLogin=prohibit-password && "
            f"while [ ! -e {DONE_FILE} ]; do sleep 1; done")
    known = f"{address(1)} {' '.join((keys / 'host.pub').read_text().split()[:2])}"
    client = (f"install -d -m 700 /root/.ssh && "
              f"install -m 600 {KEYS_DIR}/head /root/.ssh/id_ed25519 && "
              f"echo {shlex.quote(known)} > /root/.ssh/known_hosts")
    try:
        return run(f"{client} && {{ {head}; }}; rc=$?; "
                   f"ssh -o BatchMode=yes {target(1)} touch {DONE_FILE}; exit $rc",
                   sshd, timeout_min, echo)
    finally:
        shutil.rmtree(keys, ignore_errors=True)
