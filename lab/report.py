"""A run's report: report.md and a self-contained report.html, with PNG plots.

    report.write(workdir, result)   # result: what metrics.json holds

What it shows, when the run has it: the parameters; the claims with pass/fail;
a table of each variant's numbers; the training step's compute vs waiting; the
busiest queues' backlog over time (queues.csv); each variant's per-flow sending
rates (flows-VARIANT.csv); bytes per spine uplink and retransmissions per
variant; how to open the captures.
"""
from __future__ import annotations

import base64
import csv
import html
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from lab import readable

PLOTS = "plots"
QUEUES_SHOWN = 4
POINTS_SHOWN = 1200     # per line: about the plot's width in pixels, peaks kept (thin)
# a variant section's [start, end] in unix time (the span its counters cover): the queue
# plot gives each such variant its own panel
SPAN_KEY = "counted_unix_s"


# --- data ------------------------------------------------------------------------------
def variants(metrics: dict) -> dict[str, dict]:
    """The metrics' per-variant sections: dicts holding scalar measurements; an
    experiment without variants is one section, "run", of its own scalars."""
    sections = {k: v for k, v in metrics.items()
                if isinstance(v, dict) and k not in ("telemetry", "captures")
                and len(scalars(v)) >= 2}
    if not sections and len(scalars(metrics)) >= 2:
        return {"run": metrics}
    return sections


def scalars(section: dict) -> dict[str, float]:
    return {k: v for k, v in section.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def queue_series(workdir: Path, keys: list[str]) -> dict[str, tuple[list[float], list[int]]]:
    path = workdir / "queues.csv"
    out: dict[str, tuple[list[float], list[int]]] = {k: ([], []) for k in keys}
    if not path.exists():
        return {}
    with open(path) as f:
        for row in csv.DictReader(f):
            key = f"{row['switch']}:{row['port']}:{row['priority']}"
            if key in out:
                out[key][0].append(float(row["t"]))
                out[key][1].append(int(row["backlog_bytes"]))
    return {k: v for k, v in out.items() if v[0]}


def flow_series(path: Path) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            t, r = out.setdefault(f"{row['src']}->{row['dst']}", ([], []))
            t.append(float(row["t"]))
            r.append(float(row["rate_mbps"]))
    return out


# --- plots -----------------------------------------------------------------------------
def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return plt, fig, ax


def thin(points: list[tuple[float, float]], n: int = POINTS_SHOWN) -> list[tuple[float, float]]:
    """At most about 2n points of a time series, in n equal time bins: each bin's first
    point and its highest, so no peak is lost. A 5 ms queue series of a minute is 12k
    points a line, far more than a plot's pixels, and drawing them is most of a report's
    time on a slow machine."""
    if len(points) <= 2 * n:
        return points
    t0, t1 = points[0][0], points[-1][0]
    width = (t1 - t0) / n or 1.0
    out, i = [], 0
    while i < len(points):
        end = points[i][0] + width
        j = i
        while j < len(points) and points[j][0] < end:
            j += 1
        j = max(j, i + 1)
        top = max(points[i:j], key=lambda p: p[1])
        out += [points[i]] if top is points[i] else [points[i], top]
        i = j
    if out[-1] is not points[-1]:
        out.append(points[-1])
    return out


def _save(plt, fig, path: Path, rect: tuple | None = None) -> Path:
    fig.tight_layout(rect=rect)
    fig.savefig(path)
    plt.close(fig)
    return path


def variant_spans(result: dict) -> dict[str, tuple[float, float]]:
    """variant -> (start, end) in unix time (queues.csv's clock), for the variants that
    record the span their counters cover (counted_unix_s)."""
    return {v: tuple(s[SPAN_KEY]) for v, s in variants(result["metrics"]).items()
            if isinstance(s.get(SPAN_KEY), list) and len(s[SPAN_KEY]) == 2}


def plot_queues(workdir: Path, result: dict, out: Path) -> Path | None:
    """The busiest queues' backlog over time: one panel per variant when the variants
    say when they ran (each on its own time axis from its start, so that no one has to
    guess which stretch of a shared axis was which), else one panel for the run."""
    busiest = [k for k, q in result["metrics"].get("telemetry", {})
               .get("busiest_queues", {}).items() if q.get("backlog_bytes_max")]
    series = queue_series(workdir, busiest[:QUEUES_SHOWN])
    if not series:
        return None
    by_variant = variant_spans(result)
    spans = by_variant or {"": (min(t[0] for t, _ in series.values()),
                                max(t[-1] for t, _ in series.values()))}
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(spans), 1, figsize=(8, 1.2 + 2.2 * len(spans)), dpi=100,
                             sharey=True, squeeze=False)
    fig.suptitle("Queue backlog, busiest queues (switch:port:priority)")
    for ax, (variant, (start, end)) in zip(axes[:, 0], spans.items()):
        for i, (key, (t, b)) in enumerate(series.items()):
            # the sample before the span holds the backlog at its start
            first = max(0, next((j for j, x in enumerate(t) if x >= start), len(t)) - 1)
            shown = [(x, y) for x, y in zip(t[first:], b[first:]) if x <= end]
            if shown:   # a row is written on a change: the last value holds to the end
                shown = thin(shown) + [(end, shown[-1][1])]
            ax.step([max(x, start) - start for x, _ in shown], [y / 1024 for _, y in shown],
                    where="post", label=key, lw=0.8, color=f"C{i}")
        if variant:
            ax.set_title(f"variant {variant}", fontsize=10, loc="left")
        ax.set_xlim(0, end - start)
        ax.set_ylabel("backlog (KB)")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("time since the variant started (s)" if by_variant else "time (s)")
    axes[0, 0].legend(fontsize=8)
    return _save(plt, fig, out / "queues.png")


