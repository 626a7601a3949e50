import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FABRICLAB = [sys.executable, "-m", "lab"]


def _reference_calibration() -> None:
    """Tests run the experiments at their defaults whatever this machine's calibration
    (they choose small sizes themselves): a calibration of exactly the reference speed,
    in a file of the suite's own (the CLI runs it calls read the same variable)."""
    from lab import calibrate
    os.environ[calibrate.CALIBRATION_ENV] = str(
        Path(tempfile.mkdtemp(prefix="fl-test-calibration-")) / "calibration.json")
    calibrate.save(calibrate.Calibration(calibrate.REFERENCE_KEEP_UP_MBPS, calibrate.machine(),
                                         [], "the test suite's reference"))


_reference_calibration()


def fabriclab(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    """Run the CLI as a user would; capture its output."""
    return subprocess.run(FABRICLAB + list(args), cwd=kw.pop("cwd", REPO), capture_output=True,
                          text=True, timeout=timeout, **kw)


@pytest.fixture(autouse=True)
def no_lab_objects_left():
    """Every test must leave no lab object behind (and starts from none)."""
    from lab import cleanup
    cleanup.clean()   # what a crash outside the suite left
    yield
    left = cleanup.leftovers()
    if any(left.values()):
        cleanup.clean()
        pytest.fail(f"the test left lab objects behind: {left}")


requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI is root)")
