"""A fabric across machines, on this machine: what can be checked without a second
one (the two-VM test is tests/cluster)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FABRICLAB, REPO, fabriclab

from lab.core.errors import LabError
from lab.vm.machine import check_memory


# stands in for ssh where no second machine is: runs the remote command here, as ssh
# would run it there (the options and the target are ssh's business)
LOCAL_SSH = f"{sys.executable} {REPO}/tests/local_ssh.py"


def test_an_unreachable_machine_is_said_plainly():
    """No ssh server at the address: the head keeps trying for --wait S, then says which
    machine, what ssh said, and how to wait longer."""
    r = fabriclab("verify", "--machines", "127.0.0.1,root@127.0.0.2", "--wait", "1",
                  timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "could not start a cluster worker on machine 1 (root@127.0.0.2) over ssh" \
        in r.stderr, r.stderr
    assert "Connection refused" in r.stderr and "--wait" in r.stderr, r.stderr


def test_the_userspace_datapath_is_refused_before_building_and_the_worker_lets_go():
    """On OVS's userspace datapath (forced here, as on this CI machine) the head says it
    cannot tunnel and what to use instead, before it builds anything; the worker, seeing
    the head gone (its stdin ends), exits by itself, and nothing of the lab is left."""
    env = {**os.environ, "FABRICLAB_DATAPATH": "user"}
    r = fabriclab("verify", "--machines", "127.0.0.1,root@127.0.0.1", "--ssh", LOCAL_SSH,
                  timeout=120, env=env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "needs OVS's kernel datapath" in r.stderr and "lab VM" in r.stderr, r.stderr
    assert "building" not in r.stdout + r.stderr
    # the worker's log reaches the head through ssh, under its machine's name
    assert re.search(r"\[machine 1\] .*the part is down", r.stdout), r.stdout


def _worker() -> subprocess.Popen:
    """A worker as ssh starts one: its stdin and stdout pipes; its hello read."""
    worker = subprocess.Popen(FABRICLAB + ["cluster", "worker"], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    hello = json.loads(worker.stdout.readline())
    assert hello["ok"] and hello["worker"] and hello["pid"] == worker.pid, hello
    return worker


def _sockets(pid: int) -> set[str]:
    """The inodes of the sockets process `pid` has open."""
    fds = Path(f"/proc/{pid}/fd")
    return {os.readlink(fd)[len("socket:["):-1] for fd in fds.iterdir()
            if os.readlink(fd).startswith("socket:[")}


def _listening(inodes: set[str]) -> list[str]:
    """Which of these sockets listen: TCP in state LISTEN, UDP bound, or a listening
    Unix socket (/proc/net: the inode is the 10th field, 7th for Unix sockets)."""
    found = []
    for proto in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
        for line in Path(f"/proc/net/{proto}").read_text().splitlines()[1:]:
            f = line.split()
            if f[9] in inodes and (proto.startswith(("udp", "raw")) or f[3] == "0A"):
                found.append(f"{proto} {f[1]}")
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if f[6] in inodes and int(f[3], 16) & 0x10000:       # __SO_ACCEPTCON
            found.append(f"unix {f[7:] or ''}")
    return found


def test_a_worker_listens_on_nothing_and_starts_nothing_but_the_lab_s_agent():
    """A worker speaks on its stdin and stdout only: it has no listening socket. Asked
    to start a process, it refuses anything but a GPU agent's arguments (a forged
    `-c CODE` is refused before anything runs, and so is a request whose fields are
    wrong), and an agent only in a host of a part it has up: nothing is started."""
    marker = Path(f"/tmp/fabriclab-forged-{os.getpid()}")
    worker = _worker()
    try:
        assert _listening(_sockets(worker.pid)) == []

        def ask(**msg) -> dict:
            worker.stdin.write(json.dumps(msg).encode() + b"\n")
            worker.stdin.flush()
            return json.loads(worker.stdout.readline())
        forged = ask(op="attach", host="g0", stream=1,
                     args=["-c", f"open({str(marker)!r}, 'w')"])
        assert not forged["ok"] and "not a GPU agent's arguments" in forged["error"], forged
        assert not ask(op="attach", host="g0", stream=2, args="-c x")["ok"]
        agent = ["--intf", "g0-eth0", "--mac", "02:00:00:00:00:01", "--ip", "10.0.0.1",
                 "--rate-mbps", "10"]
        no_part = ask(op="attach", host="g0", stream=3, args=agent)
        assert not no_part["ok"] and "no part up" in no_part["error"], no_part
        odd = ask(op="attach", host="g0", args=agent, stream=4, argv=["/bin/sh"])
        assert not odd["ok"], odd
        assert not ask(op="popen", args=["/bin/sh"])["ok"]
        children = Path(f"/proc/{worker.pid}/task/{worker.pid}/children").read_text()
        assert children.strip() == "", children
        assert _listening(_sockets(worker.pid)) == []
        worker.stdin.close()                 # the head is gone: the worker ends
        assert worker.wait(timeout=60) == 0
        assert "the part is down" in worker.stderr.read().decode()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert not marker.exists()


def test_a_worker_started_from_a_terminal_says_how_it_is_started():
    import pty
    leader, follower = pty.openpty()
    r = subprocess.run(FABRICLAB + ["cluster", "worker"], cwd=REPO, stdin=follower,
                       capture_output=True, text=True, timeout=60)
    os.close(leader)
    os.close(follower)
    assert r.returncode == 2 and "over ssh" in r.stderr and "--machines" in r.stderr, r.stderr


def test_ssh_reaches_a_worker_as_the_user_with_the_controller_forwarded():
    """The command the head runs: the user's ssh, never prompting, the head's controller
    port forwarded to the other machine's loopback only, root's worker there (sudo
    unless the target is root@), the fabriclab of the same path."""
    from lab.ssh import Reach, address
    argv = Reach(ssh="ssh -p 2222", remote_fabriclab="/opt/f/bin/fabriclab").argv(
        "alice@10.0.0.2", 6633)
    assert argv[:3] == ["ssh", "-p", "2222"] and "BatchMode=yes" in argv, argv
    assert argv[argv.index("-R") + 1] == "127.0.0.1:6633:127.0.0.1:6633", argv
    assert argv[-3:] == ["alice@10.0.0.2", "--",
                         "sudo -n /opt/f/bin/fabriclab cluster worker"], argv
    assert Reach().argv("root@h", 1)[-1] == \
        f"{Path(sys.executable).parent / 'fabriclab'} cluster worker"
    assert address("alice@10.0.0.2") == address("10.0.0.2") == "10.0.0.2"


def test_queue_settings_reach_a_worker_as_they_were():
    """The head sends its QueueParams as JSON (DSCP keys become strings, RED a dict);
    the worker's part gets the same queues back."""
    import dataclasses
    import json

    from lab.cluster import queue_params
    from lab.kernel.queues import QueueParams, RedParams
    for q in (QueueParams(buffer_kb=96, express_class=1),
              QueueParams(red=RedParams(2048, 16384, 0.2))):
        assert queue_params(json.loads(json.dumps(dataclasses.asdict(q)))) == q


