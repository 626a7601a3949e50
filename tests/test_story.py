"""The story experiments at small size: the GPUs wait on the network, and the fixes help."""
import json

from conftest import fabriclab


def test_training_step_idle_rises_under_incast_and_the_report_shows_it(tmp_path):
    out = tmp_path / "train"
    r = fabriclab("run", "training-step", "--set", "steps=3", "--set", "grad_kb=64",
                  "--set", "compute_ms=100", "--set", "variants=clean,incast",
                  "--out", str(out), timeout=600)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    m = json.loads((out / "metrics.json").read_text())["metrics"]
    clean, incast = m["clean"], m["incast"]
    assert clean["all_correct"] and incast["all_correct"], r.stdout
    assert len(clean["steps"]) == 3 and all(s["step_s"] >= 0.1 for s in clean["steps"])
    # waiting on the network: at least the all-reduce's bandwidth term, more under incast
    assert clean["allreduce_s_mean"] >= m["model_allreduce_s"]
    assert incast["idle_fraction_mean"] > clean["idle_fraction_mean"], r.stdout
    assert incast["background_rounds"] >= 1 and incast["background_error"] is None
    md = (out / "report.md").read_text()
    assert "plots/step_breakdown.png" in md and (out / "plots" / "step_breakdown.png").exists()
