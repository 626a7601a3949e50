"""Reports a person reads: claims as text, the queue plot per variant, and the pages in a
real browser at a laptop's width. Built from a fabricated incast run (no lab: pure,
runs with --noconftest); the browser tests need Chromium (vagrant/provision.sh)."""
import csv
import html
import json
import shutil
import struct
from pathlib import Path

import pytest

from lab import browser, readable, report, tour
from lab.experiments.base import Claim, name_starved

VARIANTS = ("none", "ecn", "pfc", "ecn+pfc")
T0 = 1_764_700_000.0          # unix time, as queues.csv and counted_unix_s hold it
SPAN_S, GAP_S = 2.0, 1.5      # each variant's traffic, and the set-up between two


def fabricated_incast(workdir: Path) -> dict:
    """An incast run's results directory as the runner leaves it (metrics.json,
    queues.csv): four variants one after the other on one clock."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = {"receiver": "g0", "senders": [f"g{i}" for i in range(1, 9)]}
    rows = []
    for i, v in enumerate(VARIANTS):
        start = T0 + i * (SPAN_S + GAP_S)
        metrics[v] = {"drops_packets": 50 if v == "none" else 0, "ce_marked_packets": 3146,
                      "cnp_packets": 1905, "pause_frames_sent": 4518 if "pfc" in v else 0,
                      "backlog_bytes_p50": 3246, "all_intact": True,
                      "counted_unix_s": [start, start + SPAN_S]}
        for k in range(0, 200, 5):   # a backlog that rises and falls in every variant
            rows.append([start + k / 100, "fl-lf0", 2, 3, (k % 40) * 1600, k % 40, k, 0, 0, 0])
    metrics["telemetry"] = {"busiest_queues": {"fl-lf0:2:3": {"backlog_bytes_max": 64000}}}
    with open(workdir / "queues.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t", "switch", "port", "priority", "backlog_bytes", "backlog_packets",
                    "sent_packets", "drops", "ce_marked_packets", "paused"])
        w.writerows(rows)
    claims = [
        Claim("every message that arrived is intact, every variant", True,
              {v: True for v in VARIANTS}, "all True"),
        Claim("none: the bottleneck queue overflows (drops > 0)", True, 50, "> 0", "packets"),
        Claim("pfc: no drops at the bottleneck, pause frames sent (a claim shown as text)",
              True, {"drops": 0, "pause_frames_sent": 4518}, "drops == 0, pause frames > 0"),
        Claim("every GPU host holds the mean of the values", True,
              {f"g{i}": 0.75 for i in range(4)}, "0.75 on every host"),
        Claim("ecn: bottleneck backlog p50 between Kmin and Kmax", True, 3246,
              "[2048, 16384] bytes", "bytes"),
        Claim("the controller rerouted around the failed link", False,
              {"rc": 0.312, "mrc": None}, "seconds, both", "s"),
    ]
    result = {"experiment": "incast", "params": {"flow_kb": 200, "variants": ",".join(VARIANTS)},
              "topology": {"kind": "leaf-spine", "spines": 1, "leaves": 2},
              "rate_scale": {"factor": 1000, "meaning": "1 emulated Mb/s stands for 1000 real "
                                                        "Mb/s"},
              "datapath": "userspace", "metrics": metrics,
              "claims": [c.__dict__ for c in claims], "passed": False,
              "warnings": ["hosts g3 were CPU-bound"], "timings_s": {"total_s": 14.2}}
    (workdir / "metrics.json").write_text(json.dumps(result))
    return result


@pytest.fixture
def incast_report(tmp_path):
    workdir = tmp_path / "incast"
    result = fabricated_incast(workdir)
    report.write(workdir, result)
    return workdir


@pytest.fixture
def tour_index(tmp_path, incast_report):
    """A tour's index over the fabricated run and a chapter that could not run."""
    result = json.loads((incast_report / "metrics.json").read_text())
    done = [tour.ChapterResult(tour.CHAPTERS[2], incast_report, 31.0, result),
            tour.ChapterResult(tour.CHAPTERS[7], tmp_path / "08-rack-vs-scaleout", 2.0,
                               error="the machine is too slow for 8 GPU hosts at 10 Mb/s")]
    return tour.write_index(tmp_path, done)


