"""How fast the fabric reacts to a queue crossing a threshold: the per-packet BPF data
path beside the controller's 1 ms sampling (the fallback), in one run.

An 8-to-1 incast on one leaf (10 Mb/s links), for each data path twice:
  ECN (Kmin = Kmax = K, so marking is all or nothing at K; sampling: the controller's
      marking rule; bpf: the port program marks on RED's average):
      from the queue crossing K (telemetry, 1 ms samples) to the first CE-marked
      packet entering the queue (marking really active: an OVS mirror of the port
      copies each packet as the switch sends it into the queue, so its capture has
      no queueing delay), and to the first one leaving the port (a capture of the
      port itself: that adds the packet's wait behind the K bytes queued),
  PFC (XOFF = K):
      from the queue crossing K to the senders' NIC gates closing (pause enforced
      in the host MACs, the controller's log) and to each sender's transport reading
      the frame (the agents' log). With the data path the crossing is the program's
      own XOFF signal (the packet that crossed: checked to be within one frame of K),
      and the controller's reaction histograms are printed (signal -> handled; XOFF ->
      last upstream gate closed). The data path pauses per ingress port (its own
      threshold, dynamic: alpha x the free buffer above the headroom, at most XOFF):
      each sender's reaction is timed from its own port's XOFF.
Medians and p99 in ms and in packet times at the link rate. Goal: median < 2 ms; with
the data path, XOFF signalled within 1 ms at p99.

    sudo .venv/bin/python bench/reaction.py
"""
from __future__ import annotations

import bisect
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controllers import protocol                                 # noqa: E402
from lab.experiments.common import FRAME_BYTES, rc_params         # noqa: E402
from lab.fabric.capture import Captures                           # noqa: E402
from lab.fabric.congestion import CongestionParams, events, set_congestion  # noqa: E402
from lab.fabric.gpus import GpuAgents                             # noqa: E402
from lab.fabric.telemetry import QueueTelemetry                   # noqa: E402
from lab.session import Session                                   # noqa: E402
from topologies.fabric import interface_name                      # noqa: E402
from topologies.registry import build_topo                        # noqa: E402
from traffic.constants import PRIORITY_ROCE_DATA                    # noqa: E402

RATE_MBPS = 10.0
THRESHOLD_KB = 8.0
FLOW_KB = 600
GOAL_MS = 2.0
REVALIDATION_S = 0.01   # a removed marking rule stays in OVS's cached flows a few ms
EPISODE_S = 0.05        # a controller reaction later than this belongs to another crossing


def crossings(samples, threshold: int) -> list[float]:
    """Times the queue went from below the threshold to at or above it."""
    out, below = [], True
    for s in samples:
        if below and s.backlog_bytes >= threshold:
            out.append(s.t)
        below = s.backlog_bytes < threshold
    return out


def latencies(cross: list[float], reactions: list[float], slack_s: float) -> list[float]:
    """For each crossing, the first reaction after it (the controller samples as often as
    the telemetry, so it may see a crossing up to one sample before the telemetry does:
    a reaction within `slack_s` before counts as 0)."""
    reactions = sorted(reactions)
    out = []
    for t in cross:
        i = bisect.bisect_left(reactions, t - slack_s)
        if i < len(reactions) and reactions[i] - t < 0.5:
            out.append(max(0.0, reactions[i] - t))
    return out


def marking_latencies(cross: list[float], marks: list[tuple[float, bool]],
                      ce: list[float], slack_s: float) -> tuple[list[float], ...]:
    """For each crossing that found marking off (the controller's last mark event before
    it was 'off'): the time to the controller turning marking on, from there to the first
    CE-marked packet sent into the queue (OVS applying the rule, and the next ECN-capable
    packet's arrival), and the whole. Also how many such episodes ended (marking off
    again, plus OVS's lag) before any packet was marked."""
    times = [t for t, _ in marks]
    to_rule, rule_to_ce, to_ce, unmarked = [], [], [], 0
    for c in cross:
        k = bisect.bisect_left(times, c - slack_s)
        if k and marks[k - 1][1]:
            continue                      # still marking from an earlier episode
        on = next((t for t, is_on in marks[k:] if is_on), None)
        if on is None or on - c > EPISODE_S:
            continue
        off = next((t for t, is_on in marks[k:] if not is_on and t > on), float("inf"))
        i = bisect.bisect_left(ce, on)
        if i < len(ce) and ce[i] < off + REVALIDATION_S:
            to_rule.append(max(0.0, on - c))
            rule_to_ce.append(ce[i] - on)
            to_ce.append(max(0.0, ce[i] - c))
        else:
            unmarked += 1
    return to_rule, rule_to_ce, to_ce, unmarked


