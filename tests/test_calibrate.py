"""Calibration: the link rate this machine's GPU hosts keep up with, and the runner
scaling the experiments' defaults on a machine slower than the reference."""
import json
import os
import re
from pathlib import Path

from conftest import fabriclab
from lab import runner
from lab.experiments import base as experiment
from lab.core import paths
from lab.experiments.common import TIMEOUT_IDEALS, traffic_timeout_s
from lab.fabric import calibrate


def test_defaults_scale_with_the_machine_and_what_the_user_sets_stays():
    incast = runner.load("incast")
    p, t, _ = runner.split_settings(incast, ["senders=4"], machine_factor=0.2)
    assert (p.senders, p.flow_kb) == (4, 1200)   # DCQCN converges in packets: no shrinking
    assert (p.pfc_flow_kb, p.uet_flow_kb) == (300, 75)   # no fairness claimed: x0.25, the floor
    assert (t.host_rate_mbps, t.fabric_rate_mbps, t.rate_scale) == (2.0, 2.0, 50000)
    spreading = runner.load("pfc-spreading")
    p, _, _ = runner.split_settings(spreading, ["victim_kb=100"], machine_factor=0.2)
    default = spreading.Params()
    assert (p.incast_kb, p.victim_kb) == (default.incast_kb * 0.25, 100)   # x0.25, the floor
    p, t, _ = runner.split_settings(incast, ["flow_kb=100", "host_rate_mbps=7"], 0.5)
    assert (p.flow_kb, t.host_rate_mbps, t.fabric_rate_mbps) == (100, 7.0, 5.0)
    rack = runner.load("rack-vs-scaleout")                # the rack's rates scale together
    _, t, _ = runner.split_settings(rack, [], 0.5)
    assert (t.scaleout_rate_mbps, t.fabric_rate_mbps, t.scaleup_factor) == (1.0, 4.0, 9.0)
    p, t, _ = runner.split_settings(incast, [], 1.0)      # a fast machine: the defaults
    assert (p.flow_kb, t.host_rate_mbps, t.rate_scale) == (1200, 10.0, 10000)
    # a failure's times stretch as the traffic does (x0.25 sizes over x0.08 links: x3.125),
    # so a flap meets the all-reduce as often as at the defaults; what is set stays
    failure = runner.load("link-failure")
    p, _, _ = runner.split_settings(failure, ["burst_ms=50"], machine_factor=0.08)
    default = failure.Params()
    assert (p.flap_period_ms, p.reroute_delay_ms, p.fail_after_s, p.burst_ms) == (
        default.flap_period_ms * 3.125, default.reroute_delay_ms * 3.125,
        default.fail_after_s * 3.125, 50)
    assert runner.split_settings(failure, [], 0.5)[0].flap_period_ms == default.flap_period_ms


def test_an_experiment_keeping_more_hosts_busy_runs_slower_links():
    """A slow machine's agents cost more than their packets: in the lab VM under TCG one
    pair kept up with 14.1 Mb/s, four pairs at once with ~1.1 each. An experiment's
    factor follows the flow ends it keeps busy: the pair's for 2, the four pairs' for 8
    and more, geometric between; the reference machine runs every default as it is."""
    c = calibrate.Calibration(14.1, 1.0, {}, [], [], "")
    assert c.factor == 14.1 / 50 and c.busy_factor == 1.0 / 10
    assert c.factor_for(2) == c.factor_for(1) == 0.282 and c.factor_for(8) == 0.1
    assert c.factor_for(4) == round(0.282 * (0.1 / 0.282) ** (1 / 3), 4) == 0.1996
    assert c.factor_for(16) == 0.1        # measured no further than 8
    assert calibrate.Calibration(100, 10, {}, [], [], "").factor_for(16) == 1.0
    # never faster with more hosts busy, whatever the busy measurement says
    assert calibrate.Calibration(10, 10, {}, [], [], "").factor_for(8) == 0.2
    busy = {name: experiment.busy_ends(mod) for name, mod in runner.available().items()}
    assert busy["incast"] == busy["loss-recovery"] == 2 and busy["ecmp-vs-spray"] == 8
    assert busy["allreduce"] == busy["link-failure"] == 8 and busy["plane-failure"] == 16


def test_traffic_waits_in_proportion_to_its_bytes_not_a_fixed_time():
    """At x0.07 (a software-CPU VM) incast's 8 x 1200 KB through a 0.7 Mb/s port take
    110 s at best: a fixed 120 s cut a run off there. Every experiment's traffic limit
    comes from traffic_timeout_s, none is a number written in."""
    incast = runner.load("incast")
    p, t, _ = runner.split_settings(incast, [], machine_factor=0.07)
    ideal_s = p.senders * p.flow_kb * 1024 * 8 / (t.host_rate_mbps * 1e6)
    assert ideal_s > 100
    assert traffic_timeout_s(p.senders * p.flow_kb * 1024, t.host_rate_mbps) == \
        TIMEOUT_IDEALS * ideal_s
    experiments = Path(runner.experiments_pkg.__path__[0])
    fixed = [f"{f.name}: {m.group(0)}" for f in experiments.glob("*.py")
             for m in re.finditer(r"timeout_s=\d", f.read_text())]
    assert not fixed, fixed