# --- claims as text ---------------------------------------------------------------------
@pytest.mark.parametrize("value, unit, text", [
    ({"drops": 50, "pause_frames_sent": 4518}, "", "drops 50, pause frames sent 4,518"),
    ({"g0": 0.75, "g1": 0.75, "g2": 0.75, "g3": 0.75}, "", "all 0.75 (g0, g1, g2, g3)"),
    ({"ce_marked": 3146, "cnps": 1905}, "", "CE marked 3,146, CNPs 1,905"),
    ({"rc": 0.312, "mrc": None}, "s", "RC 0.312 s, MRC not measured"),
    ({"lab_rc": [10, 20], "rxe": [9, 18]}, "packets", "lab RC 10 packets, 20 packets; rxe 9 "
                                                      "packets, 18 packets"),
    (3246, "bytes", "3,246 bytes (3.2 KB)"),
    (0.123, "", "0.123"),
    (1234567.0, "", "1,234,567"),
    ("mrc 0.12 s", "", "mrc 0.12 s"),
])
def test_measured_values_read_as_text(value, unit, text):
    assert readable.measured(value, unit) == text


def test_the_report_shows_claims_as_text_and_keeps_the_raw_values(incast_report):
    md = (incast_report / "report.md").read_text()
    page = (incast_report / "report.html").read_text()
    for text in (md, page):       # the factor it ran at, whatever it was
        assert "Ran at the defaults (machine factor x1.00)." in text, text[:400]
    assert "machine factor x0.50" in report.machine_text({"machine_factor": 0.5})
    claims_md = md.split("## Claims")[1].split("## Parameters")[0]
    assert "{'" not in claims_md and "{&#x27;" not in page     # no Python reprs
    assert "drops 0, pause frames sent 4,518" in claims_md
    assert "all 0.75 (g0, g1, g2, g3)" in page
    assert "3,246 bytes (3.2 KB)" in page
    raw = json.loads((incast_report / "metrics.json").read_text())["claims"]
    assert raw[2]["measured"] == {"drops": 0, "pause_frames_sent": 4518}


def test_a_failed_claim_names_the_machine_load_that_decided_it():
    """A claim the load decided says so (the run's report and the tour show it): an
    excuse of its variant that decides what it rests on, or a timing claim where hosts
    were CPU-bound. Any other miss is the lab's: a claim of the same variant resting on
    something the excuse does not decide, and a timing claim's where no host was."""
    claims = [Claim("pfc: no drop", False, 3, "0", rests_on=("drops",)),
              Claim("MRC's stall is shorter", False, "mrc 1 s", "< rc", timing=True),
              Claim("every GPU holds the mean", False, False, "True"),
              Claim("MRC finishes sooner", True, "mrc 1 s", "< rc", timing=True),
              Claim("pfc: pause frames sent", False, 0, "> 0")]
    metrics = {"starved": [{"variant": "pfc", "decides": ["drops"],
                            "why": "fl-lf0 lost 3 frames inside OVS's user-space datapath"}],
               "cpu_bound_hosts": ["g0", "g1"]}
    named = name_starved(claims, metrics)
    assert named[0].starved == metrics["starved"][0]["why"]
    assert named[1].starved.startswith("hosts g0, g1 were CPU-bound")
    assert named[2].starved is None and named[3].starved is None
    assert named[4].starved is None      # the same variant, resting on nothing it decides
    assert [readable.verdict(c.__dict__) for c in named] == [
        "FAIL (machine load)", "FAIL (machine load)", "FAIL", "PASS", "FAIL"]
    assert name_starved(claims, {"cpu_bound_hosts": []})[1].starved is None


