"""A fabric across machines, on this machine: what can be checked without a second
one (the two-VM test is tests/cluster)."""
import os
import socket
import subprocess

from conftest import FABRICLAB, REPO, fabriclab


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
