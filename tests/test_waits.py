"""Why did the GPU wait: a phase's time split into causes (lab/experiments/waits.py). Pure."""
import pytest

from lab.experiments import waits
from lab.experiments.common import FRAME_BYTES


@pytest.fixture(autouse=True)
def no_lab_objects_left():
    """Overrides conftest's sweep of lab objects: this module creates none."""
    yield


def ev(**kw):
    base = {"paused_s": 0.0, "timeout_wait_s": 0.0, "resent_wire_s": 0.0}
    return {**base, **kw}


def test_a_phase_splits_in_order_and_adds_up_to_its_wall_time():
    parts = waits.split(1.0, 0.9, 0.3, ev(paused_s=0.2, timeout_wait_s=0.1, resent_wire_s=0.05))
    assert parts == {"agents": 0.1, "wire": 0.3, "paused": 0.2, "retransmission": 0.15,
                     "slow_path": 0.25}
    assert sum(parts.values()) == pytest.approx(1.0)


def test_each_cause_takes_at_most_what_is_left():
    # a pause longer than the phase (the NIC was paused past its end): capped, and
    # nothing is left for what comes after it
    parts = waits.split(0.5, 0.5, 0.2, ev(paused_s=2.0, timeout_wait_s=0.1))
    assert parts == {"agents": 0.0, "wire": 0.2, "paused": 0.3, "retransmission": 0.0,
                     "slow_path": 0.0}
    # faster than the wire (a bandwidth term from a rounded rate): all of it is wire
    assert waits.split(0.1, 0.1, 0.2, ev())["wire"] == 0.1


def test_evidence_takes_the_worst_gpu_for_times_and_sums_the_counts():
    counters = [{"rc:0x1": {"retransmitted": 10, "timeouts": 1, "timeout_wait_ms": 50.0,
                            "cnps_received": 3}},
                {"rc:0x2": {"retransmitted": 2, "timeout_wait_ms": 0.0},
                 "rc:0x3": {"retransmitted": 1, "cnps_received": 1}}]
    nics = [{"paused_s": [0.0, 0.0, 0.0, 0.25], "pause_frames_received": 7},
            {"paused_s": [0.1] * 8, "pause_frames_received": 2}]
    evs = [{}, {"0x3": [{"retirements": 1}, {"retirements": 2}]}]
    e = waits.evidence(counters, nics, evs, rate_mbps=10.0)
    assert e["paused_s"] == 0.25 and e["timeout_wait_s"] == 0.05
    assert e["resent_wire_s"] == round(10 * FRAME_BYTES * 8 / 10e6, 4)
    assert (e["pause_frames"], e["cnps"], e["retransmitted"], e["timeouts"],
            e["ev_retirements"]) == (9, 4, 13, 1, 3)


def test_messages_count_per_sender():
    flows = [{"src": "g0", "counters": {"retransmitted": 4}, "sender_nic": {"paused_s": [0.5]},
              "evs": None},
             {"src": "g0", "counters": {"retransmitted": 4}, "sender_nic": {"paused_s": [0.5]},
              "evs": None},
             {"src": "g1", "counters": {"retransmitted": 1}, "sender_nic": {"paused_s": [0.0]},
              "evs": [{"retirements": 1}]}]
    e = waits.flows_evidence(flows, rate_mbps=1.0)
    # g0 resent 8 (its two QPs), the worst sender; g0's NIC counted once
    assert e["resent_wire_s"] == round(8 * FRAME_BYTES * 8 / 1e6, 4)
    assert e["retransmitted"] == 9 and e["paused_s"] == 0.5 and e["ev_retirements"] == 1


def test_a_steps_causes_sum_its_phases_and_name_the_main_one():
    phases = [{"phase": "compute", "s": 0.4},
              {"causes": waits.split(0.3, 0.3, 0.1, ev(timeout_wait_s=0.15)),
               "evidence": {"retransmitted": 5, "timeouts": 1}},
              {"causes": waits.split(0.2, 0.2, 0.1, ev()), "evidence": {"cnps": 2}}]
    t = waits.total(phases)
    assert t["causes"]["retransmission"] == 0.15 and t["causes"]["slow_path"] == pytest.approx(0.15)
    assert t["evidence"]["retransmitted"] == 5 and t["evidence"]["cnps"] == 2
    assert waits.main_cause({"wire": 1.0, "retransmission": 0.2, "slow_path": 0.1}) == \
        "retransmission"
    assert waits.main_cause({"wire": 1.0}) == "none"
