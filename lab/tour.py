"""`fabriclab tour`: the lab's story in order, one experiment per chapter.

Each chapter is an ordinary experiment run (its own results directory, report
and claims); the tour adds the order, a sentence on what each chapter shows,
and one index (index.html, index.md, tour.json) that links the chapters'
reports. A chapter that cannot run is reported and the tour goes on.
"""
from __future__ import annotations

import html
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from lab import readable, runner
from lab.core import console
from lab.core.errors import LabError

log = logging.getLogger(__name__)
RESULTS_DIR = runner.RESULTS_DIR


# Every chapter whose point shows on the wire records pcaps of the ports its experiment
# names (capture_plan), headers only, within these budgets: 20 MB for the whole tour.
CAPTURE_SNAPLEN = 128        # Ethernet to the RoCE extension headers; payload cut
CAPTURE_MB = {"incast": 7.0, "pfc-spreading": 4.0, "ecmp-vs-spray": 5.0, "loss-recovery": 4.0}


@dataclass(frozen=True)
class Chapter:
    title: str
    experiment: str
    settings: tuple[str, ...]
    story: str                       # what the chapter shows, for the index


CHAPTERS = (
    Chapter("Four GPUs agree on 0.75", "allreduce",
            ("values=0.7,0.9,0.6,0.8", "leaves=2", "hosts_per_leaf=2"),
            "Each GPU host gives one number; a ring all-reduce over RoCE v2 packets through "
            "the leaf-spine fabric leaves every host holding their mean. This exchange ends "
            "every training step: until it is done, no GPU can go on."),
    Chapter("A training step: compute, then wait on the network", "training-step", (),
            "GPUs loop compute + all-reduce. On a clean fabric they already wait part of each "
            "step; background incast into one GPU raises the idle fraction and ECN removes "
            "its losses; when RC's pinned flows collide on a spine the GPUs wait longer, and "
            "spraying (MRC) takes that wait away."),
    Chapter("Incast jams a port: drops, then ECN, then PFC, then Ultra Ethernet", "incast",
            ("variants=none,ecn,pfc,ecn+pfc,nscc,rccc,nscc+rccc",),
            "Eight hosts send to one. Without control the port's queue overflows and RC's "
            "go-back-N collapses; ECN marks + DCQCN share the port fairly with a short queue; "
            "PFC pauses the senders and nothing is dropped. Then Ultra Ethernet's way, over "
            "MRC without PFC: NSCC steers each sender's window by queueing delay and ECN, "
            "and the receiver's credit (RCCC) lets the senders send only as fast as its own "
            "link takes, which keeps the last hop's queue to a few frames."),
    Chapter("PFC spreads: a victim that shares no port with the incast", "pfc-spreading", (),
            "Pause frames travel upstream hop by hop and stop a flow that only shares a "
            "switch with the incast; ECN slows only the flows that cause the congestion."),
    Chapter("ECMP collisions vs spraying", "ecmp-vs-spray", (),
            "RC pins each QP to one path (its UDP source port), so flows collide on some "
            "spines while others idle; MRC sprays every packet over every spine, and with "
            "one entropy value per spine loads them evenly."),
    Chapter("Loss recovery: go-back-N vs selective repeat", "loss-recovery", (),
            "With random loss on one link, RC resends everything after a hole, MRC resends "
            "only what was lost."),
    Chapter("A spine uplink fails mid all-reduce", "link-failure", (),
            "RC's QP pinned to the dead spine stalls the whole ring until the controller "
            "reroutes; MRC retires the dead entropy value and keeps going."),
    Chapter("Rack vs scale-out", "rack-vs-scaleout", (),
            "A hierarchical all-reduce uses the rack's fast scale-up links first and sends "
            "only a share over the slower scale-out NICs; a flat ring sends it all there."),
    Chapter("A training job: the chattiest traffic on the innermost tier", "training-job", (),
            "A model split three ways: tensor-parallel groups all-reduce many times per "
            "layer, pipeline stages pass activations, data-parallel replicas all-reduce "
            "gradients once a step. With each TP group inside a rack, its traffic rides "
            "the scale-up links and the steps are short; spread across racks, the same "
            "job waits on the scale-out network. A checkpoint written beside the "
            "gradients' all-reduce slows it."),
    Chapter("A whole plane fails: one NIC, several fabrics", "plane-failure", (),
            "Every GPU's NIC has a port on each of two planes, parallel fabrics that share "
            "nothing else. RC's QPs use one plane; when it fails they stall until it comes "
            "back. MRC sprays over both planes: it loses the failed plane's packets, "
            "resends them on the other, retires the plane's entropy values and keeps "
            "going at the surviving plane's rate."),
)


