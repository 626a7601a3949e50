"""A fabric across machines, on this machine: what can be checked without a second
one (the two-VM test is tests/cluster)."""
import os
import socket
import subprocess

import pytest
from conftest import FABRICLAB, REPO, fabriclab

from lab.core.errors import LabError
from lab.vm.machine import check_memory


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_worker_is_said_plainly():
    port = _free_port()
    r = fabriclab("verify", "--machines", "127.0.0.1,127.0.0.2", "--worker-port", str(port),
                  "--wait", "1", timeout=60)
    assert r.returncode == 1
    assert f"no cluster worker at 127.0.0.2:{port} within 1 s" in r.stderr, r.stderr
    assert "fabriclab cluster worker" in r.stderr, r.stderr


def test_the_userspace_datapath_is_refused_before_building_and_the_worker_lets_go():
    """On OVS's userspace datapath (forced here, as on this CI machine) the head says it
    cannot tunnel and what to use instead, before it builds anything; the worker, seeing
    the head gone, exits by itself (--once), and nothing of the lab is left."""
    port = _free_port()
    env = {**os.environ, "FABRICLAB_DATAPATH": "user"}
    worker = subprocess.Popen(FABRICLAB + ["cluster", "worker", "--once", "--listen",
                                           "127.0.0.1", "--port", str(port)],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env)
    try:
        r = fabriclab("verify", "--machines", "127.0.0.1,127.0.0.1",
                      "--worker-port", str(port), timeout=120, env=env)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "needs OVS's kernel datapath" in r.stderr and "lab VM" in r.stderr, r.stderr
        assert "building" not in r.stdout + r.stderr
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode == 0 and "the part is down" in out, out
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


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
