"""`fabriclab inspect` on captures built for each rule, broken and kept: the violation
named with its frame, nothing where the rule holds; and the per-flow counts. (On the
lab's own captures: tests/test_trimming.py.) No root, no fabric: Scapy writes pcaps."""
import json
import shutil

import pytest
from scapy.layers.inet import ICMP, IP
from scapy.layers.l2 import Ether
from scapy.utils import wrpcap

from conftest import fabriclab
from lab import inspect
from lab.experiments.base import capture_plan, topology_defaults
from lab.fabric.capture import resolve
from lab.runner import load
from lab.tour import CAPTURE_SNAPLEN
from topologies.registry import build_topo
from traffic.constants import PRIORITY_ROCE_DATA, Ecn
from traffic.packets import (Endpoints, ack, cnp, mrc_credit_request, mrc_data, mrc_nack,
                             mrc_probe, mrc_sack, nak_seq_error, pause_8023x, pfc_pause,
                             pfc_resume, rc_write_packets, trimmed)

pytestmark = pytest.mark.skipif(shutil.which("tshark") is None,
                                reason="tshark is installed by make setup")
A = Endpoints(src_mac="02:fa:00:00:00:01", dst_mac="02:fa:00:00:00:02", src_ip="10.1.0.1",
              dst_ip="10.1.0.2", src_port=0xC001)
B = Endpoints(src_mac="02:fa:00:00:00:02", dst_mac="02:fa:00:00:00:01", src_ip="10.1.0.2",
              dst_ip="10.1.0.1", src_port=0xC002)
SWITCH = "02:fc:00:01:00:01"     # a switch port's MAC, pausing host A


def capture(tmp_path, timed):
    """(time s, frame) pairs -> a pcap."""
    frames = []
    for t, f in timed:
        f.time = 1000.0 + t
        frames.append(f)
    path = tmp_path / "c.pcap"
    wrpcap(str(path), frames)
    return path


def rc_write(psn, endpoints=A):
    [f] = rc_write_packets(bytes(1024), dst_qp=0x22, psn=psn, va=0, rkey=1,
                           endpoints=endpoints)
    return f


def report(path, **settings):
    return inspect.inspect(path, inspect.Settings(**settings))


def rules(r):
    return [(v["frame"], v["rule"]) for v in r["violations"]]


def test_rc_must_go_back_to_the_psn_its_nak_names(tmp_path):
    kept = capture(tmp_path, [(0.0, rc_write(1)), (0.001, rc_write(2)), (0.002, rc_write(4)),
                              (0.003, nak_seq_error(3, 0, dst_qp=0x11, endpoints=B)),
                              (0.004, rc_write(3)), (0.005, rc_write(4)),
                              (0.006, ack(4, 1, dst_qp=0x11, endpoints=B))])
    r = report(kept)
    assert rules(r) == []
    [flow] = r["flows"]
    assert (flow["transport"], flow["packets"], flow["retransmitted"], flow["reordered"],
            flow["naks"], flow["acks"]) == ("rc", 5, 1, 1, 1, 1)
    broken = capture(tmp_path, [(0.0, rc_write(1)), (0.001, rc_write(4)),
                                (0.002, nak_seq_error(2, 0, dst_qp=0x11, endpoints=B)),
                                (0.003, rc_write(5))])
    assert rules(report(broken)) == [(3, "rc-go-back-n")]


def mrc(psn, ev):
    return mrc_data(bytes(1024), dst_qp=0x22, psn=psn, ev=ev, va=0, rkey=1, message_id=1,
                    packets_in_message=8, endpoints=A)


def test_mrc_resends_only_what_no_sack_acknowledged(tmp_path):
    sack = mrc_sack(11, dst_qp=0x11, ev=0xD001, credit_psn=100, received_psns=[12],
                    endpoints=B)                  # 10 arrived; 11 missing; 12 arrived
    kept = capture(tmp_path, [(0.0, mrc(10, 0xD001)), (0.001, mrc(11, 0xD002)),
                              (0.002, mrc(12, 0xD003)), (0.003, sack),
                              (0.004, trimmed(mrc(11, 0xD004))),
                              (0.005, mrc_nack(11, dst_qp=0x11, ev=0xD004, endpoints=B)),
                              (0.006, mrc(11, 0xD001))])
    r = report(kept)
    assert rules(r) == []
    [flow] = r["flows"]
    assert (flow["transport"], flow["evs"], flow["trimmed"], flow["sacks"], flow["nacks"],
            flow["retransmitted"]) == ("mrc", 4, 1, 1, 1, 2)
    broken = capture(tmp_path, [(0.0, mrc(10, 0xD001)), (0.001, mrc(11, 0xD002)),
                                (0.002, mrc(12, 0xD003)), (0.003, sack),
                                (0.010, mrc(12, 0xD004))])      # 12 had been acknowledged
    assert rules(report(broken)) == [(5, "mrc-resend")]
    # 2 ms after the SACK passed the capture (its way into the host, the host's reaction):
    # not yet a violation; nor from a sender the capture is not next to
    assert rules(report(broken, reaction_grace_ms=8.0)) == []
    assert rules(report(broken, near=(B.src_ip,))) == []