def test_the_search_refines_between_the_sweeps_steps():
    def machine(limit):
        tried = []
        def keeps_up_at(rate):
            tried.append(rate)
            return rate <= limit
        return tried, keeps_up_at
    tried, at = machine(8.0)
    assert calibrate.search((5, 10, 20), at) == 7.1 and tried == [5, 10, 7.1, 8.4]
    tried, at = machine(6.0)
    assert calibrate.search((5, 10, 20), at) == 6.0 and tried == [5, 10, 7.1, 6.0]
    tried, at = machine(100.0)
    assert calibrate.search((5, 10, 20), at) == 20 and tried == [5, 10, 20]   # all keep up
    tried, at = machine(3.0)           # below the first rate: halving, then between
    assert calibrate.search((5, 10), at) == 3.0 and tried == [5, 2.5, 3.5, 3.0]
    tried, at = machine(2.0)
    assert calibrate.search((5, 10), at) == 1.8 and tried == [5, 2.5, 1.25, 1.8, 2.1]
    tried, at = machine(0.5)
    assert calibrate.search((5, 10), at) == 0.0 and tried == [5, 2.5, 1.25]   # none
    tried, at = machine(13.0)          # a software CPU's 10-14.1 Mb/s: within ~20% of it
    assert calibrate.search((5, 10, 20), at) == 11.9 and tried == [5, 10, 20, 14.1, 11.9]


def test_calibration_goodput_is_the_steady_rate():
    t = [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.2]       # 0.2 s getting ready
    got = [0, 0, 100_000, 200_000, 300_000, 400_000, 500_000, 600_000, 700_000, 720_000]
    mbps = calibrate.steady_goodput_mbps({"t": t, "delivered": got}, 720_000, 1.2)
    assert abs(mbps - 8.0) < 0.01          # 100 KB per 0.1 s, not 720 KB in 1.2 s (4.8)
    assert calibrate.steady_goodput_mbps({"t": [0.0], "delivered": [0]}, 720_000, 1.2) == \
        720_000 * 8 / 1.2 / 1e6


def test_calibrate_measures_and_the_runner_uses_it(tmp_path):
    env = {**os.environ, paths.CALIBRATION_ENV: str(tmp_path / "calibration.json")}
    # rates even a software-CPU VM keeps up with (it does 5 Mb/s)
    # (and four pairs at once, at rates the lab VM keeps up with: ~1 Mb/s)
    r = fabriclab("calibrate", "--rates", "2,4", "--busy-rates", "0.25,0.5", env=env,
                  timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    c = json.loads((tmp_path / "calibration.json").read_text())
    assert c["keep_up_mbps"] == 4 and [s["keeps_up"] for s in c["sweep"]] == [True, True]
    assert all(s["goodput_mbps"] >= 0.8 * s["rate_mbps"] for s in c["sweep"]), c["sweep"]
    assert c["busy_keep_up_mbps"] == 0.5 and [s["keeps_up"] for s in c["busy_sweep"]] == \
        [True, True]
    assert all(0 < s["machine_busy"] < calibrate.MACHINE_BUSY_LIMIT for s in c["busy_sweep"])
    assert "keep up with 4 Mb/s" in r.stdout and "x0.08 with 2 hosts busy" in r.stdout
    assert "0.5 Mb/s with 8 busy at once" in r.stdout and "down to x0.05" in r.stdout
    # 4 Mb/s against the reference 50: the incast runs at 0.08 of its default rates
    out = tmp_path / "incast"
    r = fabriclab("run", "incast", "--set", "variants=none", "--set", "senders=2",
                  "--set", "none_time_limit_s=1", "--out", str(out), env=env, timeout=300)
    assert (out / "config.json").exists(), r.stdout + r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["machine_factor"] == 0.08
    assert config["topology"]["host_rate_mbps"] == 0.8 and config["rate_scale"]["factor"] == 125000
    assert config["params"]["flow_kb"] == 1200 and config["params"]["senders"] == 2
    assert "default link rates x0.08" in r.stdout


def test_a_step_near_its_limit_is_measured_again_and_a_kept_rate_holds_its_verdict():
    """The 8-pair sweep at 10 Mb/s read 80.2% busy against an 80% limit: one reading
    decided, so a quiet machine ran its defaults at x1.0, x0.84, x1.0 in three
    calibrations. Near the limit the step is read REPEATS times and the median
    decides; a rate the machine's last calibration kept up with is allowed HYSTERESIS
    over the limit; far from it, one reading does, and no hysteresis saves a rate the
    machine clearly cannot carry."""
    pairs = calibrate.BUSY_PAIRS

    def machine(*busy):
        readings = iter(busy)
        return lambda: {"goodput_mbps": 9.0, "machine_busy": next(readings),
                        "intact": True}
    ok, r = calibrate.decide(10.0, machine(0.802, 0.79, 0.81), pairs)
    assert r["readings"] == 3 and r["machine_busy"] == 0.802 and not ok
    ok, r = calibrate.decide(10.0, machine(0.802, 0.79, 0.78), pairs)
    assert r["readings"] == 3 and r["machine_busy"] == 0.79 and ok
    ok, r = calibrate.decide(10.0, machine(0.802, 0.83, 0.81), pairs, kept_before_mbps=10.0)
    assert ok and r["slack"] == calibrate.HYSTERESIS             # the last one kept 10
    ok, r = calibrate.decide(10.0, machine(0.60), pairs)
    assert ok and r["readings"] == 1
    ok, r = calibrate.decide(20.0, machine(0.95), pairs, kept_before_mbps=20.0)
    assert not ok and r["readings"] == 1                          # clearly over: no slack helps
    ok, _ = calibrate.decide(20.0, machine(0.81, 0.82, 0.83), pairs, kept_before_mbps=10.0)
    assert not ok                                   # above the kept rate: the plain limit
