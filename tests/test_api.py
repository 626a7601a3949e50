"""The Python API (lab/api.py), its pytest fixture and the example scripts."""
import json
import subprocess
import sys

import pytest

from conftest import REPO
from lab.api import Lab
from lab.core.errors import LabError


def run_example(name: str, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "examples" / name), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


def test_example_allreduce_values_every_host_holds_the_mean(tmp_path):
    r = run_example("allreduce_values.py", tmp_path / "ex")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("holds 0.75") == 4, r.stdout
    result = json.loads((tmp_path / "ex" / "metrics.json").read_text())
    assert len(result["claims"]) == 3 and result["passed"], result["claims"]
    assert result["metrics"]["ring"]["busbw_mbps"] > 0
    assert (tmp_path / "ex" / "report.html").read_text().count("class=pass") == 3


def test_example_incast_credits_measures_drops_at_the_switch(tmp_path):
    r = run_example("incast_credits.py", tmp_path / "ex")
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads((tmp_path / "ex" / "metrics.json").read_text())
    assert m["metrics"]["rc"]["switch_drops_packets"] > 0   # RC without ECN overflows the port
    assert all(c["passed"] for c in m["claims"]), m["claims"]


@pytest.mark.fabric("leaf-spine", spines=1, leaves=2, hosts_per_leaf=1)
def test_the_fixture_gives_a_running_lab_whose_telemetry_sees_the_traffic(fabric_lab):
    assert fabric_lab.hosts == ["g0", "g1"]
    flows = fabric_lab.transfers([("g0", "g1", 100_000)], transport="mrc")
    assert flows[0]["intact"]
    import time
    time.sleep(0.1)
    sent = sum(q["sent_packets"] for q in fabric_lab.queue_stats().values())
    assert sent >= 100_000 // 1024      # the switch queues carried at least the data


def test_the_api_says_what_is_wrong():
    with pytest.raises(LabError, match="spines"):
        Lab("leaf-spine", spines=0)
    with pytest.raises(LabError, match="inside `with Lab"):
        Lab("leaf-spine").incast("g0", 1000)


def test_moe_dispatch_alltoallv_and_a_pipeline_step_deliver_every_byte(tmp_path, factor_for):
    """All-to-all with unequal sizes (tokens routed to experts: some pairs send a lot,
    some nothing) and one pipeline step (each stage's activations to the next): every
    message intact, none where the size is 0. 10 Mb/s links here; four hosts sending
    and receiving at once: slower where they would starve (the machine's calibration)."""
    mbps = 10 * factor_for(8)
    with Lab("leaf-spine", out=tmp_path / "lab", spines=2, leaves=2, hosts_per_leaf=2,
             host_rate_mbps=mbps, fabric_rate_mbps=mbps) as fabric_lab:
        sizes = {"g0": {"g1": 40_000, "g2": 0, "g3": 120_000},
                 "g1": {"g0": 8_000, "g2": 64_000},
                 "g2": {"g3": 1_000},
                 "g3": {"g0": 200_000, "g1": 5_000, "g2": 30_000}}
        a2a = fabric_lab.alltoallv(sizes, transport="mrc")
        got = {(f["src"], f["dst"]): f["bytes"] for f in a2a["flows"]}
        assert got == {(a, b): n for a, row in sizes.items() for b, n in row.items() if n}
        assert a2a["intact"] and a2a["size_bytes"] == 235_000      # g3's three messages
        # busbw = algbw x 3/4; the busiest link (g0's, in: 208 KB) bounds it under the line
        assert 0 < a2a["busbw_mbps"] < mbps
        stages = fabric_lab.hosts                       # pipeline: stage i -> stage i+1
        forward = fabric_lab.pipeline_step(stages, 64_000)
        backward = fabric_lab.pipeline_step(stages, 64_000, backward=True)
        assert [(f["src"], f["dst"]) for f in forward["flows"]] == list(zip(stages, stages[1:]))
        assert [(f["src"], f["dst"]) for f in backward["flows"]] == list(zip(stages[1:], stages))
        assert forward["intact"] and backward["intact"]
        assert 0.5 * mbps < forward["busbw_mbps"] < mbps     # each link one message: near the line
        with pytest.raises(LabError, match="does not have"):
            fabric_lab.alltoallv({"g0": {"g9": 10}})
