"""The lab's pages (report.html, the tour's index.html) in a real browser: headless
Chromium takes a screenshot at a screen width and measures the page's layout in the DOM.

    browser.screenshot(page, png, width_px=1366)   # what a reader on a laptop sees
    browser.layout(page, width_px=1366)             # Layout: page width, what sticks out

Chromium is Debian's `chromium` package (vagrant/provision.sh installs it where the
distribution has it as a package).
"""
from __future__ import annotations

import html
import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lab.core.errors import LabError

log = logging.getLogger(__name__)

LAPTOP_WIDTH_PX = 1366      # the most common laptop screen width
HEIGHT_PX = 900
TIMEOUT_S = 60
# Chromium's own sandbox needs user namespaces it cannot have as root in a container;
# the pages are the lab's own files.
FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--no-first-run", "--disable-dev-shm-usage", "--mute-audio"]

# Runs once the page (images included) is laid out: writes the measurements into the DOM
# for --dump-dom, in an element the page itself does not have.
_MEASURE = """<script>
addEventListener('load', () => {
  const vw = innerWidth, out = [];
  for (const el of document.body.querySelectorAll('*')) {
    const r = el.getBoundingClientRect();
    if (r.right > vw + 0.5 || r.left < -0.5)
      out.push(el.tagName.toLowerCase() + (el.className ? '.' + el.className : '')
               + ' right ' + Math.round(r.right) + ' px');
  }
  const pre = document.createElement('pre');
  pre.id = 'fabriclab-layout';
  pre.textContent = JSON.stringify({viewport_px: vw,
    page_width_px: document.documentElement.scrollWidth, sticking_out: out.slice(0, 8)});
  document.body.appendChild(pre);
});
</script>"""
_RESULT = re.compile(r'<pre id="fabriclab-layout">(.*?)</pre>', re.S)


@dataclass
class Layout:
    viewport_px: int
    page_width_px: int          # the document's scroll width: > viewport = a horizontal scroll
    sticking_out: list[str]     # elements past the viewport's edges (tag.class, right edge)

    @property
    def overflows(self) -> bool:
        return self.page_width_px > self.viewport_px or bool(self.sticking_out)


def executable() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise LabError("no Chromium on this machine: install Debian's package (apt-get install "
                   "chromium) or run vagrant/provision.sh")


def _run(args: list[str]) -> str:
    # a profile of its own: no state shared with a browser the user runs
    with tempfile.TemporaryDirectory(prefix="fabriclab-chromium-") as profile:
        try:
            done = subprocess.run([executable(), *FLAGS, f"--user-data-dir={profile}", *args],
                                  capture_output=True, text=True, timeout=TIMEOUT_S,
                                  env={**os.environ, "HOME": profile})
        except subprocess.TimeoutExpired:
            raise LabError(f"Chromium did not finish within {TIMEOUT_S} s: {args[-1]}") from None
    if done.returncode != 0:
        raise LabError(f"Chromium failed ({done.returncode}) on {args[-1]}: "
                       f"{done.stderr.strip()[-500:]}")
    return done.stdout


def screenshot(page: Path, png: Path, width_px: int = LAPTOP_WIDTH_PX,
               height_px: int = HEIGHT_PX) -> Path:
    """A screenshot of the page's first screen at that window size."""
    png = Path(png).resolve()
    _run([f"--window-size={width_px},{height_px}", f"--screenshot={png}",
          Path(page).resolve().as_uri()])
    if not png.exists():
        raise LabError(f"Chromium wrote no screenshot of {page}")
    log.info("screenshot of %s at %d px: %s", page, width_px, png)
    return png


def layout(page: Path, width_px: int = LAPTOP_WIDTH_PX) -> Layout:
    """The page laid out at that window width, measured in the DOM. The page is copied
    beside itself (its relative links still resolve) with the measuring script added."""
    page = Path(page).resolve()
    text = page.read_text()
    with tempfile.NamedTemporaryFile("w", suffix=".html", dir=page.parent,
                                     prefix=".layout-") as probe:
        probe.write(text.replace("</body>", _MEASURE + "</body>") if "</body>" in text
                    else text + _MEASURE)
        probe.flush()
        dom = _run([f"--window-size={width_px},{HEIGHT_PX}", "--virtual-time-budget=5000",
                    "--dump-dom", Path(probe.name).as_uri()])
    found = _RESULT.search(dom)
    if not found:
        raise LabError(f"the layout of {page} could not be measured (no result in the DOM)")
    return Layout(**json.loads(html.unescape(found.group(1))))


def main() -> None:
    """python -m lab.browser PAGE.html... [--out DIR] [--width PX]: a screenshot of each
    page (DIR/NAME.png) and whether it fits the width (exit 1 if one does not)."""
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="python -m lab.browser", description=main.__doc__)
    p.add_argument("pages", nargs="+", type=Path)
    p.add_argument("--out", type=Path, default=Path("screenshots"))
    p.add_argument("--width", type=int, default=LAPTOP_WIDTH_PX, metavar="PX")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    fits = True
    for page in args.pages:
        # results/tour-T/03-incast/report.html -> 03-incast-report.png
        png = args.out / f"{page.parent.name}-{page.stem}.png"
        screenshot(page, png, args.width)
        got = layout(page, args.width)
        fits &= not got.overflows
        verdict = ("fits" if not got.overflows else
                   f"TOO WIDE ({got.page_width_px} px; {', '.join(got.sticking_out)})")
        print(f"{png}: {page} at {args.width} px {verdict}")
    sys.exit(0 if fits else 1)


if __name__ == "__main__":
    main()
