"""Every claim can fail (issue 42): an experiment's claims, fed the measurements of a run
whose mechanism was broken, fail; fed those of a run where it worked, hold. Pure: the
claims are functions of the metrics (lab/experiments/base.py), so no fabric is needed.
(training-step's ECN claim and the excuses: tests/test_report.py.)"""
from lab.experiments import kv_cache, plane_failure, training_job


def _named(claims, words: str):
    [c] = [c for c in claims if words in c.name]
    return c


# --- kv-cache: the training beside the KV caches must have run -------------------------
def _kv(**beside) -> dict:
    alone = {"intact": True, "latency_s_p50": 0.1}
    shared = {"intact": True, "latency_s_p50": 0.2, "training_allreduces": 3,
              "training_correct": True, **beside}
    return {"alone": alone, "shared": shared, "express": {**shared, "latency_s_p50": 0.11}}


def test_kv_cache_fails_where_the_training_it_shares_the_fabric_with_never_ran():
    params = kv_cache.Params()
    held = _named(kv_cache.claims(params, _kv()), "arrived intact")
    assert held.passed
    for broken in ({"training_allreduces": 0},                        # none finished
                   {"training_correct": False},                       # one missed the mean
                   {"training_allreduces": 0, "training_correct": True}):
        claim = _named(kv_cache.claims(params, _kv(**broken)), "arrived intact")
        assert not claim.passed, broken
    # and it says so: what it measured shows that no training all-reduce finished
    none = _named(kv_cache.claims(params, _kv(training_allreduces=0)), "arrived intact")
    assert none.measured["shared"]["training_allreduces"] == 0, none.measured
    # a variant without the training's fields at all is not taken as having held
    m = _kv()
    del m["shared"]["training_allreduces"], m["shared"]["training_correct"]
    assert not _named(kv_cache.claims(params, m), "arrived intact").passed


# --- training-job: the checkpoint is written whole, or its claims fail ------------------
def _job(checkpoint: dict) -> dict:
    def steps(dp_s: list[float], ckpt_step: int | None) -> list[dict]:
        return [{"checkpoint": i == ckpt_step, "phases": [{"phase": "dp", "s": s}]}
                for i, s in enumerate(dp_s)]
    variant = {"all_correct": True, "step_s_mean": 1.0, "idle_fraction_mean": 0.5}
    return {"tp-in-rack": {**variant, "steps": steps([0.2, 0.2, 0.2], None)},
            "checkpoint": {**variant, "steps": steps([0.2, 0.5, 0.2], 1),
                           "checkpoint": {"step": 1, "writers": ["g0", "g1"],
                                          "storage": ["g8"], **checkpoint}}}


def test_training_job_fails_a_checkpoint_that_was_not_written_whole():
    params = training_job.Params(variants="tp-in-rack,checkpoint")
    whole = {"time_s": 0.4, "intact": True, "bytes": 2 * params.checkpoint_kb * 1024}
    claims = training_job.claims(params, _job(whole))
    assert _named(claims, "shard reached storage").passed
    assert _named(claims, "slows it").passed
    short = training_job.claims(params, _job({**whole, "bytes": whole["bytes"] - 1024}))
    assert not _named(short, "shard reached storage").passed
    corrupt = training_job.claims(params, _job({**whole, "intact": False}))
    assert not _named(corrupt, "shard reached storage").passed
    # the write failed: both checkpoint claims fail (before, the slowdown claim vanished)
    failed = training_job.claims(params, _job({"error": "GPU agent on g0 did not answer"}))
    integrity, slowdown = _named(failed, "shard reached storage"), _named(failed, "slows it")
    assert not integrity.passed and "the write failed" in integrity.measured
    assert not slowdown.passed and slowdown.measured == "no checkpoint was written"


def test_the_checkpoint_counts_the_bytes_storage_received_not_the_sizes_asked():
    """The claim above compares `bytes` with every shard's size: it must be what the
    storage hosts' QPs placed (it was the sizes asked for, equal whatever arrived)."""
    class Agents:          # the write's flows: one whole, one that stopped 1 KB short
        def transfers(self, flows, *args, **kw):
            return [{"bytes": n, "intact": cut == 0 or None,
                     "receiver_counters": {"bytes_delivered": n - cut}}
                    for (_, _, n), cut in zip(flows, (0, 1024))]
    ckpt = object.__new__(training_job.Checkpoint)     # no agents: only its _write
    ckpt.flows = [("g0", "g8", 4096), ("g2", "g9", 4096)]
    ckpt.gpus, ckpt.rc, ckpt.timeout_s, ckpt.result, ckpt.error = Agents(), {}, 1.0, None, None
    ckpt._write()
    assert ckpt.error is None and ckpt.result["bytes"] == 2 * 4096 - 1024, ckpt.result


# --- plane-failure: spraying over the planes is what is claimed -------------------------
def _planes(mrc_before: dict) -> dict:
    run = {"intact": True, "stall_s": 0.1, "rate_before_Bps": 100.0,
           "rate_outage_Bps": 50.0, "evs_retired": {"0": 4, "1": 0}}
    return {"planes": 2,
            "rc": {**run, "plane_bytes_before": {"0": 1000, "1": 0}, "stall_s": 1.0},
            "mrc": {**run, "plane_bytes_before": mrc_before}}


def test_plane_failure_fails_where_mrc_keeps_to_one_plane():
    params = plane_failure.Params()
    spread = _named(plane_failure.claims(params, _planes({"0": 500, "1": 500})),
                    "spreads over every plane")
    assert spread.passed
    one = _named(plane_failure.claims(params, _planes({"0": 1000, "1": 0})),
                 "spreads over every plane")
    assert not one.passed