def test_trimming_timeouts_excuse_what_was_resent_never_a_drop():
    """One trimming run on a stalled machine: a retransmit timer fired (so a packet was
    resent twice) and the queue dropped a frame. The timeouts explain the resends
    claim, excused; no timer decides whether the queue trimmed or dropped, so that
    claim fails as the lab's own."""
    from lab.experiments import trimming
    v = {"all_intact": True, "drops_packets": 1, "trimmed_packets": 600,
         "trimmed_received": 600, "trim_nacks_sent": 600, "retransmitted_packets": 602,
         "timeouts": 2, "receiver_duplicates": 2, "resend_delay_ms_mean": 3.0,
         "srtt_ms": [2.0, 2.0]}
    m = {"trim": v, "starved": [e.__dict__ for e in trimming.starved(v)]}
    named = {c.name: c for c in name_starved(
        trimming.claims(trimming.Params(variants="trim"), m), m)}
    resends = named["trim: every trimmed packet is NACKed and resent once, nothing else, "
                    "no timeout"]
    drops = named["trim: the bottleneck trims instead of dropping"]
    assert not resends.passed and "timeouts although every loss was trimmed" in resends.starved
    assert not drops.passed and drops.starved is None


def test_a_background_incast_too_weak_to_drop_names_the_ecn_claim_starved():
    """training-step on a software CPU (x0.05): the background incast delivered too
    little to overflow the GPU's port, so the claim that ECN removes its losses failed
    (0 < 0); the run names that claim as the load's, not only the incast."""
    from lab.experiments import training_step
    variant = {"idle_fraction_mean": 0.5, "all_correct": True, "switch_drops": 0,
               "retransmitted_packets": 0, "timeouts": 0, "naks": 0}
    m = {v: dict(variant) for v in ("clean", "incast", "incast+ecn")}
    m["incast"]["background_load"] = 0.3
    m["starved"] = [e.__dict__ for e in training_step.starved(m)]
    params = training_step.Params(variants="clean,incast,incast+ecn")
    [ecn] = [c for c in name_starved(training_step.claims(params, m), m)
             if "ECN" in c.name]
    assert not ecn.passed and "background incast made no switch drop" in ecn.starved


def test_ecn_that_only_reduces_the_losses_does_not_remove_them():
    """The claim says ECN removes the incast's losses: fewer drops are not none (it
    passed on any reduction before), and no drops where the incast had none is not a
    removal either."""
    from lab.experiments import training_step
    variant = {"idle_fraction_mean": 0.5, "all_correct": True, "retransmitted_packets": 0,
               "timeouts": 0, "naks": 0}
    params = training_step.Params(variants="incast,incast+ecn")

    def ecn_claim(incast: int, ecn: int):
        m = {"incast": {**variant, "switch_drops": incast, "background_load": 0.8},
             "incast+ecn": {**variant, "switch_drops": ecn}}
        return next(c for c in training_step.claims(params, m) if "ECN" in c.name)
    assert ecn_claim(671, 0).passed
    assert not ecn_claim(671, 12).passed
    assert not ecn_claim(0, 0).passed


def test_the_tour_tells_a_chapter_s_story_only_as_far_as_its_run_bore_it_out(tour_index):
    """A chapter whose run failed a claim, or did not run, is not told as if it had
    shown its point: its story reads as what it is meant to show, with what failed."""
    for page in (tour_index, tour_index.with_suffix(".md")):
        text = html.unescape(page.read_text())
        incast, rack = tour.CHAPTERS[2].story, tour.CHAPTERS[7].story
        assert f"Meant to show: {incast} This run did not show all of it: the " \
               f"controller rerouted around the failed link failed" in text, text
        assert f"Meant to show: {rack} This run could not show it" in text, text
    passed = tour.ChapterResult(tour.CHAPTERS[0], Path("x"), 1.0,
                                {"claims": [{"name": "a", "passed": True}]})
    assert tour.told(passed) == tour.CHAPTERS[0].story


def test_the_tour_index_shows_claims_as_text(tour_index):
    for page in (tour_index, tour_index.with_suffix(".md")):
        text = page.read_text()
        assert "{'" not in text and "{&#x27;" not in text
        assert "drops 0, pause frames sent 4,518" in text