def plot_flow_rates(csv_path: Path, out: Path) -> Path | None:
    series = flow_series(csv_path)
    if not series:
        return None
    variant = csv_path.stem.removeprefix("flows-")
    t0 = min(t[0] for t, _ in series.values())
    plt, fig, ax = _figure(f"Per-flow sending rate, {variant}", "time (s)", "rate (Mb/s)")
    for name, (t, r) in sorted(series.items()):
        # a 50 ms moving average: the 10 ms samples are a few packets each
        k = 5
        smooth = [sum(r[max(0, i - k + 1):i + 1]) / len(r[max(0, i - k + 1):i + 1])
                  for i in range(len(r))]
        shown = thin([(x - t0, y) for x, y in zip(t, smooth)])
        ax.plot([x for x, _ in shown], [y for _, y in shown], lw=0.8, label=name)
    if len(series) <= 10:
        ax.legend(fontsize=7, ncol=2)
    return _save(plt, fig, out / f"rates-{variant}.png")


def plot_bars(result: dict, key: str, title: str, ylabel: str, out: Path) -> Path | None:
    """A bar per variant (a list value: a group of bars per variant)."""
    data = {v: s[key] for v, s in variants(result["metrics"]).items() if key in s}
    if not data:
        return None
    plt, fig, ax = _figure(title, "", ylabel)
    names = list(data)
    if all(isinstance(x, list) for x in data.values()):
        width = 0.8 / max(len(x) for x in data.values())
        for i, name in enumerate(names):
            for j, value in enumerate(data[name]):
                ax.bar(i + (j - (len(data[name]) - 1) / 2) * width, value, width * 0.9,
                       color=f"C{j}", label=f"link {j}" if i == 0 else None)
        ax.legend(fontsize=8)
    else:
        ax.bar(range(len(names)), [data[n] for n in names], color="C0")
    ax.set_xticks(range(len(names)), names)
    return _save(plt, fig, out / f"{key}.png")


