"""What watching the queues costs, and whether PFC holds when the CPUs are busy.

Runs the default 8-to-1 incast's PFC variant (`fabriclab run incast --set
variants=pfc`) twice side by side: on an idle machine, and beside LOAD CPU-bound
processes at normal priority (default: one per core). For each it prints

  - PFC: drops anywhere, receiver NAKs, and the reaction the controller measured
    (signal: the port program saw the packet -> the app handled it; pause: the queue
    passed XOFF -> the upstream gate closed), p50/p99/max
  - where the CPU went while the variant's traffic ran (not the fabric's build or
    teardown, nor the variant's setting up and counting), per process class, as a share of all process CPU time: the lab's own
    control and observation (controller, the lab's main process with its telemetry,
    the PFC sender, tcpdump) against the traffic (GPU agents) and the switches (OVS)

    sudo .venv/bin/python bench/congestion_cpu.py [--load N] [--runs N] [--set k=v ...]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from controllers import protocol  # noqa: E402  (the repo is not installed as a package)
from lab.fabric import spawner  # noqa: E402
FABRICLAB = [str(Path(sys.executable).parent / "fabriclab")]
TICK_S = os.sysconf("SC_CLK_TCK")
CLASSES = ("controller", "lab (main, telemetry)", "pfc sender", "gpu agents", "ovs", "tcpdump",
           "other")
OWN = ("controller", "lab (main, telemetry)", "pfc sender", "tcpdump")


def classify(cmdline: str, lab_pid: int, pid: int) -> str | None:
    if pid == lab_pid:
        return "lab (main, telemetry)"
    if "controllers.launch" in cmdline:
        return "controller"
    if "pfc-sender" in cmdline:
        return "pfc sender"
    if spawner.MARKER in cmdline or "traffic.agent" in cmdline:   # forked, or started
        return "gpu agents"
    if "ovs-vswitchd" in cmdline:
        return "ovs"
    if cmdline.startswith("tcpdump"):
        return "tcpdump"
    return None


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S     # utime + stime


class CpuWatch:
    """Every process of the run, between start() and stop() (the variant's traffic, not
    the fabric's build and teardown), summed per class."""

    def __init__(self, lab_pid: int):
        self.lab_pid, self.base, self.seen = lab_pid, {}, {}

    def start(self) -> None:
        self.sample(self.base)

    def stop(self) -> None:
        self.sample(self.seen)

    def sample(self, into: dict) -> None:
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            pid = int(d.name)
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                cls = classify(cmd, self.lab_pid, pid)
                if cls:
                    into[pid] = (cls, cpu_s(pid))
            except OSError:
                continue

    def split(self) -> dict[str, float]:
        """CPU seconds per class between start and stop (processes alive at both)."""
        out = dict.fromkeys(CLASSES, 0.0)
        for pid, (cls, t) in self.seen.items():
            if pid in self.base:
                out[cls] += t - self.base[pid][1]
        return out


def hog() -> None:
    x = 0
    while True:
        x += 1


def one_run(load: int, settings: list[str]) -> dict:
    hogs = [multiprocessing.Process(target=hog, daemon=True) for _ in range(load)]
    for h in hogs:
        h.start()
    out = Path(tempfile.mkdtemp(prefix="fl-bench-cpu-"))
    try:
        args = [*FABRICLAB, "run", "incast", "--set", "variants=pfc", "--out", str(out)]
        for s in settings:
            args += ["--set", s]
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        watch = CpuWatch(proc.pid)
        for line in proc.stdout:      # the runner's progress: the traffic starts, ends
            if "pfc: " in line and "senders" in line:
                watch.start()
            elif "  traffic done" in line:
                watch.stop()
        _, err = proc.communicate()
        if not (out / "metrics.json").exists():
            raise SystemExit(f"the run failed: {err.strip()[-400:]}")
        m = json.loads((out / "metrics.json").read_text())
        state = protocol.read_state(out)
    finally:
        for h in hogs:
            h.terminate()
    v = m["metrics"]["pfc"]
    return {"drops": v["drops_packets"] + sum(v["drops_elsewhere"].values()),
            "naks": v["receiver_naks"], "datapath": m.get("congestion_datapath"),
            "reaction": state.get("reaction", {}), "sampling": state.get("sampling", {}),
            "cpu": watch.split(), "passed": m["passed"],
            "warnings": m.get("warnings", [])}


def show(label: str, r: dict) -> None:
    total = sum(r["cpu"].values()) or 1.0
    own = sum(r["cpu"][c] for c in OWN)
    print(f"{label}: congestion data path {r['datapath']}; drops {r['drops']}, receiver "
          f"NAKs {r['naks']}")
    for name, h in r["reaction"].items():
        if h.get("samples"):
            print(f"  reaction {name:6}: p50 {h['gap_ms_p50']} ms, p99 {h['gap_ms_p99']} ms, "
                  f"max {h['gap_ms_max']} ms ({h['samples']} samples)")
    if r["sampling"].get("samples"):
        s = r["sampling"]
        print(f"  controller sampling gaps: p50 {s['gap_ms_p50']} ms, p99 {s['gap_ms_p99']} ms, "
              f"max {s['gap_ms_max']} ms")
    print("  process CPU: " + ", ".join(f"{k} {v / total:.1%}" for k, v in r["cpu"].items()
                                        if v) + f" (of {total:.1f} CPU-s)")
    print(f"  the lab's own control and observation: {own / total:.1%} of process CPU")
    for w in r["warnings"]:
        print(f"  warning: {w}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=os.cpu_count(),
                    help="CPU-bound processes beside the loaded run (default: one per core)")
    ap.add_argument("--runs", type=int, default=1, help="pairs of runs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    for i in range(a.runs):
        show(f"run {i + 1}, idle machine", one_run(0, a.set))
        show(f"run {i + 1}, beside {a.load} CPU-bound processes", one_run(a.load, a.set))


if __name__ == "__main__":
    main()
