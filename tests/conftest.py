import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FABRICLAB = [sys.executable, "-m", "lab"]


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
