"""The lab against htsim: the same fabrics and flows in Broadcom's packet-level simulator.

For each case the bench writes htsim's topology and connection matrix from the lab's
own fabric description (topologies/htsim.py: the fabric the experiment builds, from its
TOPOLOGY_DEFAULTS, or a lab run's fabric.json), runs htsim's datacenter drivers, reads
each flow's completion from their output, and sets the numbers beside the lab's
(metrics.json of `fabriclab run`). One table: case, mechanism on each side, metric, lab,
htsim, lab/htsim; a disagreement over 15% is flagged.

  incast   8 senders x 1200 KB to one receiver on one leaf: the last completion over
           the ideal, and goodput max/mean across senders (fairness)
             lab incast pfc (RC+PFC)      vs  htsim_roce, lossless_input (PFC)
             lab trimming trim (MRC)      vs  htsim_ndp (trimming, receiver pulls)
             lab incast rccc (MRC+RCCC)   vs  htsim_eqds (receiver credit)
  ecmp     ecmp-vs-spray: 8 flows leaf to leaf over 4 spines: the slowest flow over the
           ideal (htsim over --seeds seeds)
             lab rc, rc+pfc (ECMP-pinned) vs  htsim_roce + PFC, ECMP per flow
             lab mrc_hash (8 EVs)         vs  htsim_ndp / htsim_eqds, 8 path values
             lab mrc_explicit (1 EV/spine) vs htsim_ndp / htsim_eqds, 256 path values

Ideal (both sides alike, ideal_s() below): the flows' frames that must cross the fabric's
most loaded link (a host's link, or a leaf's uplinks together), at that link's rate; a
lower bound on the last completion under any routing. Frames: whole packets of the
side's payload plus its per-packet header (lab: 1024 B + 58 B for RC, + 78 B for MRC;
htsim: the -mtu payload + 64 B). Rates: the lab's own (emulated) for the lab, the real
ones (x rate_scale) for htsim, so each ratio is scale-free.

    .venv/bin/python bench/htsim_compare.py --build                 # clone, build, both sides
    .venv/bin/python bench/htsim_compare.py --htsim-src DIR --no-lab  # htsim only
    .venv/bin/python bench/htsim_compare.py --lab-results results    # existing lab runs
The lab side runs `fabriclab run` (root, minutes); htsim's runs take milliseconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lab.experiments import ecmp_vs_spray, incast, trimming  # noqa: E402
from lab.fabric.congestion import CongestionParams  # noqa: E402
from lab.kernel.queues import QueueParams  # noqa: E402
from topologies import htsim  # noqa: E402
from topologies.fabric import Fabric  # noqa: E402
from topologies.registry import build_topo  # noqa: E402
from traffic.constants import DEFAULT_MTU_BYTES  # noqa: E402
from traffic.mrc import DATA_OVERHEAD_BYTES  # noqa: E402
from traffic.roce import WRITE_OVERHEAD_BYTES  # noqa: E402

# --- what the bench compares (edit here when the experiments change) ---------------------
CASES = ("incast", "ecmp")
# experiment -> the --set settings of its lab run: every incast flow 1200 KB (the PFC and
# UET variants have sizes of their own, `pfc_flow_kb` and `uet_flow_kb`)
LAB_RUNS = {
    "incast": ["variants=pfc,rccc", "pfc_flow_kb=1200", "uet_flow_kb=1200"],
    "trimming": ["flow_kb=1200", "variants=trim"],
    "ecmp-vs-spray": [],
}
# the incast's variants whose flows are uet_flow_kb (its pfc variant's: pfc_flow_kb)
INCAST_UET_VARIANTS = ("rccc",)
# ecmp-vs-spray's variants (its metrics.json keys): pinned by ECMP (RC lossy, RC+PFC; a name
# missing from a run is shown as such) and sprayed, with the number of path values htsim
# sprays each flow over to stand for it
ECMP_PINNED_VARIANTS = ("rc", "rc+pfc")
ECMP_SPRAYED_VARIANTS = {"mrc_hash": 8,        # the MRC default: 8 EVs, hashed
                         "mrc_explicit": 256}  # one EV per spine: an even spread; htsim
# hashes each packet's path value, so many values stand for the even spread
TOLERANCE = 0.15

# --- htsim -------------------------------------------------------------------------------
HTSIM_REPO = "https://github.com/Broadcom/csg-htsim"
CACHE_DIR = Path(os.environ.get("FABRICLAB_HTSIM_CACHE", "/var/cache/fabriclab/htsim"))
DRIVERS = ("htsim_roce", "htsim_ndp", "htsim_eqds")
# htsim's RoCE (and HPCC) sources reseed the global generator from the clock when a flow
# is made, so its ECMP path ignores -seed; the bench's build removes that line
SEED_PATCH_FILES = ("roce.cpp", "hpcc.cpp")
SEED_LINE = "    srand(time(NULL));\n"
SEED_PATCHED = ("    /* fabriclab bench: srand(time(NULL)) removed so that -seed picks "
                "the ECMP paths */\n")
HEADER_BYTES = 64          # htsim's per-packet header: RoCE's and NDP's ACKSIZE, EQDS's
# EQDS's pull pacers are made before any sender sets the MTU from -mtu, so they pace one
# pull per 4160 B of link time whatever -mtu says, and a sender sends about one packet per
# pull: at 1 KB packets it gets a fraction of the link (measured: 3.2-3.6x the ideal in the
# incast). Its default MTU:
EQDS_MTU_BYTES = 4096 + HEADER_BYTES
END_IDEALS = 20            # htsim's -end: this many ideals (at least END_MIN_US)
END_MIN_US = 2000
SEED_DEFAULT = 1
LOSSLESS_WARNING = re.compile(r"LOSSLESS not working! I should have dropped this packet(\d+)")
FINISHED = re.compile(r"^Flow (\w+?)_(\d+)_(\d+) .*?finished at ([0-9.eE+-]+)", re.M)


# --- the ideal, both sides ---------------------------------------------------------------
def wire_bits(size_bytes: int, payload_bytes: int, header_bytes: int) -> int:
    """A flow's bits on the wire: whole packets (the incast experiment's formula; htsim's
    RoCE and NDP send the last one full-sized) of payload plus header."""
    return math.ceil(size_bytes / payload_bytes) * (payload_bytes + header_bytes) * 8


def ideal_s(fabric: Fabric, flows: list[htsim.Flow], payload_bytes: int, header_bytes: int,
            real: bool) -> float:
    """The time the fabric's most loaded link needs for the frames that must cross it: a
    host's link (each way), or a leaf's uplinks to all spines together (each way), at the
    real rates (real=True: htsim's time) or the lab's emulated ones (the lab's time)."""
    rate_bps = (lambda mbps: htsim.real_gbps(fabric, mbps) * 1e9) if real else \
        (lambda mbps: mbps * 1e6)
    uplinks = defaultdict(float)           # leaf -> its uplinks' rate, bits/s
    for ln in fabric.links:
        if ln.kind == "fabric":
            leaf = ln.a if fabric.switch(ln.a).role == "leaf" else ln.b
            uplinks[leaf] += rate_bps(ln.rate_mbps)
    busy = defaultdict(float)              # a link (and direction) -> seconds of frames
    for f in flows:
        bits = wire_bits(f.size_bytes, payload_bytes, header_bytes)
        src, dst = fabric.host(f.src).interface(), fabric.host(f.dst).interface()
        busy["out", f.src] += bits / rate_bps(src.rate_mbps)
        busy["in", f.dst] += bits / rate_bps(dst.rate_mbps)
        if src.switch != dst.switch:
            busy["up", src.switch] += bits / uplinks[src.switch]
            busy["down", dst.switch] += bits / uplinks[dst.switch]
    return max(busy.values())


def max_over_mean(values: list[float]) -> float:
    return max(values) / statistics.mean(values)


def bdp_packets(case: "CaseInput", payload_bytes: int, link_latency_ns: int) -> int:
    """The longest path's bandwidth-delay product in htsim packets: NDP's window (its
    senders keep this much in flight, pulled packets replace arrived ones; htsim's default
    of 15 packets suits its 9 KB default packets, and at 1 KB it holds a 4-link path to a
    third of the link). RTT: every link twice, a data frame and an ACK serialized on each."""
    shape = htsim.leaf_spine_shape(case.fabric)
    links = max(2 if case.fabric.host(f.src).interface().switch
                == case.fabric.host(f.dst).interface().switch else 4 for f in case.flows)
    bps = shape.host_link_gbps * 1e9
    rtt_s = links * (2 * link_latency_ns * 1e-9
                     + (payload_bytes + 2 * HEADER_BYTES) * 8 / bps)
    return math.ceil(rtt_s * bps / 8 / (payload_bytes + HEADER_BYTES))


def roce_pfc_args() -> list[str]:
    """htsim_roce as the lab's RC+PFC: lossless queues paused at the lab's XOFF and
    resumed at its XON (in packets), every flow pinned to one ECMP path."""
    pfc = CongestionParams()
    high = max(2, math.ceil(pfc.xoff_kb * 1024 / DEFAULT_MTU_BYTES))
    low = min(high - 1, max(1, math.floor(pfc.xon_kb * 1024 / DEFAULT_MTU_BYTES)))
    return ["-queue_type", "lossless_input", "-pfc_thresholds", str(low), str(high),
            "-strat", "ecmp_host", "-paths", "1"]


def ndp_window_args(case: "CaseInput", link_latency_ns: int) -> list[str]:
    return ["-cwnd", str(bdp_packets(case, DEFAULT_MTU_BYTES, link_latency_ns))]


# --- the cases: fabric and flows, from the experiments' own code ---------------------------
@dataclass
class CaseInput:
    """One experiment's fabric and flows, as the lab builds them."""
    experiment: str
    fabric: Fabric
    flows: list[htsim.Flow]
    buffer_bytes: int
    source: str                        # where the fabric came from


def lab_run_dir(lab_results: Path | None, experiment: str) -> Path | None:
    """A lab run of `experiment` under lab_results: DIR/NAME, else the newest
    DIR/NAME-* (fabriclab run's default naming), else None."""
    if lab_results is None:
        return None
    exact = lab_results / experiment
    if (exact / "metrics.json").exists():
        return exact
    runs = sorted(p for p in lab_results.glob(f"{experiment}-*") if (p / "metrics.json").exists())
    return runs[-1] if runs else None


def case_input(experiment: str, run: Path | None, uet: bool = False) -> CaseInput:
    """The fabric (the run's fabric.json, else build_topo with the experiment's
    TOPOLOGY_DEFAULTS and the bench's settings) and the flows of `experiment` (`uet`: the
    incast's UET variants, whose flows are uet_flow_kb; its pfc variant's are pfc_flow_kb)."""
    mod = {"incast": incast, "trimming": trimming, "ecmp-vs-spray": ecmp_vs_spray}[experiment]
    settings = dict(s.split("=", 1) for s in LAB_RUNS[experiment])
    if run is not None:
        fabric = Fabric.load(run / "fabric.json")
        params = json.loads((run / "metrics.json").read_text())["params"]
        config = run / "config.json"
        buffer_kb = json.loads(config.read_text())["queues"]["buffer_kb"] \
            if config.exists() else QueueParams().buffer_kb
        source = str(run / "fabric.json")
    else:
        fabric = build_topo("leaf-spine", **mod.TOPOLOGY_DEFAULTS["leaf-spine"]).fabric
        params = {**vars(mod.Params()), **settings}
        buffer_kb = QueueParams().buffer_kb
        source = f"build_topo('leaf-spine', **{mod.__name__.split('.')[-1]}.TOPOLOGY_DEFAULTS)"
    hosts = [h.name for h in fabric.hosts]
    if experiment == "ecmp-vs-spray":
        p = ecmp_vs_spray.Params(flow_mb=float(params["flow_mb"]),
                                 flows_per_host=int(params["flows_per_host"]))
        plan = ecmp_vs_spray.flows(SimpleNamespace(fabric=fabric, params=p))
        flows = [htsim.Flow(s, d, n) for s, d, n in plan]
    else:       # incast and trimming: hosts[0] receives from the next `senders`
        size_kb = params["uet_flow_kb" if uet else
                         "pfc_flow_kb" if experiment == "incast" else "flow_kb"]
        senders, size = int(params["senders"]), int(size_kb) * 1024
        flows = [htsim.Flow(s, hosts[0], size) for s in hosts[1:senders + 1]]
    return CaseInput(experiment, fabric, flows, buffer_kb * 1024, source)


# --- htsim: build, run, parse ------------------------------------------------------------
def sim_dir(src: Path) -> Path:
    return src / "sim" if (src / "sim").is_dir() else src


def seed_patched(src: Path) -> bool:
    return all(SEED_LINE not in (sim_dir(src) / f).read_text() for f in SEED_PATCH_FILES)


def build_htsim(src: Path | None, jobs: int) -> Path:
    """htsim's drivers, built in `src` (default: a clone in CACHE_DIR): the seed patch,
    then its library and the three drivers (make is incremental: a built tree is reused)."""
    if src is None:
        src = CACHE_DIR / "csg-htsim"
        if not (src / "sim").is_dir():
            src.parent.mkdir(parents=True, exist_ok=True)
            print(f"cloning {HTSIM_REPO} into {src}", flush=True)
            subprocess.run(["git", "clone", "--depth", "1", HTSIM_REPO, str(src)], check=True)
    sim = sim_dir(src)
    if not (sim / "datacenter" / "Makefile").exists():
        sys.exit(f"{src} is not a checkout of {HTSIM_REPO} (no sim/datacenter/Makefile)")
    for name in SEED_PATCH_FILES:
        path = sim / name
        text = path.read_text()
        if SEED_LINE in text:
            path.write_text(text.replace(SEED_LINE, SEED_PATCHED))
            print(f"patched {path}: srand(time(NULL)) removed (ECMP follows -seed)", flush=True)
    make = ["nice", "-n", "19", "make", f"-j{jobs}"]
    t0 = time.monotonic()
    print(f"building htsim in {sim} (make -j{jobs}, nice 19)", flush=True)
    for cmd, cwd in ((make + ["libhtsim.a"], sim),
                     (make + list(DRIVERS), sim / "datacenter")):
        r = subprocess.run(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True)
        if r.returncode:
            sys.exit(f"htsim build failed ({' '.join(cmd)} in {cwd}):\n{r.stderr[-3000:]}")
    print(f"  built in {time.monotonic() - t0:.0f} s", flush=True)
    return src


def find_htsim(src: Path | None) -> Path:
    src = src or CACHE_DIR / "csg-htsim"
    missing = [d for d in DRIVERS if not (sim_dir(src) / "datacenter" / d).exists()]
    if missing:
        sys.exit(f"no htsim drivers {', '.join(missing)} under {sim_dir(src)}/datacenter: "
                 f"pass --build (and --htsim-src DIR for a checkout of {HTSIM_REPO})")
    return src


@dataclass
class HtsimRun:
    driver: str
    seed: int
    completions_us: dict[tuple[str, str], list[float]]   # (src, dst) lab names -> flows'
    lossless_overrun_kb: float = 0.0     # the most a lossless queue held past its size
    argv: list[str] = field(default_factory=list)


def run_htsim(src: Path, driver: str, case: CaseInput, extra: list[str], mtu_bytes: int,
              queue_packets: int, seed: int, link_latency_ns: int,
              keep: Path | None = None) -> HtsimRun:
    """One htsim run of `case` in a scratch directory (the drivers write their logs in
    the working directory); every flow's completion, or exit if one did not finish.
    `keep`: write the topology, the matrix, the command and htsim's output there."""
    shape = htsim.leaf_spine_shape(case.fabric)
    nodes = htsim.node_numbers(case.fabric)
    names = {i: n for n, i in nodes.items()}
    payload = mtu_bytes - HEADER_BYTES if driver == "htsim_eqds" else mtu_bytes
    ideal_us = ideal_s(case.fabric, case.flows, payload, HEADER_BYTES, real=True) * 1e6
    end_us = max(END_MIN_US, int(END_IDEALS * ideal_us))
    paths = extra[extra.index("-paths") + 1] if "-paths" in extra else "1"
    stem = f"{case.experiment}-{driver.removeprefix('htsim_')}-paths{paths}-seed{seed}"
    with tempfile.TemporaryDirectory(prefix="htsim-") as tmp:
        where = keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        topo, tm = where / f"{stem}.topo", where / f"{stem}.cm"
        topo.write_text(htsim.topology_text(case.fabric, link_latency_ns))
        tm.write_text(htsim.connection_matrix_text(case.fabric, case.flows))
        argv = [str(sim_dir(src) / "datacenter" / driver), "-topo", str(topo), "-tm", str(tm),
                "-nodes", str(shape.nodes), "-linkspeed", str(shape.host_link_gbps * 1000),
                "-mtu", str(mtu_bytes), "-q", str(queue_packets), "-seed", str(seed),
                "-end", str(end_us), "-o", str(where / f"{stem}.log"), *extra]
        r = subprocess.run(["nice", "-n", "19", *argv], cwd=tmp, capture_output=True,
                           text=True, timeout=300)
    if keep:
        (keep / f"{stem}.cmd").write_text(" ".join(argv) + "\n")
        (keep / f"{stem}.out").write_text(r.stdout + r.stderr)
    if r.returncode:
        sys.exit(f"{driver} failed ({r.returncode}): {' '.join(argv)}\n{r.stdout[-2000:]}"
                 f"{r.stderr[-2000:]}")
    done = defaultdict(list)
    for _, s, d, t in FINISHED.findall(r.stdout):
        done[names[int(s)], names[int(d)]].append(float(t))
    starts = defaultdict(list)
    for f in case.flows:
        starts[f.src, f.dst].append(f.start_us)
    if sum(map(len, done.values())) != len(case.flows):
        sys.exit(f"{driver}: {sum(map(len, done.values()))} of {len(case.flows)} flows "
                 f"finished by {end_us} us: {' '.join(argv)}")
    completions = {k: [t - s for t, s in zip(sorted(v), sorted(starts[k]))]
                   for k, v in done.items()}
    overrun = [int(n) * mtu_bytes / 1024 for n in LOSSLESS_WARNING.findall(r.stdout)]
    return HtsimRun(driver, seed, completions, max(overrun, default=0.0), argv)


# --- the table's rows ----------------------------------------------------------------------
@dataclass
class Row:
    case: str
    lab_mechanism: str
    htsim_mechanism: str
    metric: str
    lab: float | None = None
    lab_note: str = ""
    htsim: list[float] = field(default_factory=list)    # one per seed

    def ratio(self) -> float | None:
        return self.lab / statistics.mean(self.htsim) if self.lab and self.htsim else None

    def disagrees(self) -> bool:
        """The lab's value more than TOLERANCE outside htsim's range (over seeds)."""
        if self.lab is None or not self.htsim:
            return False
        return not min(self.htsim) * (1 - TOLERANCE) <= self.lab \
            <= max(self.htsim) * (1 + TOLERANCE)


def htsim_side(cases: list[str], src: Path, inputs: dict[str, CaseInput], seeds: int,
               link_latency_ns: int, eqds_mtu: int, notes: list[str],
               keep: Path | None = None) -> list[Row]:
    """Every row of `cases` with htsim's values filled in (the lab's left empty)."""
    rows = []

    def run(driver, case, extra, seed, mtu=DEFAULT_MTU_BYTES):
        r = run_htsim(src, driver, case, extra, mtu, case.buffer_bytes // mtu, seed,
                      link_latency_ns, keep)
        if r.lossless_overrun_kb:
            notes.append(f"{driver} ({case.experiment}, seed {seed}): a lossless queue held up "
                         f"to {r.lossless_overrun_kb:.0f} KB, past its "
                         f"{case.buffer_bytes // 1024} KB (htsim warns and keeps the packets: "
                         f"its PFC thresholds count per input port, with no headroom check)")
        return r

    def last_over_ideal(r: HtsimRun, case: CaseInput, mtu: int) -> float:
        payload = mtu - HEADER_BYTES if r.driver == "htsim_eqds" else mtu
        last = max(t for v in r.completions_us.values() for t in v)
        return last / (ideal_s(case.fabric, case.flows, payload, HEADER_BYTES, True) * 1e6)

    def fairness(r: HtsimRun, case: CaseInput) -> float:
        """Each flow's goodput over its life (size / completion): max over mean."""
        sizes = defaultdict(list)
        for f in case.flows:
            sizes[f.src, f.dst].append(f.size_bytes)
        return max_over_mean([n / t for pair, times in r.completions_us.items()
                              for n, t in zip(sorted(sizes[pair]), sorted(times))])

    roce_pfc = roce_pfc_args()

    def ndp_window(case: CaseInput) -> list[str]:
        return ndp_window_args(case, link_latency_ns)

    if "incast" in cases:
        i, t, u = inputs["incast"], inputs["trimming"], inputs["incast-uet"]
        for lab_m, driver, mech, case, extra, mtu in (
                ("incast pfc: RC+PFC", "htsim_roce", "RoCE+PFC (lossless_input)", i, roce_pfc,
                 DEFAULT_MTU_BYTES),
                ("trimming trim: MRC", "htsim_ndp", "NDP (trimming)", t,
                 ["-strat", "ecmp_host", "-paths", "1", *ndp_window(t)], DEFAULT_MTU_BYTES),
                ("incast rccc: MRC+RCCC", "htsim_eqds", "EQDS (credit)", u,
                 ["-strat", "ecmp_host", "-paths", "1"], eqds_mtu)):
            r = run(driver, case, extra, SEED_DEFAULT, mtu)
            print(f"  incast {driver}: last {max(max(v) for v in r.completions_us.values()):.1f}"
                  f" us", flush=True)
            rows.append(Row("incast", lab_m, mech, "last done / ideal",
                            htsim=[last_over_ideal(r, case, mtu)]))
            rows.append(Row("incast", lab_m, mech, "goodput max/mean",
                            htsim=[fairness(r, case)]))
    if "ecmp" in cases:
        e = inputs["ecmp-vs-spray"]
        per_seed = defaultdict(list)
        for seed in range(1, seeds + 1):
            per_seed["roce"].append(last_over_ideal(run("htsim_roce", e, roce_pfc, seed), e,
                                                    DEFAULT_MTU_BYTES))
            for variant, paths in ECMP_SPRAYED_VARIANTS.items():
                spray = ["-strat", "ecmp_host", "-paths", str(paths)]
                per_seed["ndp", paths].append(last_over_ideal(
                    run("htsim_ndp", e, spray + ndp_window(e), seed), e, DEFAULT_MTU_BYTES))
                per_seed["eqds", paths].append(last_over_ideal(
                    run("htsim_eqds", e, spray, seed, eqds_mtu), e, eqds_mtu))
            print(f"  ecmp seed {seed}: " + ", ".join(
                f"{k if isinstance(k, str) else f'{k[0]}/{k[1]} paths'} {v[-1]:.2f}"
                for k, v in per_seed.items()), flush=True)
        for variant in ECMP_PINNED_VARIANTS:
            rows.append(Row("ecmp", f"ecmp-vs-spray {variant}", "RoCE+PFC, ECMP per flow",
                            "slowest / ideal", htsim=per_seed["roce"]))
        for variant, paths in ECMP_SPRAYED_VARIANTS.items():
            for key, mech in ((("ndp", paths), "NDP"), (("eqds", paths), "EQDS")):
                rows.append(Row("ecmp", f"ecmp-vs-spray {variant}",
                                f"{mech}, sprayed on {paths} paths", "slowest / ideal",
                                htsim=per_seed[key]))
    return rows


# --- the lab -----------------------------------------------------------------------------
def experiments_for(cases: list[str]) -> list[str]:
    return (["incast", "trimming"] if "incast" in cases else []) + \
        (["ecmp-vs-spray"] if "ecmp" in cases else [])


def run_lab(experiments: list[str], out: Path, fabriclab: Path,
            notes: list[str]) -> dict[str, Path | None]:
    """Each experiment by the lab's CLI (root; minutes each): OUT/NAME/metrics.json. A run
    exits 1 when a claim fails and still writes its metrics; one that wrote none is noted
    and its rows stay empty."""
    runs = {}
    for name in experiments:
        cmd = [str(fabriclab), "run", name, "--out", str(out / name)]
        for s in LAB_RUNS[name]:
            cmd += ["--set", s]
        print(f"lab: {' '.join(cmd)}", flush=True)
        rc = subprocess.run(cmd).returncode
        runs[name] = out / name if (out / name / "metrics.json").exists() else None
        if runs[name] is None:
            notes.append(f"lab {name}: no metrics.json (fabriclab run exited {rc})")
    return runs


def lab_values(rows: list[Row], runs: dict[str, Path | None], inputs: dict[str, CaseInput],
               notes: list[str]) -> None:
    """Fill in each row's lab value from the runs' metrics.json (with the same ideal as
    htsim's: ideal_s on the lab's rates and frames)."""
    metrics = {name: json.loads((run / "metrics.json").read_text())["metrics"]
               for name, run in runs.items() if run is not None}
    rc_hdr, mrc_hdr = WRITE_OVERHEAD_BYTES, DATA_OVERHEAD_BYTES

    def ratio(case: CaseInput, last_s, header) -> float | None:
        return last_s / ideal_s(case.fabric, case.flows, DEFAULT_MTU_BYTES, header, False) \
            if last_s else None

    for row in rows:
        if row.case == "incast":
            exp, variant, header = {"incast pfc: RC+PFC": ("incast", "pfc", rc_hdr),
                                    "trimming trim: MRC": ("trimming", "trim", mrc_hdr),
                                    "incast rccc: MRC+RCCC": ("incast", "rccc", mrc_hdr)
                                    }[row.lab_mechanism]
        else:
            exp, variant = "ecmp-vs-spray", row.lab_mechanism.split()[-1]
            header = rc_hdr if variant.startswith("rc") else mrc_hdr
        case = inputs["incast-uet" if variant in INCAST_UET_VARIANTS else exp]
        m = metrics.get(exp, {}).get(variant)
        if m is None:
            row.lab_note = "no run" if exp not in metrics else "not in the run"
            continue
        if row.metric == "goodput max/mean":
            goodput = list(m.get("sender_goodput_pps", {}).values())
            row.lab = max_over_mean(goodput) if goodput and sum(goodput) > 0 else None
            row.lab_note = "" if row.lab else "not recorded"
        else:
            row.lab = ratio(case, m.get("completion_s_max"), header)
            row.lab_note = "" if row.lab else "did not finish"
    for name, m in metrics.items():
        if m.get("cpu_bound_hosts"):
            notes.append(f"lab {name}: hosts {', '.join(m['cpu_bound_hosts'])} were CPU-bound "
                         f"(their timings are not faithful)")


# --- the table ---------------------------------------------------------------------------
def fmt(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    if len(values) == 1:
        return f"{lo:.3f}"
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}-{hi:.2f}"


def print_table(rows: list[Row]) -> None:
    print(f"\n{'case':<7} {'lab':<27} {'htsim':<27} {'metric':<18} {'lab':>13} "
          f"{'htsim':>11} {'lab/htsim':>9}")
    for r in rows:
        lab = f"{r.lab:.3f}" if r.lab is not None else (r.lab_note or "-")
        ratio = r.ratio()
        flag = f"  DISAGREE (>{TOLERANCE:.0%})" if r.disagrees() else ""
        print(f"{r.case:<7} {r.lab_mechanism:<27} {r.htsim_mechanism:<27} {r.metric:<18} "
              f"{lab:>13} {fmt(r.htsim):>11} {f'{ratio:.2f}' if ratio else '-':>9}{flag}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--htsim-src", type=Path, metavar="DIR",
                    help=f"a checkout of {HTSIM_REPO} (default: {CACHE_DIR}/csg-htsim)")
    ap.add_argument("--build", action="store_true",
                    help="clone htsim into the cache (without --htsim-src), patch out its "
                         "clock seeding, build (make is incremental: a built tree is reused)")
    ap.add_argument("--jobs", type=int, default=1, help="make -jN (default 1)")
    ap.add_argument("--only", choices=CASES, action="append", help="one case (repeatable)")
    ap.add_argument("--seeds", type=int, default=3, help="htsim seeds for the ecmp case")
    ap.add_argument("--link-latency-ns", type=int, default=htsim.LINK_LATENCY_NS,
                    help="htsim's per-link latency (the lab's links have none; htsim needs "
                         "> 0)")
    ap.add_argument("--eqds-mtu", type=int, default=EQDS_MTU_BYTES, metavar="BYTES",
                    help="EQDS's packet, header included (its pull pacing assumes 4 KB)")
    ap.add_argument("--lab-results", type=Path, metavar="DIR",
                    help="existing lab runs: DIR/NAME or the newest DIR/NAME-* per experiment")
    ap.add_argument("--no-lab", action="store_true", help="htsim's side only")
    ap.add_argument("--out", type=Path, help="where the lab runs go (default "
                                             "results/htsim-compare-TIME)")
    ap.add_argument("--fabriclab", type=Path, default=ROOT / ".venv" / "bin" / "fabriclab",
                    metavar="PATH", help="the lab's CLI (default: the repository's venv)")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep htsim's files there: topology, matrix, command, output")
    a = ap.parse_args()
    cases = a.only or list(CASES)
    src = build_htsim(a.htsim_src, a.jobs) if a.build else find_htsim(a.htsim_src)
    notes = []
    if seed_patched(src):
        notes.append(f"htsim at {src} is built with srand(time(NULL)) removed from "
                     f"{' and '.join(SEED_PATCH_FILES)}: RoCE's ECMP paths follow -seed")
    elif "ecmp" in cases:
        notes.append("htsim's RoCE seeds its ECMP paths from the clock (not patched: pass "
                     "--build): its pinned runs differ from run to run whatever -seed says")
    experiments = experiments_for(cases)
    runs: dict[str, Path | None] = {name: None for name in experiments}
    if a.lab_results:
        runs = {name: lab_run_dir(a.lab_results, name) for name in experiments}
    elif not a.no_lab:
        out = a.out or ROOT / "results" / f"htsim-compare-{time.strftime('%Y%m%d-%H%M%S')}"
        runs = run_lab(experiments, out, a.fabriclab, notes)
    inputs = {name: case_input(name, runs[name]) for name in experiments}
    if "incast" in inputs:
        inputs["incast-uet"] = case_input("incast", runs["incast"], uet=True)
    for name, c in inputs.items():
        s = htsim.leaf_spine_shape(c.fabric)
        print(f"{name}: spines={s.spines} leaves={s.leaves} hosts_per_leaf="
              f"{s.hosts_per_leaf} at {s.host_link_gbps} Gb/s, {len(c.flows)} flows of "
              f"{c.flows[0].size_bytes} B, {c.buffer_bytes // 1024} KB queues "
              f"(from {c.source})", flush=True)
    rows = htsim_side(cases, src, inputs, a.seeds, a.link_latency_ns, a.eqds_mtu, notes,
                      a.keep)
    if any(runs.values()):
        lab_values(rows, runs, inputs, notes)
    print_table(rows)
    print(f"\nideal: the frames that must cross the most loaded link at its rate (lab: "
          f"{DEFAULT_MTU_BYTES} B + {WRITE_OVERHEAD_BYTES} B per RC packet, + "
          f"{DATA_OVERHEAD_BYTES} B per MRC packet, the lab's rates; htsim: payload + "
          f"{HEADER_BYTES} B, real rates); htsim links {a.link_latency_ns} ns, EQDS packets "
          f"{a.eqds_mtu} B; goodput max/mean: lab over the incast's steady window, htsim "
          f"over each flow's life; DISAGREE: the lab more than {TOLERANCE:.0%} outside "
          f"htsim's range")
    for n in dict.fromkeys(notes):
        print(f"note: {n}")
    if a.json:
        a.json.write_text(json.dumps([{**vars(r), "ratio": r.ratio(),
                                       "disagrees": r.disagrees()} for r in rows], indent=1))


if __name__ == "__main__":
    main()
