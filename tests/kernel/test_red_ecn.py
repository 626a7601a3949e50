"""ECN mode 'red': the kernel's RED marks the switches' RoCE class, and DCQCN reacts;
and the BPF data path's marking (mode 'bpf', what module-less kernels use) behaves as
kernel RED does on the same traffic.

Needs sch_red (the lab VM, a Vagrant VM)."""
import json

import numpy as np
import pytest

import wire
from conftest import fabriclab
from lab.experiments.common import FRAME_BYTES
from lab.fabric.congestion import CongestionParams
from lab.kernel import queues

pytestmark = pytest.mark.kernel


def incast_ecn(out, mode: str, *more: str) -> dict:
    # 5 Mb/s links: a software CPU keeps four senders at line rate. The flows keep
    # incast's default size: DCQCN settles in a number of packets (lab/experiments/
    # incast.py); with 120 KB each a run was mostly its start, and in the lab VM one
    # ended with the senders at 1.36x the port and the backlog above Kmax
    r = fabriclab("run", "incast", "--set", "variants=ecn", "--set", f"ecn={mode}",
                  "--set", "senders=4", "--set", "hosts_per_leaf=5",
                  "--set", "host_rate_mbps=5", "--set", "fabric_rate_mbps=5", *more,
                  "--out", str(out), timeout=900)
    print(r.stdout)
    assert r.returncode == 0 or (out / "metrics.json").exists(), r.stdout + r.stderr
    ecn = json.loads((out / "metrics.json").read_text())["metrics"]["ecn"]
    assert ecn["ecn_mode"] == mode, r.stdout + r.stderr
    return ecn


def wire_curve(out, ecn: dict) -> tuple[np.ndarray, np.ndarray]:
    """The bottleneck's marking as captured (wire.marking_curve), in CURVE_EDGES."""
    cap = wire.RunCaptures(out)
    recv = cap.fabric.host(cap.metrics["receiver"]).interface()
    port = cap.host_port(cap.metrics["receiver"])
    assert not cap.tcpdump_dropped([port])
    ce = [f.t for f in cap.frames[port] if f.roce_data and f.dst == recv.ip and f.ecn == 3]
    return wire.marking_curve(wire.queue_looks(out / "queues.csv", ecn["bottleneck"]), ce,
                              ecn["counted_unix_s"], queues.red_wlog(KMIN, KMAX), CURVE_EDGES)


# RED's curve, in bins of the average backlog: below Kmin, Kmin..Kmax in thirds, above.
# Bytes within KMAX_GUARD of Kmax are left out: the estimated average is off by about a
# packet, and there the curve jumps from Pmax to all marked, so a bin beside Kmax holds
# as much of the other side as the run's backlog happens to put there (measured 1 KB
# either side: 0.38-0.57 marked, red and bpf alike; above 18 KB 0.97-1.0)
KMIN, KMAX = CongestionParams.kmin_kb * 1024, CongestionParams.kmax_kb * 1024
KMAX_GUARD = 2048
CURVE_EDGES = [0, KMIN, KMIN + (KMAX - KMIN) / 3, KMIN + 2 * (KMAX - KMIN) / 3,
               KMAX - KMAX_GUARD, KMAX + KMAX_GUARD, 1e9]
GUARD_BIN = 4
# a bin is compared when both runs sent this many packets from it...
CURVE_MIN_PACKETS = 200
# ...and their marked fractions may differ by this much, plus 3 standard errors of two
# binomial counts (measured over 3 pairs of runs: at most 0.038 apart)
CURVE_TOLERANCE = 0.05
# Kmin..Kmax as one, weighted alike (3 pairs measured: 0.002, 0.008, 0.025 apart;
# 3 standard errors 0.03)
MID_TOLERANCE = 0.02


