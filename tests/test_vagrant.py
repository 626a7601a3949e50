"""The Vagrantfile is one Vagrant accepts (`vagrant validate`), with its default box and
with the box named by FABRICLAB_VAGRANT_BOX. Boots nothing (pure: runs with
--noconftest); needs Debian's vagrant package, else skipped. The provider blocks
(virtualbox, libvirt) are left out of the check: a machine without the provider, as
this one, has nothing to check them against."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

VAGRANT_DIR = Path(__file__).resolve().parent.parent / "vagrant"

pytestmark = pytest.mark.skipif(shutil.which("vagrant") is None,
                                reason="no vagrant (Debian: apt-get install vagrant)")


@pytest.mark.parametrize("box", [None, "fabriclab-local"])
def test_vagrant_validates_the_vagrantfile(tmp_path, box):
    env = {**os.environ, "VAGRANT_HOME": str(tmp_path / "vagrant.d"),
           "VAGRANT_CHECKPOINT_DISABLE": "1"}   # no state in the user's home, no network
    env.pop("FABRICLAB_VAGRANT_BOX", None)
    if box:
        env["FABRICLAB_VAGRANT_BOX"] = box
    done = subprocess.run(["vagrant", "validate", "--ignore-provider"], cwd=VAGRANT_DIR,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Vagrantfile validated successfully" in done.stdout