def plot_step_breakdown(result: dict, out: Path) -> Path | None:
    """Per variant, the mean step: compute, then waiting on the network."""
    data = {v: s for v, s in variants(result["metrics"]).items()
            if "step_s_mean" in s and "allreduce_s_mean" in s}
    if not data:
        return None
    plt, fig, ax = _figure("Mean training step: compute vs waiting on the all-reduce", "",
                           "time (ms)")
    names = list(data)
    comm = [data[n]["allreduce_s_mean"] * 1e3 for n in names]
    compute = [(data[n]["step_s_mean"] - data[n]["allreduce_s_mean"]) * 1e3 for n in names]
    ax.bar(range(len(names)), compute, color="C2", label="compute")
    ax.bar(range(len(names)), comm, bottom=compute, color="C3", label="waiting on the network")
    for i, n in enumerate(names):
        ax.text(i, compute[i] + comm[i], f"idle {data[n]['idle_fraction_mean']:.0%}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=8)
    return _save(plt, fig, out / "step_breakdown.png")


def plot_phase_breakdown(result: dict, out: Path) -> Path | None:
    """Per variant, the mean step by phase (training-job's `phase_s_mean`: compute, the
    parallelisms' communication), and the step the alpha-beta model predicts."""
    data = {v: s for v, s in variants(result["metrics"]).items() if "phase_s_mean" in s}
    if not data:
        return None
    plt, fig, ax = _figure("Mean training step by phase", "", "time (ms)")
    names = list(data)
    phases = list(dict.fromkeys(k for s in data.values() for k in s["phase_s_mean"]))
    bottom = [0.0] * len(names)
    for j, ph in enumerate(phases):
        ms = [data[n]["phase_s_mean"].get(ph, 0.0) * 1e3 for n in names]
        ax.bar(range(len(names)), ms, bottom=bottom, color=f"C{j}", label=ph)
        bottom = [b + x for b, x in zip(bottom, ms)]
    for i, n in enumerate(names):
        model = data[n].get("model_s", {}).get("step")
        if model is not None:
            ax.plot([i - 0.4, i + 0.4], [model * 1e3] * 2, "k--", lw=1,
                    label="model (bandwidth terms)" if i == 0 else None)
        ax.text(i, bottom[i], f"idle {data[n]['idle_fraction_mean']:.0%}", ha="center",
                va="bottom", fontsize=8)
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=8, loc="upper left")
    return _save(plt, fig, out / "phase_breakdown.png")


WAIT_CAUSES = {"agents": "C7", "wire": "C2", "paused": "C1", "retransmission": "C3",
               "slow_path": "C4"}      # lab/experiments/waits.py's causes, in its order


def plot_wait_causes(result: dict, out: Path) -> Path | None:
    """Per variant, the mean wait per step split by cause (`wait_causes_mean`), with the
    evidence counted over its steps (CNPs, retransmissions, pause frames)."""
    data = {v: s for v, s in variants(result["metrics"]).items()
            if s.get("wait_causes_mean") and isinstance(s.get("steps"), list)}
    if not data:
        return None
    plt, fig, ax = _figure("Why the GPUs waited: mean wait per step, by cause", "",
                           "time (ms)")
    names = list(data)
    bottom = [0.0] * len(names)
    for cause, color in WAIT_CAUSES.items():
        ms = [data[n]["wait_causes_mean"].get(cause, 0.0) * 1e3 for n in names]
        ax.bar(range(len(names)), ms, bottom=bottom, color=color, label=cause)
        bottom = [b + x for b, x in zip(bottom, ms)]
    for i, n in enumerate(names):
        seen = {k: sum(s.get("wait_evidence", {}).get(k, 0) for s in data[n]["steps"])
                for k in ("cnps", "retransmitted", "pause_frames")}
        text = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in seen.items() if v)
        ax.text(i, bottom[i], text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)
    ax.legend(fontsize=8, loc="upper left")
    return _save(plt, fig, out / "wait_causes.png")


PHASE_COLORS = ("C1", "C3", "C4", "C0", "C5", "C6", "C8", "C9")   # compute is C2


