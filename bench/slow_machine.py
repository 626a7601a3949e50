"""The tour at a slow machine's scale, on this machine: what fails is the lab's scaling.

On a slow machine (a software CPU) the runner scales every experiment's defaults by the
machine's calibration (lab/fabric/calibrate.py): slower links, smaller messages, longer
event times. A claim that fails there may be the machine's load, or a time in the lab
that does not scale with the links (MRC's fixed 100 ms timer margin did not: trimming's
senders timed out 14,126 times at x0.06). This runs the tour here with a calibration
that says this machine is as slow as PAIR / BUSY (the pair's and eight busy hosts'
keep-up rates, Mb/s), so the rates and sizes are the slow machine's while the CPU is
not the limit: a claim that fails here fails because of the scaling.

    sudo .venv/bin/python bench/slow_machine.py [--pair 6] [--busy 0.3125] [--only 2,incast]

The defaults are the fresh Debian VM's of session 26 (x0.12 for two busy ends, x0.05
for eight). It prints the tour's summary (claims, time); the tour's directory is kept.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from lab.core import paths  # noqa: E402  (the repo is not installed as a package)
from lab.fabric import calibrate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=float, default=6.0,
                    help="the Mb/s one pair of hosts keeps up with (reference: 50)")
    ap.add_argument("--busy", type=float, default=0.3125,
                    help="the Mb/s each of 4 flows keeps up with at once (reference: 10)")
    ap.add_argument("--only", default="", help="tour chapters, as `fabriclab tour --only`")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    c = calibrate.Calibration(a.pair, a.busy, calibrate.machine(), [], [],
                              f"bench/slow_machine.py: as slow as {a.pair} / {a.busy} Mb/s")
    with tempfile.TemporaryDirectory(prefix="fl-slow-") as tmp:
        cal = Path(tmp) / "calibration.json"
        cal.write_text(json.dumps(dataclasses.asdict(c)))
        print(f"as if this machine kept up with {a.pair:g} Mb/s (a pair) and {a.busy:g} "
              f"(eight busy): factors x{c.factor_for(2):.2f} (two busy ends) to "
              f"x{c.factor_for(2 * calibrate.BUSY_PAIRS):.2f} (eight)", flush=True)
        args = [str(Path(sys.executable).parent / "fabriclab"), "tour"]
        args += ["--only", a.only] if a.only else []
        args += ["--out", str(a.out)] if a.out else []
        r = subprocess.run(args, cwd=REPO, env={**os.environ, paths.CALIBRATION_ENV: str(cal)})
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