@dataclass
class ChapterResult:
    chapter: Chapter
    workdir: Path
    seconds: float
    result: dict | None = None
    error: str | None = None

    @property
    def claims(self) -> list[dict]:
        return self.result["claims"] if self.result else []

    def as_dict(self) -> dict:
        return {"title": self.chapter.title, "experiment": self.chapter.experiment,
                "settings": list(self.chapter.settings), "dir": self.workdir.name,
                "seconds": round(self.seconds, 1), "error": self.error,
                "claims": self.claims,
                "warnings": self.result.get("warnings", []) if self.result else []}


def select(only: list[str] | None) -> tuple[Chapter, ...]:
    """The chapters named (by number from 1 or by experiment), or all."""
    if not only:
        return CHAPTERS
    chosen = []
    for key in only:
        match = [c for i, c in enumerate(CHAPTERS, 1) if key in (str(i), c.experiment)]
        if not match:
            names = ", ".join(f"{i} {c.experiment}" for i, c in enumerate(CHAPTERS, 1))
            raise LabError(f"no tour chapter {key!r}; the chapters are: {names}")
        chosen += [c for c in match if c not in chosen]
    return tuple(chosen)


def run(out: Path | None = None,
        only: list[str] | None = None) -> tuple[Path, list[ChapterResult]]:
    chapters = select(only)
    out = Path(out) if out else RESULTS_DIR / f"tour-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    done: list[ChapterResult] = []
    for i, ch in enumerate(chapters, 1):
        log.info(f"chapter {i}/{len(chapters)}: {ch.title} ({ch.experiment})")
        workdir = out / f"{i:02d}-{ch.experiment}"
        t0 = time.monotonic()
        try:
            mb = CAPTURE_MB.get(ch.experiment, 0.0)
            with console.nested():
                _, result = runner.run(ch.experiment, list(ch.settings), workdir,
                                       capture=["auto"] if mb else None, capture_mb=mb,
                                       capture_snaplen=CAPTURE_SNAPLEN)
            done.append(ChapterResult(ch, workdir, time.monotonic() - t0, result))
        except LabError as e:     # the user sees it, and the rest of the story still runs
            done.append(ChapterResult(ch, workdir, time.monotonic() - t0, error=str(e)))
            log.info(f"  chapter {i} could not run: {e}")
        r = done[-1]
        held = sum(c["passed"] for c in r.claims)
        log.info(f"  {held}/{len(r.claims)} claims hold ({r.seconds:.0f} s)")
        write_index(out, done)     # after every chapter: a stopped tour keeps what it has
    return out, done


def time_split(done: list[ChapterResult]) -> dict[str, float]:
    """Where the chapters' time went, in seconds: bringing the fabrics up, the
    experiments (traffic and the reading of it), tearing the fabrics down, writing the
    reports. On a slow machine this says whether the time goes to traffic, whose packet
    counts the claims need, or to the fixed costs around it. A chapter that could not
    run counts whole as experiment."""
    split = {"fabric_up_s": 0.0, "experiment_s": 0.0, "teardown_s": 0.0, "report_s": 0.0}
    for r in done:
        t = (r.result or {}).get("timings_s", {})
        if "total_s" not in t:
            split["experiment_s"] += r.seconds
            continue
        up, down = t.get("ready_s", 0.0), t.get("teardown_s", 0.0)
        split["fabric_up_s"] += up
        split["teardown_s"] += down
        split["experiment_s"] += t["total_s"] - up - down
        split["report_s"] += max(0.0, r.seconds - t["total_s"])
    return {k: round(v, 1) for k, v in split.items()}