def test_a_workers_clock_offset_is_measured_and_its_processes_take_the_heads_time():
    """The head reads a worker's clock over the channel (the quickest of several round
    trips); a process the worker starts with the offset in its environment stamps the
    head's time (traffic/clock.py)."""
    import sys
    import time

    from lab.cluster import Cluster
    from traffic import clock

    class Ahead:            # a worker whose clock runs 2.5 s ahead, answering in ~1 ms
        def ask(self, timeout_s, op):
            time.sleep(0.001)
            return {"t": time.time() + 2.5}
    assert abs(Cluster._clock_offset(Ahead()) - 2.5) < 0.005
    code = "import time; from traffic import clock; print(clock.now() - time.time())"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, clock.OFFSET_ENV: "-2.5"}, check=True)
    assert abs(float(r.stdout) + 2.5) < 0.01, r.stdout


def test_run_across_machines_says_what_cannot():
    """`fabriclab run --machines`: an experiment not made for it is refused by name, as
    is a fabric whose hosts hang off fewer leaves than machines (a leaf and its GPUs stay
    on one machine), each before anything is built."""
    r = fabriclab("run", "ecmp-vs-spray", "--machines", "127.0.0.1,127.0.0.2", timeout=60)
    assert r.returncode == 2 and "does not run across machines yet" in r.stderr, r.stderr
    assert "incast" in r.stderr, r.stderr
    r = fabriclab("run", "incast", "--machines", "127.0.0.1,127.0.0.2", timeout=60)
    assert r.returncode == 2 and "at most 1 machines" in r.stderr, r.stderr
    assert "--set leaves=" in r.stderr, r.stderr


def test_two_lab_vms_are_refused_plainly_where_memory_is_short(tmp_path):
    """The cluster tier boots two 3 GB lab VMs; qemu takes a guest's memory only as it is
    touched, so a short host would fail mid-run. The lab says so before booting."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        8000000 kB\nMemFree:         4000000 kB\n"
                       "MemAvailable:    5120000 kB\n")
    with pytest.raises(LabError) as e:
        check_memory(6144, "two lab VMs of 3072 MB", meminfo)
    assert "needs 6144 MB" in str(e.value) and "5000 MB available" in str(e.value)
    check_memory(3072, "a lab VM of 3072 MB", meminfo)     # one fits