def plot_step_timeline(workdir: Path, result: dict, out: Path) -> Path | None:
    """Per variant, its steps on the lab's clock: each phase as a span (compute, then
    the communication phases), the phases' evidence above them, and below, the backlog
    of the queues that were busiest during that variant: which wait met which queue."""
    data = {v: s for v, s in variants(result["metrics"]).items()
            if isinstance(s.get("steps"), list) and s["steps"]
            and all("t0_unix" in st for st in s["steps"])}
    if not data:
        return None
    busiest = list(result["metrics"].get("telemetry", {}).get("busiest_queues", {}))
    series = queue_series(workdir, busiest)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2 * len(data), 1, figsize=(8, 0.8 + 2.6 * len(data)), dpi=100,
                             gridspec_kw={"height_ratios": [1, 2] * len(data)}, squeeze=False)
    fig.suptitle("Why the GPUs waited: steps, phases and the busiest queues over time")
    kinds: dict[str, str] = {}
    for k, (variant, section) in enumerate(data.items()):
        top, low = axes[2 * k, 0], axes[2 * k + 1, 0]
        steps = section["steps"]
        start = steps[0]["t0_unix"]
        end = max(ph["t0_unix"] + ph["s"] for st in steps for ph in st["phases"])
        for st in steps:
            for ph in st["phases"]:
                kind = "compute" if ph["phase"] == "compute" else ph["phase"].rstrip("0123456789")
                kinds.setdefault(kind, "C2" if kind == "compute" else
                                 PHASE_COLORS[(len(kinds) - 1) % len(PHASE_COLORS)])
                top.broken_barh([(ph["t0_unix"] - start, ph["s"])], (0, 1), color=kinds[kind])
                seen = ph.get("evidence", {})
                marks = [f"{seen[key]}{label}" for key, label in
                         (("retransmitted", "R"), ("cnps", "C"), ("pause_frames", "P"),
                          ("ev_retirements", "E"))
                         if seen.get(key)]
                if marks:
                    top.text(ph["t0_unix"] - start, 1.05, " ".join(marks), fontsize=6)
        top.set_xlim(0, end - start)
        top.set_ylim(0, 1.6)
        top.set_yticks([])
        top.set_title(f"variant {variant}", fontsize=10, loc="left")
        peaks = {key: max((b for t, b in zip(*series[key]) if start <= t <= end), default=0)
                 for key in series}
        for i, key in enumerate(sorted((q for q in peaks if peaks[q]), key=peaks.get,
                                       reverse=True)[:3]):
            t, b = series[key]
            first = max(0, next((j for j, x in enumerate(t) if x >= start), len(t)) - 1)
            shown = [(x, y) for x, y in zip(t[first:], b[first:]) if x <= end]
            if shown:
                shown = thin(shown) + [(end, shown[-1][1])]
                low.step([max(x, start) - start for x, _ in shown],
                         [y / 1024 for _, y in shown], where="post", lw=0.8, label=key,
                         color=f"C{i}")
        low.set_xlim(0, end - start)
        low.set_ylabel("backlog (KB)", fontsize=8)
        low.grid(alpha=0.3)
        if low.lines:
            low.legend(fontsize=6, loc="upper right")
    axes[-1, 0].set_xlabel("s since the variant's first step; above a phase: R resent, "
                           "C CNPs, P pauses, E EVs retired")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in kinds.values()],
               labels=list(kinds), fontsize=7, loc="lower center", ncol=len(kinds))
    return _save(plt, fig, out / "step_timeline.png", rect=(0, 0.03, 1, 1))


EV_STATE_COLORS = {"good": "C2", "assumed_bad": "C3", "probing": "C1", "denied": "C7"}


def plot_ev_states(result: dict, variant: str, out: Path) -> Path | None:
    """MRC's EV states over time (link-failure's and plane-failure's `ev_changes`, ms
    since the variant started): a row per QP and EV that changed, its state as a colored
    span from each change to the next, the failure and (plane-failure) the repair. An EV
    is good until its first change."""
    section = variants(result["metrics"]).get(variant, {})
    changes = section.get("ev_changes")
    if not changes:
        return None
    rows: dict[tuple, list[dict]] = {}
    for c in changes:
        rows.setdefault((c["qp"], c["ev"]), []).append(c)
    end_ms = max(section.get("completion_s", 0) * 1e3, max(c["t_ms"] for c in changes) + 1)
    plt, fig, ax = _figure(f"EV states over time ({variant})", "ms since the variant started",
                           "")
    for y, (key, cs) in enumerate(sorted(rows.items())):
        spans = [(0.0, "good")] + [(c["t_ms"], c["state"]) for c in cs]
        for (t, state), nxt in zip(spans, [t for t, _ in spans[1:]] + [end_ms]):
            ax.barh(y, max(nxt - t, end_ms / 500), left=t, color=EV_STATE_COLORS[state],
                    height=0.6)
    ax.set_yticks(range(len(rows)), [f"QP {q} EV {ev}" for q, ev in sorted(rows)])
    what = section.get("failed_what", "the link")
    for key, label in (("failed_at_s", f" {what} fails"), ("restored_at_s", f" {what} is back")):
        if key in section:
            ax.axvline(section[key] * 1e3, color="k", ls="--", lw=1)
            ax.text(section[key] * 1e3, -0.45, label, fontsize=8, va="bottom")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in EV_STATE_COLORS.values()],
              labels=list(EV_STATE_COLORS), fontsize=8, loc="upper left")
    return _save(plt, fig, out / f"ev_states_{variant}.png")