def render_split(split: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v / 60:.1f} min"
                     for k, v in split.items())


# --- the index -------------------------------------------------------------------------
def _status(r: ChapterResult) -> str:
    if r.error:
        return "did not run"
    held = sum(c["passed"] for c in r.claims)
    return f"{held}/{len(r.claims)} claims hold"


def told(r: ChapterResult) -> str:
    """The chapter's story as this run bears it out: as written where every claim held;
    where one failed (or nothing ran), said as what the chapter is meant to show, with
    what this run did not show, so the prose never states what the run contradicts."""
    if r.error:
        return f"Meant to show: {r.chapter.story} This run could not show it (below)."
    failed = [c["name"] for c in r.claims if not c["passed"]]
    if not failed:
        return r.chapter.story
    return (f"Meant to show: {r.chapter.story} This run did not show all of it: "
            f"{'; '.join(failed)} failed (below).")


def write_index(out: Path, done: list[ChapterResult]) -> Path:
    total = sum(r.seconds for r in done)
    (out / "tour.json").write_text(json.dumps(
        {"total_s": round(total, 1), "time_split_s": time_split(done),
         "chapters": [r.as_dict() for r in done]},
        indent=1, default=str))
    md = ["# The fabriclab tour", "",
          f"{len(done)} chapters in {total / 60:.1f} min "
          f"({render_split(time_split(done))}). Each links its full report.", ""]
    for i, r in enumerate(done, 1):
        md += [f"## {i}. {r.chapter.title}", "", told(r), "",
               f"`fabriclab run {r.chapter.experiment}"
               + "".join(f" --set {s}" for s in r.chapter.settings) + "`: "
               + _status(r) + f" in {r.seconds:.0f} s; "
               + (f"error: {r.error}" if r.error else f"[report]({r.workdir.name}/report.html)"),
               ""]
        md += [f"- {readable.verdict(c)} {c['name']}: measured "
               f"{readable.claim_measured(c)}, expected {c['expected']}" for c in r.claims]
        md += [f"- warning: {w}" for w in (r.result or {}).get("warnings", [])]
        md.append("")
    (out / "index.md").write_text("\n".join(md))
    page = out / "index.html"
    page.write_text(_html(done, total))
    return page


def _html(done: list[ChapterResult], total: float) -> str:
    esc = html.escape
    body = ["<h1>The fabriclab tour</h1>",
            f"<p>{len(done)} chapters in {total / 60:.1f} min: why GPUs wait on the network, "
            f"and what each fix does. Each chapter links its full report (plots, tables, and "
            f"where the point shows on the wire, pcaps with the display filters that show "
            f"it).</p>"]
    for i, r in enumerate(done, 1):
        link = (f"<b class=fail>did not run: {esc(r.error)}</b>" if r.error else
                f"<a href='{esc(r.workdir.name)}/report.html'>report</a>")
        body.append(f"<h2>{i}. {esc(r.chapter.title)}</h2><p>{esc(told(r))}</p>"
                    f"<p><code>fabriclab run {esc(r.chapter.experiment)}"
                    + "".join(f" --set {esc(s)}" for s in r.chapter.settings)
                    + f"</code> &middot; {esc(_status(r))} in {r.seconds:.0f} s &middot; "
                    f"{link}</p><ul>")
        body += [f"<li class={'pass' if c['passed'] else 'fail'}>"
                 f"{readable.verdict(c)} {esc(c['name'])}: measured "
                 f"{esc(readable.claim_measured(c))}, expected {esc(str(c['expected']))}</li>"
                 for c in r.claims]
        body += [f"<li class=warn>warning: {esc(w)}</li>"
                 for w in (r.result or {}).get("warnings", [])]
        body.append("</ul>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto}"
             ".pass{color:#070}.fail{color:#b00}.warn{color:#b60}")
    return (f"<!doctype html><html><head><meta charset=utf-8><title>fabriclab tour</title>"
            f"<style>{style}</style></head><body>" + "\n".join(body) + "</body></html>\n")