def test_a_run_on_a_slower_machine_stretches_the_reaction_grace(tmp_path):
    """A capture in a run's captures/ takes the machine's factor: the hosts there react
    that much slower (x0.25: 8 ms), as the runner stretches the run's times."""
    run = tmp_path / "run"
    (run / "captures").mkdir(parents=True)
    build_topo("leaf-spine", spines=1, leaves=2, hosts_per_leaf=1).fabric.save(
        run / "fabric.json")
    pcap = run / "captures" / "fl-lf0-eth1.pcap"
    for factor, grace_ms in ((1.0, 2.0), (0.25, 8.0)):
        (run / "metrics.json").write_text(json.dumps({"machine_factor": factor,
                                                      "metrics": {}}))
        assert inspect.settings_of_run(pcap).reaction_grace_ms == grace_ms


def test_a_paused_end_sends_nothing_of_that_priority_until_the_pause_ends(tmp_path):
    # at 10 Mb/s a quantum is 51.2 us: 1000 quanta hold the priority 51.2 ms
    xoff = pfc_pause({PRIORITY_ROCE_DATA: 1000}, src_mac=SWITCH)
    timed = [(0.0, xoff), (0.001, rc_write(1)),          # in flight: within the grace
             (0.010, rc_write(2)),                        # paused: a violation
             (0.011, ack(1, 0, dst_qp=0x11, endpoints=B)),   # the other end: not paused
             (0.060, rc_write(3)),                        # after 51.2 ms: free again
             (0.070, pfc_pause({PRIORITY_ROCE_DATA: 1000}, src_mac=SWITCH)),
             (0.075, pfc_resume([PRIORITY_ROCE_DATA], src_mac=SWITCH)),
             (0.080, rc_write(4))]                        # resumed by the XON
    path = capture(tmp_path, timed)
    r = report(path, rate_mbps=10.0, reaction_grace_ms=2.0,
               paused_macs={SWITCH: A.src_mac})
    assert rules(r) == [(3, "pfc-paused-sends")]
    assert r["pfc"] == {SWITCH: {str(PRIORITY_ROCE_DATA): {"xoff": 2, "xon": 1}}}
    assert rules(report(path)) == []      # without the link's rate: not checked
    # without a map of MACs, every MAC but the pausing one is the paused end
    assert rules(report(path, rate_mbps=10.0)) == [(3, "pfc-paused-sends"),
                                                   (4, "pfc-paused-sends")]


def test_cnps_to_a_qp_keep_dcqcns_interval(tmp_path):
    timed = [(0.0, cnp(0x11, endpoints=B)), (0.005, cnp(0x11, endpoints=B)),
             (0.006, cnp(0x12, endpoints=B)), (0.007, cnp(0x11, endpoints=B))]
    path = capture(tmp_path, timed)
    assert rules(report(path, cnp_interval_ms=4.0)) == [(4, "cnp-interval")]
    assert rules(report(path)) == []      # DCQCN's own 50 us: every gap is longer


def test_the_cli_exits_1_on_a_violation_and_says_which(tmp_path):
    path = capture(tmp_path, [(0.0, cnp(0x11, endpoints=B)), (0.001, cnp(0x11, endpoints=B))])
    r = fabriclab("inspect", str(path), "--cnp-interval-ms", "4", timeout=60)
    assert r.returncode == 1 and "frame 2: cnp-interval" in r.stdout, r.stdout + r.stderr
    r = fabriclab("inspect", str(path), timeout=60)
    assert r.returncode == 0 and "0 violation(s)" in r.stdout, r.stdout + r.stderr
    r = fabriclab("inspect", str(tmp_path / "none.pcap"), timeout=60)
    assert r.returncode == 2 and "no capture" in r.stderr


def ce_marked(frame):
    """`frame` as a switch's ECN marking forwards it: CE, its IP checksum redone."""
    marked = frame.copy()
    marked[IP].tos |= Ecn.CE
    del marked[IP].chksum
    return Ether(bytes(marked))


def headers_only(frame):
    """`frame` as a capture at the tour's snaplen keeps it: its first CAPTURE_SNAPLEN
    bytes, its length on the wire."""
    cut = Ether(bytes(frame)[:CAPTURE_SNAPLEN])
    cut.wirelen = len(frame)
    return cut


def rc_recovery():
    """RC's go-back-N: PSN 3 lost, NAKed, sent again with what followed it."""
    return [rc_write(1), rc_write(2), rc_write(4), nak_seq_error(3, 0, dst_qp=0x11, endpoints=B),
            rc_write(3), rc_write(4), ack(4, 1, dst_qp=0x11, endpoints=B)]


def mrc_recovery():
    """MRC's selective repeat, sprayed: PSN 11 lost, SACKed around, sent again."""
    return [mrc(10, 0xD001), mrc(11, 0xD002), mrc(12, 0xD003),
            mrc_sack(11, dst_qp=0x11, ev=0xD003, credit_psn=100, received_psns=[12],
                     endpoints=B), mrc(11, 0xD004)]