def make_plots(workdir: Path, result: dict) -> list[tuple[str, Path]]:
    out = workdir / PLOTS
    out.mkdir(exist_ok=True)
    jobs = [("Step time: compute vs waiting", plot_step_breakdown, (result, out)),
            ("Step time by phase", plot_phase_breakdown, (result, out)),
            ("Why the GPUs waited", plot_wait_causes, (result, out)),
            ("Steps and queues over time", plot_step_timeline, (workdir, result, out)),
            ("Queue backlog over time", plot_queues, (workdir, result, out))]
    for path in sorted(workdir.glob("flows-*.csv")):
        jobs.append((f"Per-flow rates ({path.stem.removeprefix('flows-')})",
                     plot_flow_rates, (path, out)))
    jobs.append(("Bytes per spine uplink", plot_bars,
                 (result, "bytes_per_spine_uplink", "Bytes per spine uplink", "bytes", out)))
    jobs.append(("Retransmissions", plot_bars,
                 (result, "retransmitted_packets", "Retransmitted packets per variant",
                  "packets", out)))
    for v in variants(result["metrics"]):
        jobs.append((f"EV states over time ({v})", plot_ev_states, (result, v, out)))
    paths = _draw_all([(fn, args) for _, fn, args in jobs])
    return [(title, p) for (title, *_), p in zip(jobs, paths) if p is not None]


def _draw(job: tuple) -> Path | None:
    fn, args = job
    return fn(*args)


def _draw_all(jobs: list[tuple]) -> list[Path | None]:
    """Each plot drawn by a process of its own, as many at once as there are CPUs:
    drawing is most of a report's time, single-threaded, and nothing else runs while a
    report is written (a software CPU took 19-67 s per chapter's report, one CPU of two
    idle). Forked after matplotlib's import, which the children share instead of
    repeating it (1 s natively, ~15 s on a software CPU)."""
    workers = min(len(jobs), os.cpu_count() or 1)
    if workers < 2:
        return [_draw(j) for j in jobs]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401  (imported once, before the fork)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_draw, jobs))


# --- documents -------------------------------------------------------------------------
def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) for the report's tables."""
    claims = [[readable.verdict(c), c["name"], readable.claim_measured(c),
               str(c["expected"])] for c in result["claims"]]
    out = [("Claims", ["", "claim", "measured", "expected"], claims)]
    params = {**result["params"], **{f"topology.{k}": v for k, v in result["topology"].items()}}
    out.append(("Parameters", ["parameter", "value"],
                [[k, _fmt(v)] for k, v in params.items()]))
    sections = variants(result["metrics"])
    if sections:    # a row per measurement, a column per variant: any number of each fits
        keys: list[str] = []
        for s in sections.values():
            keys += [k for k in scalars(s) if k not in keys]
        out.append(("Measurements", ["measurement", *sections],
                    [[k, *(_fmt(scalars(s).get(k, "")) for s in sections.values())]
                     for k in keys]))
    return out


def captures_text(result: dict) -> list[str]:
    """The pcaps (relative links), what they keep, and per Wireshark display filter the
    frames tshark counts in each."""
    caps = result["metrics"].get("captures")
    if not caps:
        return []
    ports = caps["ports"]
    lines = [f"- [`captures/{Path(c['file']).name}`](captures/{Path(c['file']).name}) "
             f"({c['bytes']:,} bytes" + (f"; tcpdump dropped {c['dropped_by_tcpdump']}"
                                          if c.get("dropped_by_tcpdump") else "")
             + (f"; cut short at {c['packet_cap']:,} frames: raise --capture-mb"
                if c.get("reached_cap") else "") + ")"
             for c in ports.values()]
    keeps = caps.get("keeps")
    if keeps:
        lines += ["", f"They hold {keeps}" + (f", the first {caps['snaplen']} bytes of each"
                                              if caps.get("snaplen") else "") + "."]
    filters = caps.get("filters", {})
    if filters and any(c.get("counts") for c in ports.values()):
        names = list(ports)
        lines += ["", "| display filter | what it shows | " + " | ".join(names) + " |",
                  "|---|---|" + "---|" * len(names)]
        for what, expr in filters.items():
            counts = [str((ports[n].get("counts") or {}).get(what, "?")) for n in names]
            lines.append(f"| `{expr}` | {what} | " + " | ".join(counts) + " |")
    return lines + ["", f"Open them with the lab's dissector: `{caps['open_with']}`; "
                        f"display filter for CNPs, CE marks and pause frames: "
                        f"`{caps['display_filter']}`"]


