"""ECN mode 'red': the kernel's RED marks the switches' RoCE class, and DCQCN reacts.

Needs sch_red (the lab VM, a Vagrant VM); module-less kernels run the same
incast with the controller's marking instead (tests/test_congestion.py)."""
import json

import pytest

from conftest import fabriclab
from lab.experiments.incast import FRAME_BYTES

pytestmark = pytest.mark.kernel


def test_red_marks_the_roce_class_and_dcqcn_reacts(tmp_path):
    out = tmp_path / "incast-red"
    # 5 Mb/s links: a software CPU keeps four senders at line rate
    r = fabriclab("run", "incast", "--set", "variants=ecn", "--set", "ecn=red",
                  "--set", "senders=4", "--set", "hosts_per_leaf=5", "--set", "flow_kb=120",
                  "--set", "host_rate_mbps=5", "--set", "fabric_rate_mbps=5",
                  "--out", str(out), timeout=900)
    m = json.loads((out / "metrics.json").read_text())
    ecn = m["metrics"]["ecn"]
    print(r.stdout)
    assert ecn["ecn_mode"] == "red"
    assert ecn["ce_marked_packets"] > 0, "RED marked nothing"   # the red qdisc's own counter
    assert ecn["cnp_packets"] > 0, "receivers sent no CNPs"
    assert ecn["all_intact"]
    # DCQCN reacted: four senders starting at line rate into one port together sent no
    # more than the port drains once settled (without a reaction they send ~3-4x that:
    # 3570 vs 1155 packets/s measured at 10 Mb/s with the controller's marking)
    link_pps = 5e6 / (FRAME_BYTES * 8)
    sent_pps = sum(ecn["sender_rates_pps"].values())
    assert len(ecn["sender_rates_pps"]) == 4 and sent_pps <= 1.25 * link_pps, (sent_pps, link_pps)