def test_bpf_marking_follows_kernel_red(tmp_path):
    """Both run RED's algorithm (the same average weight, Kmin, Kmax, Pmax) under the
    same DCQCN senders. The loop settles differently run to run (DCQCN's own spread: the
    backlog's median moved between 1 and 10 KB over runs of either), so what is
    compared is the marking itself: the share of packets marked against RED's average
    backlog when they entered, counted on the wire (the receiver's port captured), each
    run on its own traffic."""
    curves = {}
    for mode in ("red", "bpf"):
        out = tmp_path / mode
        curves[mode] = wire_curve(out, incast_ecn(out, mode, "--capture", "g0"))
    (n_red, m_red), (n_bpf, m_bpf) = curves["red"], curves["bpf"]
    f_red, f_bpf = m_red / np.maximum(n_red, 1), m_bpf / np.maximum(n_bpf, 1)
    top = len(n_red) - 1
    table = [f"{lo / 1024:4.1f}-{f'{hi / 1024:4.1f}' if i < top else '':4} KB: "
             f"red {f_red[i]:.3f} of {n_red[i]}, bpf {f_bpf[i]:.3f} of {n_bpf[i]}"
             + (" (not compared)" if i == GUARD_BIN else "")
             for i, (lo, hi) in enumerate(zip(CURVE_EDGES, CURVE_EDGES[1:]))]
    print("\n".join(table))
    compared = [i for i in range(len(n_red)) if i != GUARD_BIN
                and min(n_red[i], n_bpf[i]) >= CURVE_MIN_PACKETS]
    # below Kmin and above Kmax, where the curve is flat, are always reached
    assert {0, top} <= set(compared), table
    for i in compared:
        # (a captured frame is numbered by interpolation: two may share a number, so a
        # bin's marks can pass its packets by one or two)
        f = min(1.0, (m_red[i] + m_bpf[i]) / (n_red[i] + n_bpf[i]))
        se = np.sqrt(f * (1 - f) * (1 / n_red[i] + 1 / n_bpf[i]))
        assert abs(f_red[i] - f_bpf[i]) <= CURVE_TOLERANCE + 3 * se, table[i]
    # Kmin..Kmax as one: each run's marked share in its bins, weighted alike (by both
    # runs' packets there). The bins alone hold too few packets to tell 0.17 from 0.085;
    # together (~0.10 measured, tolerance ~0.05) a Pmax twice as large fails, half as
    # large just about
    mid = [i for i in compared if 0 < i < GUARD_BIN]
    w = (n_red[mid] + n_bpf[mid]) / (n_red[mid] + n_bpf[mid]).sum()
    f = np.clip((m_red[mid] + m_bpf[mid]) / (n_red[mid] + n_bpf[mid]), 0, 1)
    se = np.sqrt((w ** 2 * f * (1 - f) * (1 / n_red[mid] + 1 / n_bpf[mid])).sum())
    red_mid, bpf_mid = (w * f_red[mid]).sum(), (w * f_bpf[mid]).sum()
    assert abs(red_mid - bpf_mid) <= MID_TOLERANCE + 3 * se, (red_mid, bpf_mid, se, table)
    # and it is RED's curve: rising through Kmin..Kmax, nearly all marked above Kmax
    assert f_bpf[0] < f_bpf[2] < f_bpf[top] and f_red[0] < f_red[2] < f_red[top], table


def test_red_marks_the_roce_class_and_dcqcn_reacts(tmp_path):
    ecn = incast_ecn(tmp_path / "incast-red", "red")
    assert ecn["ce_marked_packets"] > 0, "RED marked nothing"   # the red qdisc's own counter
    assert ecn["cnp_packets"] > 0, "receivers sent no CNPs"
    assert ecn["all_intact"]
    # DCQCN reacted: four senders starting at line rate into one port together sent no
    # more than the port drains once settled (without a reaction they send ~3-4x that:
    # 3570 vs 1155 packets/s measured at 10 Mb/s with the controller's marking)
    link_pps = 5e6 / (FRAME_BYTES * 8)
    sent_pps = sum(ecn["sender_rates_pps"].values())
    assert len(ecn["sender_rates_pps"]) == 4 and sent_pps <= 1.25 * link_pps, (sent_pps, link_pps)
