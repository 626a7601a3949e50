"""The softroce experiment at small size: real RoCE (rxe) and the lab's RC over the
same path, clean and at 4% loss. The physics: both recover by go-back-N, so both
resend more than the link lost and retransmissions grow with loss; the lab's RC
delivers its data intact. (How closely the two agree is reported, not asserted.)"""
import json

import pytest

from conftest import fabriclab

pytestmark = pytest.mark.kernel


def test_softroce_experiment_go_back_n_in_both(tmp_path):
    out = tmp_path / "softroce"
    # 48 x 4 KB = 192 packets: ~8 lost at 4%, a few seconds at 10 Mb/s under TCG
    r = fabriclab("run", "softroce", "--set", "loss_percents=0,4", "--set", "messages=48",
                  "--out", str(out), timeout=900)
    print(r.stdout, r.stderr[-2000:])
    m = json.loads((out / "metrics.json").read_text())
    lab, rxe = m["metrics"]["lab_rc"], m["metrics"]["rxe"]
    print(json.dumps(m["metrics"]["side_by_side"], indent=1))
    clean, lossy = "loss_0pct", "loss_4pct"
    for name, t in (("lab RC", lab), ("rxe", rxe)):
        assert t[clean]["lost_packets"] == 0 and t[lossy]["lost_packets"] > 0, name
        assert t[lossy]["retransmitted"] > t[lossy]["lost_packets"], f"{name}: not go-back-N"
        assert t[lossy]["retransmitted"] > t[clean]["retransmitted"], name
        assert t[lossy]["distinct_psns"] == 192 and t[lossy]["payload_bytes"] == 48 * 4096, \
            f"{name}: the capture does not hold the whole transfer"
        assert t[clean]["goodput_mbps"] and t[lossy]["goodput_mbps"], name
    assert lab[clean]["intact"] and lab[lossy]["intact"]
    assert r.returncode == 0, [c for c in m["claims"] if not c["passed"]]