def ce_times(pcap: Path) -> list[float]:
    r = subprocess.run(["tshark", "-r", str(pcap), "-Y", "ip.dsfield.ecn == 3", "-T", "fields",
                        "-e", "frame.time_epoch"], capture_output=True, text=True, check=True)
    return [float(x) for x in r.stdout.split()]


@contextlib.contextmanager
def enqueue_tap(switch: str, intf: str, pcap: Path):
    """Capture what the switch sends into `intf`'s queue, at the moment it sends it: an
    OVS mirror of the port's output onto a veth of its own (named in the lab's scheme,
    so a sweep removes it; the mirror goes with the bridge)."""
    tap, peer = f"{switch}-eth998", f"{switch}-eth999"
    sh = lambda *a: subprocess.run(a, check=True, capture_output=True)   # noqa: E731
    sh("ip", "link", "add", tap, "type", "veth", "peer", "name", peer)
    try:
        for dev in (tap, peer):
            sh("ip", "link", "set", dev, "up")
        sh("ovs-vsctl", "add-port", switch, tap, "--", "--id=@t", "get", "port", tap, "--",
           "--id=@p", "get", "port", intf, "--", "--id=@m", "create", "mirror",
           "name=fl-enqueue", "select-dst-port=@p", "output-port=@t", "--",
           "add", "bridge", switch, "mirrors", "@m")
        cap = subprocess.Popen(["tcpdump", "-i", peer, "-w", str(pcap), "-U", "-B", "32768"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)   # tcpdump attached
        try:
            yield
        finally:
            cap.terminate()
            cap.wait(timeout=5)
    finally:
        subprocess.run(["ovs-vsctl", "--if-exists", "del-port", switch, tap, "--",
                        "clear", "bridge", switch, "mirrors"], capture_output=True)
        subprocess.run(["ip", "link", "del", tap], capture_output=True)


def summary(name: str, lat_s: list[float]) -> str:
    if not lat_s:
        return f"{name}: no episodes"
    ms = sorted(x * 1e3 for x in lat_s)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    pkt_ms = FRAME_BYTES * 8 / (RATE_MBPS * 1e3)
    med = statistics.median(ms)
    return (f"{name}: n={len(ms)} median {med:.2f} ms ({med / pkt_ms:.1f} packet times), "
            f"p99 {p99:.2f} ms ({p99 / pkt_ms:.1f}); median / goal {med / GOAL_MS:.2f}")


def run_mode(net, gpus, mode: str, tmp: Path) -> list[str]:
    k = int(THRESHOLD_KB * 1024)
    bpf = net.dataplane is not None
    tmp = tmp / ("bpf" if bpf else "sampling")
    tmp.mkdir(exist_ok=True)
    if mode == "ecn":
        cp = CongestionParams(ecn="bpf" if bpf else "controller", kmin_kb=THRESHOLD_KB - 0.001,
                              kmax_kb=THRESHOLD_KB, pmax=1.0)
    else:
        cp = CongestionParams(pfc=True, xoff_kb=THRESHOLD_KB, xon_kb=THRESHOLD_KB / 2)
    set_congestion(net, cp)
    recv = net.fabric.host("g0").interface()
    port = f"{recv.switch}:{recv.port}:{PRIORITY_ROCE_DATA}"
    caps = Captures(net.fabric, ["g0"], tmp / mode, max_mb=50)
    # the mirror copies what OVS sends into the port, before the port's program marks it:
    # it shows the controller's rule, not the data path's marks
    tap = enqueue_tap(recv.switch, interface_name(recv.switch, recv.port),
                      tmp / f"{mode}-enqueue.pcap") if mode == "ecn" and not bpf \
        else contextlib.nullcontext()
    with QueueTelemetry(net.fabric, None, interval_ms=1.0) as tel, caps, tap:
        tel_start = time.time()
        flows = gpus.incast("g0", FLOW_KB * 1024, "rc",
                            params=rc_params(net, RATE_MBPS, THRESHOLD_KB))
    cross = crossings(tel.series.get(port, []), k)
    slack = tel.sampling()["interval_ms_p50"] / 1e3
    evs = events(net, tel_start)
    lines = [f"{mode}: {len(cross)} threshold crossings at {THRESHOLD_KB:.0f} KB; telemetry "
             f"every {tel.sampling()['interval_ms_p50']:.2f} ms (p50)"]
    if mode == "ecn" and bpf:
        pcap = next(iter(caps.summary().values()))["file"]
        lines.append(summary("  crossing -> first CE-marked packet out of the port "
                             "(+ its wait in the queue)",
                             latencies(cross, ce_times(Path(pcap)), slack)))
    elif mode == "ecn":
        marks = sorted((e["t"], e["event"] == "mark_on") for e in evs
                       if e["event"] in ("mark_on", "mark_off"))
        to_rule, rule_to_ce, to_ce, unmarked = marking_latencies(
            cross, marks, ce_times(tmp / "ecn-enqueue.pcap"), slack)
        lines += [summary("  crossing -> first CE-marked packet into the queue", to_ce)
                  + f"; {unmarked} episode(s) ended before a packet was marked",
                  summary("    crossing -> marking rule sent (controller)", to_rule),
                  summary("    rule sent -> first CE-marked packet into the queue (OVS)",
                          rule_to_ce)]
        pcap = next(iter(caps.summary().values()))["file"]
        lines.append(summary("  crossing -> first CE-marked packet out of the port "
                             "(+ its wait in the queue)",
                             latencies(cross, ce_times(Path(pcap)), slack)))
    else:
        hosts = {h.name for h in net.fabric.hosts}
        gate = [e["t"] for e in evs if e["event"] == "gate_close" and e["device"] in hosts]
        xoffs_at: dict[int, list[float]] = {}
        if bpf:   # the program's own crossing: the packet that passed XOFF, and when
            xoffs = [e for e in evs if e["event"] == "xoff"]
            over = sorted(e["held"] - e["threshold"] for e in xoffs)
            exact = sum(0 <= b < FRAME_BYTES for b in over)
            # an ingress is checked at its own arrivals; between two of them the dynamic
            # threshold falls as the other ports fill the queue
            lines.append(f"  XOFF signalled at an arrival of the paused ingress: its bytes "
                         f"within one frame over its threshold {exact}/{len(xoffs)}, over by "
                         f"median {over[len(over) // 2] if over else 0} B, max "
                         f"{over[-1] if over else 0} B")
            for e in xoffs:
                xoffs_at.setdefault(e["port"], []).append(e["t"])
            cross, slack = [e["t"] for e in xoffs], 0.0
        if gate:    # the sampling mode closes the senders' kernel gates
            lines.append(summary("  crossing -> pause enforced (senders' NIC gates closed)",
                                 latencies(cross, gate, slack)))
        per_sender = []
        for f in flows:
            arrivals = [t for t, q in f["sender_nic"]["pause_log"] if q]
            own = xoffs_at.get(net.fabric.host(f["src"]).interface().port) if bpf else cross
            per_sender += latencies(own or [], arrivals, slack)
        lines.append(summary("  crossing -> each sender's transport reads the frame"
                             + ("" if gate else " and stops (its NIC: no gate)"), per_sender))
    return lines


def main() -> None:
    topo = build_topo("leaf-spine", spines=1, leaves=1, hosts_per_leaf=9,
                      host_rate_mbps=RATE_MBPS, fabric_rate_mbps=RATE_MBPS, rate_scale=10000)
    with tempfile.TemporaryDirectory(prefix="fl-bench-") as d:
        for datapath in ("sampling", "bpf"):
            tmp = Path(d) / datapath
            with Session(topo, "bench/reaction.py", tmp / "run", use_dataplane=datapath == "bpf") as s, GpuAgents(s.net) as gpus:
                net = s.net
                out = []
                for mode in ("ecn", "pfc"):
                    out += run_mode(net, gpus, mode, tmp)
                state = protocol.read_state(tmp / "run")
            print(f"--- {datapath}: " + ("the port programs mark and signal per packet"
                                         if datapath == "bpf" else
                                         "the controller samples the queues every 1 ms"))
            print("\n".join(out))
            if datapath == "bpf":
                for name, h in state["reaction"].items():
                    print(f"controller reaction, {name}: p50 {h['gap_ms_p50']} ms, p99 "
                          f"{h['gap_ms_p99']} ms, max {h['gap_ms_max']} ms ({h['samples']})")
            else:
                s = state["sampling"]
                print(f"controller sampling: every {s['gap_ms_p50']} ms (p50), p99 "
                      f"{s['gap_ms_p99']} ms, max {s['gap_ms_max']} ms")


if __name__ == "__main__":
    main()
