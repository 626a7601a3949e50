"""Teardown, the lock, Ctrl-C, bad input, and cleanup that spares what is not the lab's."""
import json
import os
import signal
import subprocess

import pytest

import gzip
from pathlib import Path

from conftest import FABRICLAB, REPO, fabriclab, requires_root
from lab.core import paths
from lab.core.state import RunLock
from lab.fabric import cleanup
from lab.fabric.network import FabricNetwork
from lab.kernel import rcu
from topologies.registry import build_topo


@pytest.mark.parametrize("args,word", [
    (["verify", "--set", "topology=torus"], "torus"),
    (["verify", "--set", "spines=0"], "spines"),
    (["verify", "--set", "leaves=-2"], "leaves"),
    (["verify", "--set", "host-rate-mbps=0"], "host_rate_mbps"),
    (["verify", "--set", "k=4"], "'k'"),
    (["verify", "--set", "topology=fat-tree", "--set", "k=5"], "k must be even"),
    (["verify", "--set", "spines"], "key=value"),
    (["up", "--spines", "2"], "--set spines="),      # the old spelling says the new one
    (["run", "nope"], "nope"),
    (["run", "reachability", "--set", "colour=blue"], "colour"),
    (["run", "reachability", "--set", "tries=lots"], "tries"),
    (["run", "reachability", "--set", "topology=ring"], "ring"),
    (["run", "reachability", "--set", "spines=0"], "spines"),
    (["run", "allreduce", "--set", "algorithm=hier"], "topology=rack"),
    (["allreduce", "--values", "0.5"], "--values"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(args, word, tmp_path):
    r = fabriclab(*args, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "results").exists()


@requires_root
def test_teardown_after_success_and_after_failure(tmp_path):
    topo = build_topo("leaf-spine", spines=2, leaves=2, hosts_per_leaf=1)
    rcu_before = rcu.SWITCH.read_text()
    with FabricNetwork(topo, tmp_path / "ok") as net:
        assert cleanup.lab_bridges() and cleanup.lab_links() and cleanup.live_processes()
        # every switch port is in the lab's device group, which teardown deletes at once
        in_group = subprocess.run(["ip", "-o", "link", "show", "group",
                                   str(cleanup.LINK_GROUP)], capture_output=True,
                                  text=True).stdout
        switches = {sw.name for sw in net.fabric.switches}
        assert len(in_group.splitlines()) == sum((ln.a in switches) + (ln.b in switches)
                                                 for ln in net.fabric.links)
    assert not any(cleanup.leftovers().values())
    assert rcu.SWITCH.read_text() == rcu_before
    with pytest.raises(RuntimeError):
        with FabricNetwork(topo, tmp_path / "fail"):
            raise RuntimeError("an experiment failed")
    assert not any(cleanup.leftovers().values())


@requires_root
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("wait_for", ["building", "fabric ready"])
def test_ctrl_c_or_sigterm_tears_everything_down(wait_for, sig, code):
    # as from a terminal: a suite started in the background by a shell without job control
    # inherits SIGINT ignored, and Python keeps an ignored SIGINT ignored
    proc = subprocess.Popen(FABRICLAB + ["verify", "--set", "leaves=4",
                                          "--set", "hosts_per_leaf=4"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if wait_for in line:
            break
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert "torn down" in err
    assert not any(cleanup.leftovers().values())


@requires_root
def test_a_second_run_is_refused_while_one_is_active():
    with RunLock("a test holding the lab"):
        r = fabriclab("verify")
    assert r.returncode == 1
    assert "another fabriclab run is active" in r.stderr and "a test holding the lab" in r.stderr
    assert not any(cleanup.leftovers().values())


@requires_root
def test_clean_removes_lab_objects_and_spares_foreign_ones():
    foreign_br, foreign_ns = "flannel-test0", "fl_foreign"   # look alike, are not the lab's
    subprocess.run(["ovs-vsctl", "add-br", foreign_br, "--", "set", "bridge", foreign_br,
                    "datapath_type=netdev"], check=True)
    subprocess.run(["ip", "netns", "add", foreign_ns], check=True)
    subprocess.run(["ip", "link", "add", "fl-lf9-eth1", "type", "veth", "peer", "name",
                    "fl-tmp-peer"], check=True)          # a lab link left by a crash
    group = str(cleanup.LINK_GROUP)                      # ...and one in the lab's group
    subprocess.run(["ip", "link", "add", "fl-lf8-eth1", "group", group, "type", "veth",
                    "peer", "name", "fl-tmp-peer8"], check=True)
    # another program's link in the same group: the group is not deleted at once then
    subprocess.run(["ip", "link", "add", "flannel-g0", "group", group, "type", "veth",
                    "peer", "name", "flannel-g1"], check=True)
    # a teardown killed while RCU was expedited (lab/kernel/rcu.py): the value it found
    rcu_before = rcu.SWITCH.read_text().strip()
    rcu.RESTORE_FILE.parent.mkdir(parents=True, exist_ok=True)
    rcu.RESTORE_FILE.write_text(rcu_before)
    rcu.SWITCH.write_text("1")
    subprocess.run(["ovs-vsctl", "add-br", "fl-sp9", "--", "set", "bridge", "fl-sp9",
                    "datapath_type=netdev"], check=True)  # a lab bridge left by a crash
    sleeper = subprocess.Popen(["sleep", "60"])           # a process the lab did not start
    try:
        r = fabriclab("clean")
        assert r.returncode == 0, r.stderr
        assert "fl-sp9" in r.stdout
        assert not cleanup.lab_bridges() and not cleanup.lab_links()
        bridges = subprocess.run(["ovs-vsctl", "list-br"], capture_output=True,
                                 text=True).stdout.split()
        assert foreign_br in bridges
        assert foreign_ns in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                            text=True).stdout
        assert sleeper.poll() is None
        assert "flannel-g0" in subprocess.run(["ip", "-o", "link", "show"],
                                              capture_output=True, text=True).stdout
        assert rcu.SWITCH.read_text().strip() == rcu_before and not rcu.RESTORE_FILE.exists()
    finally:
        rcu.restore()
        subprocess.run(["ip", "link", "del", "flannel-g0"])
        sleeper.kill()
        sleeper.wait()
        subprocess.run(["ovs-vsctl", "--if-exists", "del-br", foreign_br])
        subprocess.run(["ip", "netns", "del", foreign_ns])


def test_metrics_json_is_never_half_written(tmp_path, monkeypatch):
    from lab import results
    path = tmp_path / "metrics.json"
    results.write_json_atomic(path, {"ok": 1})

    def exploding_dump(obj, f, **kw):
        f.write('{"half": ')
        raise OSError("disk full")
    monkeypatch.setattr(results.json, "dump", exploding_dump)
    with pytest.raises(OSError):
        results.write_json_atomic(path, {"ok": 2})
    assert json.loads(path.read_text()) == {"ok": 1}


def test_an_app_stopped_mid_write_leaves_no_half_written_file(tmp_path):
    """The lab stops the controller with a signal, which can land between an app writing
    its state's temporary copy and renaming it (once in the lab VM: a run's directory
    kept `.congestion-state.json.tmp`). Once the app has exited, the copy is removed and
    the last whole state stays."""
    import sys
    from controllers import protocol
    from lab.fabric.controller import Controller
    protocol.write_state(tmp_path, {"t": 1.0})
    unfinished = tmp_path / f".{protocol.STATE_FILE}.tmp"
    # the app, stopped between the two steps of its next write
    app = subprocess.Popen([sys.executable, "-c", "import pathlib, sys, time; "
                            "pathlib.Path(sys.argv[1]).write_text('{\"t\": 2'); "
                            "time.sleep(60)", str(unfinished)])
    ctl = Controller(build_topo("leaf-spine", spines=1, leaves=1, hosts_per_leaf=2).fabric,
                     tmp_path)
    ctl.proc = app
    while not unfinished.exists():
        assert app.poll() is None
    ctl.stop()
    assert app.returncode == -signal.SIGTERM
    assert not unfinished.exists()
    assert protocol.read_state(tmp_path) == {"t": 1.0}


@requires_root
def test_doctor_reports_this_kernel(machine_calibration):
    r = fabriclab("doctor", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    caps = {c["name"]: c["available"] for c in d["capabilities"]}
    assert d["can_run"] and caps["qdisc-htb"]
    config = Path("/proc/config.gz")
    if config.exists():   # the kernel's own word, independent of doctor's probe
        text = gzip.decompress(config.read_bytes()).decode()
        built = {line.split("=")[0] for line in text.splitlines() if line.endswith(("=y", "=m"))}
        assert caps["qdisc-red"] == ("CONFIG_NET_SCH_RED" in built)
        assert caps["qdisc-netem"] == ("CONFIG_NET_SCH_NETEM" in built)
        # the data path needs BPF ring buffers and tc's BPF classifier
        assert caps["bpf-dataplane"] == ({"CONFIG_BPF_SYSCALL", "CONFIG_NET_CLS_BPF",
                                          "CONFIG_NET_SCH_INGRESS"} <= built)
    assert d["ecn_mode_default"] == ("red" if caps["qdisc-red"] else
                                     "bpf" if caps["bpf-dataplane"] else "controller")
    # the machine's calibration (the suite made sure there is one), read back by doctor
    c = machine_calibration
    assert d["calibration"]["keep_up_mbps"] == c.keep_up_mbps
    assert d["calibration"]["machine_factor"] == c.factor


def test_doctor_says_when_the_machine_is_not_calibrated(tmp_path):
    env = {**os.environ, paths.CALIBRATION_ENV: str(tmp_path / "none.json")}
    r = fabriclab("doctor", env=env)
    assert "machine speed: not calibrated (`fabriclab calibrate`" in r.stdout, r.stdout
    assert json.loads(fabriclab("doctor", "--json", env=env).stdout)["calibration"] is None
