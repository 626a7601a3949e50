import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FABRICLAB = [sys.executable, "-m", "lab"]


@pytest.fixture(scope="session", autouse=True)
def machine_calibration():
    """The experiments run at rates this machine keeps up with, as a user's runs do: its
    stored calibration (lab/fabric/calibrate.py), measured first if it has none (once per
    machine; ~12 s here). Tests choose small sizes themselves; on a slower machine the
    runner scales the default link rates down. FABRICLAB_CALIBRATION picks another file
    (e.g. a slower machine's, to rehearse one)."""
    from lab.fabric import calibrate
    c = calibrate.load()
    if c is None and os.geteuid() == 0:
        from lab.core.state import RunLock
        print("\ncalibrating this machine for the suite (once; `fabriclab calibrate` redoes it)")
        with RunLock("test suite: calibrating"):
            c = calibrate.measure()
        calibrate.save(c)
    return c


@pytest.fixture
def machine_factor(machine_calibration) -> float:
    """What the runner scales the default link rates by on this machine, for an
    experiment that keeps two hosts or fewer busy at once (incast, trimming)."""
    return machine_calibration.factor if machine_calibration else 1.0


@pytest.fixture
def factor_for(machine_calibration):
    """...and for one that keeps `busy_ends` flow ends busy (Calibration.factor_for)."""
    return lambda busy_ends: (machine_calibration.factor_for(busy_ends)
                              if machine_calibration else 1.0)


@pytest.fixture
def pace(factor_for):
    """A test's own sizes and times for an experiment, set for the reference machine,
    scaled as the runner scales the experiment's defaults: sizes by size_factor over
    links slowed by its factor, so a transfer takes size/factor longer (x2.5 at 0.1)."""
    from lab.experiments.base import busy_ends
    from lab.fabric import calibrate
    from lab.runner import load

    def of(experiment: str) -> Pace:
        factor = factor_for(busy_ends(load(experiment)))
        return Pace(calibrate.size_factor(factor), calibrate.time_stretch(factor))
    return of


@dataclass
class Pace:
    size: float     # x a reference size
    time: float     # x a reference duration

    def kb(self, kb: float) -> int:
        return max(1, int(kb * self.size))

    def s(self, seconds: float) -> float:
        return round(seconds * self.time, 3)


def fabriclab(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    """Run the CLI as a user would; capture its output."""
    return subprocess.run(FABRICLAB + list(args), cwd=kw.pop("cwd", REPO), capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture(autouse=True)
def no_lab_objects_left():
    """Every test must leave no lab object behind (and starts from none). The cleaning
    holds the run lock, as `fabriclab clean` does: a lab run in progress on this machine
    (a tour, a user's experiment) makes the test fail saying so, never loses its fabric."""
    from lab.core.state import RunLock
    from lab.fabric import cleanup
    with RunLock("the test suite's cleanup"):
        cleanup.clean()   # what a crash outside the suite left
    yield
    left = cleanup.leftovers()
    if any(left.values()):
        with RunLock("the test suite's cleanup"):
            cleanup.clean()
        pytest.fail(f"the test left lab objects behind: {left}")


requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI is root)")


def unexcused_failures(result: dict) -> list[dict]:
    """A run's failed claims (metrics.json) but those the run excuses. On a machine
    slower than the reference (machine_factor < 1: the lab VM's software CPU) a run
    holds its claims or names the mechanism the machine's load defeated (issue 13,
    item 5): a failed claim the run says was starved (lab/experiments/base.py:
    name_starved) is excused there. At machine_factor 1 nothing is."""
    slow = result["machine_factor"] < 1
    return [c for c in result["claims"] if not c["passed"] and not (slow and c.get("starved"))]