def captures_html(caps: dict) -> str:
    esc = html.escape
    ports = caps["ports"]
    out = ["<ul>"] + [f"<li><a href='captures/{esc(Path(c['file']).name)}'>"
                      f"captures/{esc(Path(c['file']).name)}</a> ({c['bytes']:,} bytes)</li>"
                      for c in ports.values()] + ["</ul>"]
    if caps.get("keeps"):
        out.append(f"<p>They hold {esc(caps['keeps'])}"
                   + (f", the first {caps['snaplen']} bytes of each" if caps.get("snaplen")
                      else "") + ".</p>")
    filters = caps.get("filters", {})
    if filters and any(c.get("counts") for c in ports.values()):
        out.append("<table><tr><th>display filter</th><th>what it shows</th>"
                   + "".join(f"<th>{esc(n)}</th>" for n in ports) + "</tr>")
        for what, expr in filters.items():
            out.append(f"<tr><td><code>{esc(expr)}</code></td><td>{esc(what)}</td>"
                       + "".join(f"<td>{(c.get('counts') or {}).get(what, '?')}</td>"
                                 for c in ports.values()) + "</tr>")
        out.append("</table>")
    out.append(f"<p>Open them with the lab's dissector: <code>{esc(caps['open_with'])}</code>"
               f"</p>")
    return "".join(out)


def machine_text(result: dict) -> str:
    """The factor the run's defaults ran at on this machine (lab/fabric/calibrate.py)."""
    f = result.get("machine_factor", 1.0)
    return ("Ran at the defaults (machine factor x1.00)." if f >= 1 else
            f"Ran at machine factor x{f:.2f}: the default link rates and sizes scaled to "
            f"what this machine's GPU hosts keep up with (fabriclab calibrate).")


def markdown(result: dict, plots: list[tuple[str, Path]]) -> str:
    verdict = "all claims hold" if result["passed"] else "A CLAIM FAILED"
    md = [f"# {result['experiment']}: {verdict}", "",
          f"Rate scale: {result['rate_scale']['meaning']}. {machine_text(result)} "
          f"OVS datapath: {result.get('datapath')}. Total time "
          f"{result['timings_s']['total_s']:.1f} s.", ""]
    md += [f"> warning: {w}" for w in result.get("warnings", [])]
    for title, header, rows in tables(result):
        md += [f"## {title}", "", "| " + " | ".join(header) + " |",
               "|" + "---|" * len(header)]
        md += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        md.append("")
    for title, path in plots:
        md += [f"## {title}", "", f"![{title}]({PLOTS}/{path.name})", ""]
    caps = captures_text(result)
    if caps:
        md += ["## Captures", "", *caps, ""]
    md += ["Files: `metrics.json` (everything above), `queues.csv`, `config.json`, "
           "`fabric.json`, `logs/`."]
    return "\n".join(md) + "\n"


def html_page(result: dict, plots: list[tuple[str, Path]]) -> str:
    esc = html.escape
    body = [f"<h1>{esc(result['experiment'])}: "
            f"{'all claims hold' if result['passed'] else 'A CLAIM FAILED'}</h1>",
            f"<p>Rate scale: {esc(result['rate_scale']['meaning'])}. "
            f"{esc(machine_text(result))} OVS datapath: "
            f"{esc(str(result.get('datapath')))}.</p>"]
    body += [f"<p class=warn>warning: {esc(w)}</p>" for w in result.get("warnings", [])]
    for title, header, rows in tables(result):
        body.append(f"<h2>{esc(title)}</h2><table><tr>"
                    + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>")
        for row in rows:
            cls = {"PASS": " class=pass", "FAIL": " class=fail"}.get(str(row[0]).split(" ")[0], "")
            body.append(f"<tr{cls}>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>")
        body.append("</table>")
    for title, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        body.append(f"<h2>{esc(title)}</h2><img alt='{esc(title)}' "
                    f"src='data:image/png;base64,{data}'>")
    caps = result["metrics"].get("captures")
    if caps:
        body.append("<h2>Captures</h2>" + captures_html(caps))
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #ccc;"
             "padding:2px 6px}.pass td:first-child{color:#070}.fail td:first-child"
             "{color:#b00;font-weight:bold}.warn{color:#b60}img{max-width:100%}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>"
            f"{esc(result['experiment'])}</title><style>{style}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write(workdir: Path, result: dict) -> tuple[Path, Path]:
    workdir = Path(workdir)
    plots = make_plots(workdir, result)
    md, page = workdir / "report.md", workdir / "report.html"
    md.write_text(markdown(result, plots))
    page.write_text(html_page(result, plots))
    return md, page


def main() -> None:
    """python -m lab.report RESULTS_DIR: (re)write a finished run's report."""
    import sys
    workdir = Path(sys.argv[1])
    md, page = write(workdir, json.loads((workdir / "metrics.json").read_text()))
    print(f"{md}\n{page}")


if __name__ == "__main__":
    main()
