"""vagrant/provision.sh and the Makefile, on stand-ins for id, sudo, dpkg-query, apt-cache
and apt-get (nothing is installed; pure: runs with --noconftest, as root or not):
root without sudo, a user without sudo, and a package the distribution lacks."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROVISION = REPO / "vagrant/provision.sh"
PACKAGES_LACKED = "perftest"


def stand_in(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(0o755)


@pytest.fixture
def bin_dir(tmp_path):
    """A PATH of stand-ins; each records its arguments in CALLS/NAME. The tools the
    scripts use and nobody stands in for are linked from the system."""
    d = tmp_path / "bin"
    d.mkdir()
    (tmp_path / "calls").mkdir()
    for name in ("dirname", "grep", "cat", "cut", "sha256sum", "ls", "make"):
        os.symlink(subprocess.run(["sh", "-c", f"command -v {name}"], capture_output=True,
                                  text=True).stdout.strip(), d / name)
    for name in ("sudo", "apt-get", "debconf-set-selections"):
        stand_in(d, name, f'echo "$*" >> {tmp_path}/calls/{name}')
    # nothing installed; every package available but one
    stand_in(d, "dpkg-query", "exit 1")
    stand_in(d, "apt-cache", f'[ "$2" = "{PACKAGES_LACKED}" ] && exit 0\n'
                             f'printf "$2:\\n  Installed: (none)\\n  Candidate: 1.0\\n"')
    return d


def calls(bin_dir: Path, name: str) -> list[str]:
    path = bin_dir.parent / "calls" / name
    return path.read_text().splitlines() if path.exists() else []


def run(bin_dir: Path, *args: str, uid: int = 0, sudo: bool = True, **more_env: str):
    stand_in(bin_dir, "id", f"echo {uid}")
    if not sudo:
        (bin_dir / "sudo").unlink()
    env = {"PATH": str(bin_dir), "FABRICLAB_VENV": str(bin_dir.parent / "venv"), "LANG": "C",
           **more_env}
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("sudo, advice", [(True, "sudo make demo"),
                                          (False, "this machine has no sudo")])
def test_a_user_is_told_how_to_become_root(bin_dir, sudo, advice):
    done = run(bin_dir, "/bin/bash", str(PROVISION), uid=1000, sudo=sudo)
    assert done.returncode == 2 and advice in done.stderr
    assert not calls(bin_dir, "apt-get") and not calls(bin_dir, "sudo")


def test_a_missing_package_stops_provisioning_before_anything_is_installed(bin_dir):
    done = run(bin_dir, "/bin/bash", str(PROVISION), str(REPO))
    assert done.returncode == 2
    assert f"no package {PACKAGES_LACKED} " in done.stderr
    assert "nothing was installed" in done.stderr
    assert calls(bin_dir, "apt-get") == ["update -q"]      # the lists, then it stopped
    assert not calls(bin_dir, "sudo") and not (bin_dir.parent / "venv").exists()


def test_root_installs_every_package_in_one_step_without_sudo(bin_dir):
    stand_in(bin_dir, "apt-cache", 'printf "$2:\\n  Candidate: 1.0\\n"')
    # apt-get install fails here, so that the script stops before the virtualenv
    stand_in(bin_dir, "apt-get", f'echo "$*" >> {bin_dir.parent}/calls/apt-get\n'
                                 f'[ "$1" = update ]')
    done = run(bin_dir, "/bin/bash", str(PROVISION), str(REPO))
    assert done.returncode != 0
    update, install = calls(bin_dir, "apt-get")
    assert update == "update -q"
    assert install.startswith("install -y") and "mininet" in install and "perftest" in install
    assert not calls(bin_dir, "sudo")


def test_check_says_what_it_would_install_and_installs_nothing(bin_dir):
    done = run(bin_dir, "/bin/bash", str(PROVISION), "--check", uid=1000)
    assert done.returncode == 2 and f"no package {PACKAGES_LACKED} " in done.stderr
    assert not calls(bin_dir, "apt-get") and not calls(bin_dir, "sudo")


@pytest.mark.parametrize("sudo, advice", [(True, "needs root: sudo make test"),
                                          (False, "no sudo: run it in a root shell")])
def test_make_says_how_to_become_root_before_running_anything(bin_dir, sudo, advice):
    done = run(bin_dir, "make", "-C", str(REPO), "test", uid=1000, sudo=sudo)
    assert done.returncode == 2 and advice in done.stderr
    assert not calls(bin_dir, "apt-get") and not calls(bin_dir, "sudo")


def test_make_as_root_calls_no_sudo(bin_dir):
    for target in ("demo", "test", "test-kernel", "bench", "clean"):
        done = run(bin_dir, "make", "-n", "-C", str(REPO), target)   # -n: print, run nothing
        assert done.returncode == 0, done.stderr
        assert "sudo" not in done.stdout


def test_an_optional_package_the_distribution_lacks_costs_no_update(bin_dir):
    """The suite's tools asked for (as `make test` does), everything required installed,
    Chromium and Vagrant unknown (Ubuntu's Chromium is a snap): no apt-get at all, and
    provisioning goes on to the virtualenv and OVS."""
    stand_in(bin_dir, "dpkg-query", 'case "$3" in chromium|vagrant) exit 1;; esac\n'
                                    'printf "install ok installed"')
    stand_in(bin_dir, "apt-cache", 'case "$2" in chromium|vagrant) exit 0;; esac\n'
                                   'printf "$2:\\n  Candidate: 1.0\\n"')
    venv = bin_dir.parent / "venv"          # up to date: its stamp is what the script wants
    (venv / "bin").mkdir(parents=True)
    stand_in(venv / "bin", "python", "exit 0")
    stand_in(venv / "bin", "fabriclab", f'echo "$*" >> {bin_dir.parent}/calls/fabriclab')
    want = subprocess.run("(cat setup.py; ls -d */__init__.py) | sha256sum | cut -d' ' -f1",
                          shell=True, cwd=REPO, capture_output=True, text=True).stdout
    (venv / ".provisioned").write_text(want)
    done = run(bin_dir, "/bin/bash", str(PROVISION), str(REPO), FABRICLAB_SUITE_TOOLS="1")
    assert done.returncode == 0, done.stderr
    assert "leaving out chromium" in done.stdout and "virtualenv: up to date" in done.stdout
    assert not calls(bin_dir, "apt-get") and not calls(bin_dir, "sudo")
    assert calls(bin_dir, "fabriclab") == ["ovs-start"]


@pytest.mark.parametrize("suite_tools, wanted", [("", "nothing"), ("1", "chromium vagrant")])
def test_only_the_suite_asks_for_its_browser_and_vagrant(bin_dir, suite_tools, wanted):
    """`make demo` provisions without the suite's tools; `make test` sets
    FABRICLAB_SUITE_TOOLS=1 and gets them."""
    stand_in(bin_dir, "dpkg-query", 'case "$3" in chromium|vagrant) exit 1;; esac\n'
                                    'printf "install ok installed"')
    env = {"FABRICLAB_SUITE_TOOLS": suite_tools} if suite_tools else {}
    done = run(bin_dir, "/bin/bash", str(PROVISION), "--check", str(REPO), **env)
    assert done.returncode == 0 and f"would install: {wanted}" in done.stdout, done.stdout
    make = subprocess.run(["make", "-p", "-n", "-C", str(REPO), "test"], capture_output=True,
                          text=True, env={**os.environ, "FABRICLAB_SUITE_TOOLS": ""})
    assert "FABRICLAB_SUITE_TOOLS := 1" in make.stdout
