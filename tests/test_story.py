"""The story experiments at small size: the GPUs wait on the network, and the fixes help."""
import json
from types import SimpleNamespace as NS

import pytest

import wire
from conftest import fabriclab, unexcused_failures
from lab.experiments import link_failure, plane_failure
from topologies.fabric import Fabric, interface_name
from topologies.registry import build_topo
from traffic.constants import Opcode


def test_training_step_idle_rises_under_incast_and_the_report_shows_it(tmp_path):
    out = tmp_path / "train"
    r = fabriclab("run", "training-step", "--set", "steps=3", "--set", "grad_kb=64",
                  "--set", "compute_ms=100", "--set", "variants=clean,incast",
                  "--out", str(out), timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    m = json.loads((out / "metrics.json").read_text())["metrics"]
    clean, incast = m["clean"], m["incast"]
    assert clean["all_correct"] and incast["all_correct"], r.stdout
    assert len(clean["steps"]) == 3 and all(s["step_s"] >= 0.1 for s in clean["steps"])
    # waiting on the network: at least the all-reduce's bandwidth term, more under incast
    assert clean["allreduce_s_mean"] >= m["model_allreduce_s"]
    assert incast["idle_fraction_mean"] > clean["idle_fraction_mean"], r.stdout
    # the background incast ran beside the steps (its last round stopped as they ended)
    assert incast["background_load"] > 0 and incast["background_error"] is None
    # why the GPUs waited: each step's all-reduce split into causes that add up to it;
    # resent packets show as time spent on retransmission
    for st in clean["steps"] + incast["steps"]:
        assert sum(st["wait_causes"].values()) == pytest.approx(st["allreduce_s"], abs=1e-3)
        assert st["wait_causes"]["wire"] > 0
    if incast["retransmitted_packets"]:
        assert sum(s["wait_causes"]["retransmission"] for s in incast["steps"]) > 0, r.stdout
    md = (out / "report.md").read_text()
    for plot in ("step_breakdown", "wait_causes", "step_timeline"):
        assert f"plots/{plot}.png" in md and (out / "plots" / f"{plot}.png").exists()


def test_routes_skip_a_failed_link():
    from controllers.routes import Forward, routes_for, without_links
    from topologies.registry import build_topo
    fabric = build_topo("leaf-spine", spines=4, leaves=2, hosts_per_leaf=1).fabric
    before = [r for r in routes_for(fabric)["fl-lf0"] if isinstance(r, Forward)]
    after_fail = routes_for(without_links(fabric, {("fl-lf0", 1)}))
    assert before[0].ports == (1, 2, 3, 4)
    assert [r.ports for r in after_fail["fl-lf0"] if isinstance(r, Forward)] == [(2, 3, 4)]
    # the far leaf no longer sends leaf 0's traffic to the spine that lost its link
    far = [r for r in after_fail["fl-lf1"] if isinstance(r, Forward)][0]
    assert len(far.ports) == 3


@pytest.mark.parametrize("workload", ["allreduce", "transfer"])
def test_link_failure_rc_stalls_until_rerouted_mrc_does_not(tmp_path, workload, pace):
    # sizes and times at the machine's pace: on a slower machine the rates are lower, so
    # the failure and the reroute must come later for a ring step to outlast them
    out, pace = tmp_path / "lf", pace("link-failure")
    reroute_s = pace.s(0.8)
    r = fabriclab("run", "link-failure", "--set", f"workload={workload}",
                  "--set", f"flow_kb={pace.kb(900)}", "--set", f"allreduce_kb={pace.kb(512)}",
                  "--set", f"fail_after_s={pace.s(0.4)}",
                  "--set", f"reroute_delay_ms={reroute_s * 1000:g}", "--out", str(out),
                  *(["--capture", "fl-lf0", "--capture-mb", "40", *wire.HEADERS_ONLY]
                    if workload == "transfer" else []), timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    m = json.loads((out / "metrics.json").read_text())["metrics"]
    rc, mrc = m["rc"], m["mrc"]
    assert rc["intact"] and mrc["intact"], r.stdout
    assert rc["rerouted_after_s"] >= reroute_s and mrc["rerouted_after_s"] >= reroute_s
    # RC's pinned QP waits for the reroute (in a ring the other flows first finish their
    # step, so the collective's stall is shorter); MRC retires the dead EV and goes on
    assert rc["stall_s"] >= pace.s(0.6 if workload == "transfer" else 0.3), r.stdout
    assert mrc["stall_s"] < 0.5 * rc["stall_s"], r.stdout
    assert mrc["completion_s"] < rc["completion_s"], r.stdout
    assert mrc["evs_retired"] >= 1
    if workload == "transfer":
        probes_equal_the_wire(out, mrc)


@pytest.mark.parametrize("failure", ["degrade", "flap", "burst-loss"])
def test_gray_failures_at_the_defaults(tmp_path, failure):
    """A link that slows, flaps or loses bursts without staying down: every claim at the
    defaults, what the failure did recorded, and nothing of it left behind."""
    out = tmp_path / "gray"
    r = fabriclab("run", "link-failure", "--set", f"failure={failure}", "--out", str(out),
                  timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    result = json.loads((out / "metrics.json").read_text())
    assert not unexcused_failures(result), r.stdout
    rc, mrc = result["metrics"]["rc"], result["metrics"]["mrc"]
    for m in (rc, mrc):
        assert m["failure"] == failure
        if failure == "degrade":
            # (metrics.json keeps a rate's three decimals: x0.125 made 0.3125 0.312)
            assert m["degraded_to_mbps"] == pytest.approx(0.25 * 10.0 * pace_factor(result),
                                                          abs=5e-4)
        elif failure == "flap":
            assert m["flaps"] >= 2
        else:                  # every burst dropped frames (the RC and MRC data there)
            assert m["bursts"] >= 2 and m["burst_dropped"] > 0
    if failure == "burst-loss":
        # the bursts' losses were resent (they drop acknowledgements and probes too, so
        # the counts differ)
        assert rc["retransmitted_packets"] > 0 and mrc["retransmitted_packets"] > 0
    from lab.kernel import impair
    assert impair.gray_tables() == []          # the burst table went with the run


def test_a_gray_failures_time_limit_allows_for_the_rate_it_leaves():
    """On a slow machine (x0.05: 0.5 Mb/s links, a quarter of the sizes) the minimum
    limit no longer covers RC's QP through a link degraded to a quarter of its rate."""
    gpus = NS(hosts=[NS(interface=lambda: NS(rate_mbps=0.5))])

    def limit_s(failure: str) -> float:
        ctx = NS(params=link_failure.Params(allreduce_kb=256, failure=failure))
        return link_failure.time_limit_s(ctx, gpus)
    ideal_s = 2 * 256 * 1024 * 8 / 0.5e6
    assert limit_s("down") == 120.0 > 4 * ideal_s               # the minimum covers it
    assert limit_s("degrade") == pytest.approx(4 * ideal_s / 0.25)
    assert limit_s("burst-loss") == 120.0


def pace_factor(result: dict) -> float:
    """The machine factor the runner applied to the default rates (1 on a fast machine)."""
    return result["topology"]["host_rate_mbps"] / 10.0


def probes_equal_the_wire(out, mrc: dict) -> None:
    """MRC's out-of-band probes (opcode 0xC3) on the sender's port against its EVs'
    histories: a probe frame from the sender for each "probe sent", and an answer from
    the receiver for each "probe answered" (an answer that came after its probe was
    given up is on the wire too, not in the history). Exact, but for what tcpdump
    reports it lost itself."""
    cap = wire.RunCaptures(out)
    src, dst = (cap.fabric.host(h).interface() for h in cap.metrics["hosts"])
    port = cap.host_port(cap.metrics["hosts"][0])
    slack = cap.tcpdump_dropped([port])
    probes = [f for f in cap.frames[port] if f.opcode == Opcode.MRC_PROBE]
    sent = sum(f.src == src.ip for f in probes)
    answers = sum(f.src == dst.ip for f in probes)
    whys = [c["why"] for c in mrc["ev_changes"]]
    assert abs(sent - whys.count("probe sent")) <= slack, (sent, whys)
    assert answers + slack >= whys.count("probe answered"), (answers, whys)


def test_mrc_on_a_multi_plane_rack_uses_every_plane_as_the_model_says(tmp_path):
    """planes=2 on the rack fabric: MRC's scale-out phases spray over both planes' ports,
    so the model counts both (RC would keep to one), and every claim holds."""
    out = tmp_path / "rack-planes"
    r = fabriclab("run", "rack-vs-scaleout", "--set", "planes=2", "--set", "transport=mrc",
                  "--out", str(out), timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    result = json.loads((out / "metrics.json").read_text())
    assert not unexcused_failures(result), r.stdout
    fabric = Fabric.load(out / "fabric.json")
    port = fabric.hosts[0].interface()
    assert result["metrics"]["scaleout_mbps"] == pytest.approx(2 * port.rate_mbps)


def test_rack_vs_scaleout_reports_both_against_the_model(tmp_path):
    out = tmp_path / "rack"
    r = fabriclab("run", "rack-vs-scaleout", "--out", str(out),
                  timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    m = json.loads((out / "metrics.json").read_text())["metrics"]
    for algorithm in ("ring", "hier"):
        assert m[algorithm]["agree"], r.stdout
        # nothing beats the wire (but for the links' token buckets: floor_time_s)
        assert m[algorithm]["over_model"] >= m[algorithm]["floor_over_model"] > 0.5
    assert m["model_speedup"] > 3      # 9:1 scale-up: the model's hierarchical win
    # the scale-up phases run at the scale-up rate (paced at the scale-out rate they
    # took as long as the flat ring): most of the model's win is measured
    assert m["speedup"] >= 0.6 * m["model_speedup"], r.stdout
    assert m["hier"]["scale-up reduce-scatter s"] < m["hier"]["scale-out ring s"], r.stdout


def test_the_tour_runs_its_chapters_and_links_their_reports(tmp_path):
    out = tmp_path / "tour"
    r = fabriclab("tour", "--only", "allreduce", "--out", str(out), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    tour = json.loads((out / "tour.json").read_text())
    [chapter] = tour["chapters"]
    assert chapter["experiment"] == "allreduce" and chapter["error"] is None
    assert chapter["claims"] and all(c["passed"] for c in chapter["claims"])
    # where the time went, in parts that add up to the chapter's time
    split = tour["time_split_s"]
    assert split["fabric_up_s"] > 0 and split["experiment_s"] > 0 and split["report_s"] > 0
    assert abs(chapter["seconds"] - sum(split.values())) < 0.5, (chapter, split)
    assert "  time: fabric up " in r.stdout
    page = (out / "index.html").read_text()
    assert "01-allreduce/report.html" in page and (out / "01-allreduce" / "report.html").exists()
    # every host's result, as measured: the claim's values and the page that shows them
    # (the chapter's title says 0.75 whatever the run measured)
    [agree] = [c for c in chapter["claims"] if "holds the mean" in c["name"]]
    assert agree["measured"] == {f"g{i}": 0.75 for i in range(4)}, agree
    assert "all 0.75 (g0, g1, g2, g3)" in page, page
    assert f"report: {out / 'index.html'}" in r.stdout
    bad = fabriclab("tour", "--only", "no-such-chapter", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 1 and "no tour chapter 'no-such-chapter'" in bad.stderr


def test_a_tour_chapter_links_its_pcaps_with_filters_and_counts(tmp_path):
    """loss-recovery's chapter captures the port into the lossy link, headers only, within
    its budget; its report links the pcap and gives each display filter's tshark count:
    the data frames are there, and RC's NAKs (go-back-N after each loss)."""
    from lab import tour
    out = tmp_path / "tour"
    r = fabriclab("tour", "--only", "loss-recovery", "--out", str(out), timeout=400)
    assert (out / "tour.json").exists(), r.stdout + r.stderr
    chapter = out / "01-loss-recovery"
    caps = json.loads((chapter / "metrics.json").read_text())["metrics"]["captures"]
    [(intf, port)] = caps["ports"].items()
    pcap = chapter / "captures" / f"{intf}.pcap"
    assert pcap.exists() and port["bytes"] <= tour.CAPTURE_MB["loss-recovery"] * 1e6
    assert caps["snaplen"] == tour.CAPTURE_SNAPLEN and port["dropped_by_tcpdump"] == 0
    counts = port["counts"]
    assert counts["RoCE data frames"] > 1000 and counts["RoCE NAKs"] > 0, counts
    page = (chapter / "report.html").read_text()
    assert f"captures/{intf}.pcap" in page and "infiniband.aeth.syndrome" in page
    assert str(counts["RoCE NAKs"]) in page
    # and the counters against the wire, per transport: retransmissions (frames repeating
    # a QP's PSN toward the lossy link) and RC's NAKs (from the receiver)
    m = json.loads((chapter / "metrics.json").read_text())["metrics"]
    frames = wire.read(pcap)
    dst = Fabric.load(chapter / "fabric.json").host(m["dst"]).interface().ip
    for transport in ("rc", "mrc"):
        span = m[transport]["counted_unix_s"]
        data = [f for f in frames if span[0] <= f.t <= span[1]
                and f.roce_data and f.dst == dst]
        assert m[transport]["retransmitted_packets"] == wire.repeats(data), transport
    rc_span = m["rc"]["counted_unix_s"]
    naks = [f for f in frames if rc_span[0] <= f.t <= rc_span[1] and f.src == dst and f.nak]
    assert m["rc"]["receiver_naks"] == len(naks) > 0


def test_kv_cache_latency_in_the_express_class(tmp_path):
    """KV caches beside a training job: every claim at the defaults; the express
    variant's frames went through the express queue (priority 5) of the uplink, every
    data packet of every transfer, while the RoCE queue carried the training; and the
    KV transfers' retransmissions and CNPs equal the prefill host's port's capture."""
    import csv
    out = tmp_path / "kv"
    r = fabriclab("run", "kv-cache", "--out", str(out), "--capture", "g3", timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    result = json.loads((out / "metrics.json").read_text())
    assert all(c["passed"] for c in result["claims"]), r.stdout
    p, m = result["params"], result["metrics"]
    assert m["express"]["dscp"] == 34 and m["shared"]["dscp"] == 26
    packets = p["transfers"] * -(-p["kv_kb"] * 1024 // 1024)
    sent = {}
    with open(out / "queues.csv") as f:
        for row in csv.DictReader(f):
            if (row["switch"], row["port"]) == ("fl-lf0", "1"):       # the spine uplink
                key = int(row["priority"])
                sent[key] = max(sent.get(key, 0), int(row["sent_packets"]))
    assert packets <= sent[5] <= packets + m["express"]["retransmitted_packets"], sent
    assert sent[3] > packets          # the RoCE class: the training's ring (and more)
    cap = wire.RunCaptures(out)
    port = cap.host_port(m["prefill"])
    slack = cap.tcpdump_dropped([port])
    src = cap.fabric.host(m["prefill"]).interface().ip
    data = [f for f in cap.frames[port] if f.src == src and f.udp_dst == 4791
            and f.opcode is not None and f.opcode <= wire.LAST_DATA_OPCODE]
    express = [f for f in data if f.dscp == 34]
    transfers = [t for v in ("alone", "shared", "express") for t in m[v]["transfers"]]
    assert abs(wire.repeats(data) - sum(t["retransmitted"] for t in transfers)) <= slack
    assert abs(sum(f.cnp for f in cap.frames[port] if f.dst == src)
               - sum(t["cnps"] for t in transfers)) <= slack
    assert abs(len(express) - packets - m["express"]["retransmitted_packets"]) <= slack


def test_plane_failure_retransmissions_against_the_wire(tmp_path):
    """The packets each transport resent in the plane failure (retransmitted_packets) are
    the data frames that repeat a QP's PSN in captures of every GPU port on both planes,
    each frame taken once, as its host sent it. MRC resends a packet lost with the
    plane on the other plane, with that plane's addresses: a repeat is keyed by host."""
    fabric = build_topo("leaf-spine", **plane_failure.TOPOLOGY_DEFAULTS["leaf-spine"]).fabric
    ports = {interface_name(i.switch, i.port): i.mac for h in fabric.hosts for i in h.interfaces}
    out = tmp_path / "plane"
    r = fabriclab("run", "plane-failure", "--capture", ",".join(sorted(ports)),
                  "--capture-mb", "40", *wire.HEADERS_ONLY, "--out", str(out), timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    result = json.loads((out / "metrics.json").read_text())
    cap = wire.RunCaptures(out)
    assert sorted(cap.ports) == sorted(ports)
    slack = cap.tcpdump_dropped(sorted(ports))
    host_of = {i.ip: h.name for h in cap.fabric.hosts for i in h.interfaces}
    for transport in ("rc", "mrc"):
        m = result["metrics"][transport]
        sent = [f for port, mac in ports.items()
                for f in cap.within([port], m["span_unix"], lambda f: f.roce_data)
                if f.src_mac == mac]                  # host -> leaf: what the host sent
        keys = [(host_of[f.src], host_of[f.dst], f.qp, f.psn) for f in sent]
        resent = len(keys) - len(set(keys))
        assert abs(resent - m["retransmitted_packets"]) <= slack, (transport, resent, m)
        assert m["retransmitted_packets"] > 0, transport   # the failure lost packets of both


def test_plane_failure_at_the_defaults_and_the_planes_bytes_against_the_wire(tmp_path):
    """A whole plane fails: every claim at the defaults; and the bytes the run counted
    through plane 1's spine tier (its leaves' uplinks' counters) are the frames a
    capture of those uplinks holds, RC's none of them."""
    out = tmp_path / "plane"
    r = fabriclab("run", "plane-failure", "--capture", "fl-lf2:1,fl-lf3:1", "--out", str(out),
                  timeout=600)
    assert (out / "metrics.json").exists(), r.stdout + r.stderr   # the run finished
    result = json.loads((out / "metrics.json").read_text())
    assert not unexcused_failures(result), r.stdout
    cap = wire.RunCaptures(out)
    ports = sorted(cap.ports)
    slack = cap.tcpdump_dropped(ports)
    own_macs = {port: {i.mac for h in cap.fabric.hosts for i in h.interfaces
                       if i.switch == port.rsplit("-", 1)[0]} for port in ports}
    for variant in ("rc", "mrc"):
        m = result["metrics"][variant]
        counted = sum(m[f"plane_bytes_{phase}"]["1"] for phase in ("before", "outage", "after"))
        # a capture holds both ways of a port; the leaves route without rewriting the
        # source MAC, so what a leaf sent up is what came from its own hosts
        frames = [f for port in ports for f in cap.within([port], m["span_unix"], lambda f: True)
                  if f.src_mac in own_macs[port]]
        assert abs(sum(f.length for f in frames) - counted) <= slack * 1500, (variant, counted)
        roce = [f for f in frames if f.udp_dst is not None and f.opcode is not None]
        if variant == "rc":
            assert not roce                       # RC keeps to plane 0
        else:                                     # MRC's data crossed plane 1 (10.11.x.x)
            assert sum(f.roce_data for f in roce) > 1000
            assert all(f.src.startswith("10.11.") for f in roce)