def test_the_queue_plot_has_a_panel_per_variant(incast_report):
    result = json.loads((incast_report / "metrics.json").read_text())
    assert list(report.variant_spans(result)) == list(VARIANTS)
    png = (incast_report / report.PLOTS / "queues.png").read_bytes()
    width, height = struct.unpack(">II", png[16:24])   # the PNG header's IHDR
    assert (width, height) == (800, 1000)               # 4 panels of 2.2 in, at 100 dpi


# --- in a real browser --------------------------------------------------------------------
needs_chromium = pytest.mark.skipif(
    not any(shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")),
    reason="no Chromium (vagrant/provision.sh installs Debian's chromium)")


@needs_chromium
@pytest.mark.parametrize("which", ["report", "tour index"])
def test_pages_fit_a_laptop_screen(which, incast_report, tour_index, tmp_path):
    page = incast_report / "report.html" if which == "report" else tour_index
    shot = browser.screenshot(page, tmp_path / f"{which.replace(' ', '-')}.png")
    assert struct.unpack(">II", shot.read_bytes()[16:24]) == (browser.LAPTOP_WIDTH_PX,
                                                             browser.HEIGHT_PX)
    got = browser.layout(page)
    assert got.viewport_px == browser.LAPTOP_WIDTH_PX
    assert not got.overflows, got


@needs_chromium
def test_the_layout_check_sees_a_page_too_wide(tmp_path):
    page = tmp_path / "wide.html"
    page.write_text("<!doctype html><html><body><table><tr><td>"
                    + "x" * 400 + "</td></tr></table></body></html>")
    got = browser.layout(page)
    assert got.overflows and got.page_width_px > browser.LAPTOP_WIDTH_PX


def test_thinning_a_series_keeps_its_peaks_and_ends():
    from lab.report import thin
    points = [(i * 0.005, (i * 37) % 101) for i in range(20000)]    # 100 s at 5 ms
    points[12345] = (points[12345][0], 5000)                        # one spike
    shown = thin(points, 500)
    assert len(shown) <= 1001 and shown[0] == points[0] and shown[-1] == points[-1]
    assert (points[12345][0], 5000) in shown
    assert [t for t, _ in shown] == sorted(t for t, _ in shown)
    assert thin(points[:100], 500) == points[:100]                   # short: as it is


def test_capture_counts_come_from_one_tshark_and_equal_each_file_counted_alone(tmp_path):
    """A report's per-capture filter counts (capture.count_all: the captures merged,
    each its own interface, one tshark) are what tshark finds in each file alone."""
    from scapy.utils import wrpcap

    from lab.fabric.capture import FILTERS, count, count_all
    from traffic.constants import PRIORITY_ROCE_DATA
    from traffic.packets import cnp, nak_seq_error, pfc_pause, pfc_resume, rc_write_packets
    a, b = tmp_path / "a.pcap", tmp_path / "b.pcap"
    data = [bytes(p) for p in rc_write_packets(b"x" * 3000, dst_qp=0xAB, psn=7, va=0x1000,
                                               rkey=1)]
    wrpcap(str(a), [*data, bytes(cnp(0xAB)), bytes(pfc_pause({PRIORITY_ROCE_DATA: 0xFFFF}))])
    wrpcap(str(b), [bytes(nak_seq_error(42, 2, dst_qp=0xAB)),
                    bytes(pfc_resume([PRIORITY_ROCE_DATA])), bytes(pfc_pause({PRIORITY_ROCE_DATA: 9}))])
    counts = count_all({"a": a, "b": b, "gone": tmp_path / "gone.pcap"}, FILTERS)
    assert counts == {"a": count(a, FILTERS), "b": count(b, FILTERS), "gone": None}
    assert (counts["a"]["RoCE data frames"], counts["a"]["CNPs"],
            counts["a"]["PFC XOFF, priority 3"]) == (len(data), 1, 1)
    assert (counts["b"]["RoCE NAKs"], counts["b"]["PFC XON, priority 3"],
            counts["b"]["PFC XOFF, priority 3"], counts["b"]["RoCE data frames"]) == (1, 1, 1, 0)