def congestion():
    """A congested port: CE marks, the CNP they bring back, PFC and 802.3x pauses, and
    the credit requests of RCCC's variants."""
    return [ce_marked(rc_write(1)), cnp(0x11, endpoints=B),
            pfc_pause({PRIORITY_ROCE_DATA: 1000}, src_mac=SWITCH), rc_write(2),
            pfc_resume([PRIORITY_ROCE_DATA], src_mac=SWITCH),
            pause_8023x(256, src_mac=SWITCH), ack(2, 1, dst_qp=0x11, endpoints=B),
            mrc_credit_request(20, dst_qp=0x22, ev=0xD001, backlog_bytes=8192, endpoints=A)]


def trimming():
    """A trimming switch: PSN 11 trimmed to its headers, NACKed, sent again."""
    return [mrc(10, 0xD001), trimmed(mrc(11, 0xD002)), mrc(12, 0xD003),
            mrc_nack(11, dst_qp=0x11, ev=0xD002, endpoints=B),
            mrc_sack(11, dst_qp=0x11, ev=0xD003, credit_psn=100, received_psns=[12],
                     endpoints=B), mrc(11, 0xD001)]


def probes():
    """An EV assumed bad, probed out of band, and the receiver's answer on it."""
    return [mrc(10, 0xD001), mrc_probe(1, dst_qp=0x22, ev=0xD002, endpoints=A),
            mrc_probe(1, dst_qp=0x11, ev=0xD002, reply=True, endpoints=B), mrc(11, 0xD002)]


def pings():
    """reachability's echo requests and replies: no RoCE at all."""
    return [Ether(src=A.src_mac, dst=A.dst_mac) / IP(src=A.src_ip, dst=A.dst_ip) / ICMP(),
            Ether(src=B.src_mac, dst=B.dst_mac) / IP(src=B.src_ip, dst=B.dst_ip)
            / ICMP(type="echo-reply")]


def every_kind_headers_only():
    return [headers_only(f) for f in rc_recovery() + mrc_recovery() + congestion()
            + trimming() + probes() + pings()]


def strict_json(text: str):
    """JSON as its standard has it: Python's json also reads and writes NaN and
    Infinity, which no other parser does."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


# Each kind of experiment traffic, as a run's capture holds it: (the experiment whose
# fabric and captured port it takes, its frames). The others send the same kinds:
# allreduce, training-step and kv-cache RC's and MRC's as loss-recovery; pfc-spreading
# an incast's; link-failure plane-failure's probes; training-job rack-vs-scaleout's;
# softroce RC's (rxe's own capture). The tour keeps every frame's headers only.
TRAFFIC = [
    pytest.param("loss-recovery", lambda: rc_recovery() + mrc_recovery(), id="loss-recovery"),
    pytest.param("incast", congestion, id="incast"),
    pytest.param("trimming", trimming, id="trimming"),
    pytest.param("ecmp-vs-spray", lambda: rc_recovery() + mrc_recovery(), id="ecmp-vs-spray"),
    pytest.param("plane-failure", probes, id="plane-failure"),
    pytest.param("rack-vs-scaleout", rc_recovery, id="rack-vs-scaleout"),
    pytest.param("reachability", pings, id="reachability"),
    pytest.param("loss-recovery", every_kind_headers_only, id="tour"),
]


@pytest.mark.parametrize("experiment, frames", TRAFFIC)
def test_inspect_json_is_json_on_every_kind_of_experiment_traffic(tmp_path, experiment,
                                                                  frames):
    """`inspect --json` on a capture in a run's captures/, at the port its experiment
    captures (a GPU's for those that name none, as `--capture g0`), where it takes the
    run's settings: a host's port knows the link's ends (one IP per plane the host is
    on), a switch's uplink (ecmp-vs-spray's) does not. A host's port once ended in
    "Object of type set is not JSON serializable"."""
    mod = load(experiment)
    topology = mod.Params().topology
    fabric = build_topo(topology, **topology_defaults(mod, topology)).fabric
    plan = capture_plan(mod, fabric, mod.Params())
    spec = plan.ports[0] if plan.ports else fabric.hosts[0].name
    [port] = resolve(fabric, spec)
    run = tmp_path / "run"
    (run / "captures").mkdir(parents=True)
    fabric.save(run / "fabric.json")
    (run / "metrics.json").write_text(json.dumps({"machine_factor": 1.0, "metrics": {}}))
    timed = [(i * 1e-3, f) for i, f in enumerate(frames())]
    pcap = capture(run / "captures", timed).rename(run / "captures" / f"{port}.pcap")
    r = fabriclab("inspect", "--json", str(pcap), timeout=120)
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    report = strict_json(r.stdout)
    assert report["frames"] == len(timed), report
    hosts = {h.name: h for h in fabric.hosts}
    near = sorted(i.ip for i in hosts[spec].interfaces) if spec in hosts else None
    assert report["settings"]["near"] == near, report
