#!/usr/bin/env bash
# Installs everything fabriclab needs, on Debian 12 / Ubuntu 24.04, as root.
# Used by `make demo`, `make test`, the Vagrantfile and the lab VM's image. Idempotent:
# each step checks first and skips what is already done. It never calls sudo: run it as
# root (`make demo` in a root shell, or `sudo make demo` as a user with sudo).
#   usage: vagrant/provision.sh [--check] [REPO_DIR]
#   --check  only say which packages are missing and whether this distribution has
#            them (from the package lists as they are: no apt-get update); installs
#            nothing, needs no root
#   FABRICLAB_SUITE_TOOLS=1  adds what only the test suite's checks use (Chromium, Vagrant):
#            `make test` sets it; `make demo` leaves them out
set -euo pipefail

check_only=0
if [ "${1:-}" = "--check" ]; then
    check_only=1
    shift
fi
REPO="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
# The venv may live outside the repo (Vagrant: shared folders handle symlinks badly).
VENV="${FABRICLAB_VENV:-$REPO/.venv}"
log() { printf '[provision] %s\n' "$*"; }
fail() { printf '[provision] error: %s\n' "$*" >&2; exit 2; }

if [ "$check_only" -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        fail "provisioning installs packages and needs root: sudo make demo (or sudo bash vagrant/provision.sh)"
    fi
    fail "provisioning installs packages and needs root, and this machine has no sudo: in a root shell (su -), run make demo (or bash vagrant/provision.sh)"
fi

# Debian/Ubuntu packages, the same names on both (README: "Packages per distribution"
# says which were tried where). python3-venv gives the venv; mininet's python module is
# the distribution's, so the venv is made with --system-site-packages.
PACKAGES=(
    python3 python3-venv python3-pip
    mininet openvswitch-switch iperf3 libiperf0
    tshark tcpdump ethtool iputils-ping net-tools bridge-utils
    iproute2 nftables procps psmisc
    # a fabric across machines: the head starts each machine's worker over ssh
    openssh-client
    # the README's commands are make targets: a Vagrant guest is provisioned by Vagrant,
    # not by make, and a minimal image (the lab VM's, a bare box) may lack it
    make
    # the per-packet data path (lab/kernel/dataplane.bpf.c: ECN marking, the PFC trigger) is
    # compiled at first use; libbpf-dev gives its helper headers
    clang llvm libbpf-dev libc6-dev
    # Soft-RoCE's user space (rxe verbs provider, ibv_devinfo, ib_write_bw): real RoCE
    # peers where the kernel has rdma_rxe (the Vagrant VM, the lab VM)
    rdma-core ibverbs-providers ibverbs-utils perftest
)
# Installed where the distribution has them as packages, else left out with a note: the
# suite skips what needs them. Chromium screenshots the reports (tests/test_report.py;
# Ubuntu ships it as a snap only); Vagrant validates the Vagrantfile (tests/test_vagrant.py).
OPTIONAL=()
if [ "${FABRICLAB_SUITE_TOOLS:-0}" = 1 ]; then
    OPTIONAL+=(chromium vagrant)
fi

# (grep reads all its input, not -q: under pipefail a writer cut off early fails the test)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep 'install ok installed' >/dev/null; }
# has a version apt could install (not unknown, not purely virtual)
available() { LC_ALL=C apt-cache policy "$1" 2>/dev/null | grep -E '^ +Candidate: [^(]' >/dev/null; }

missing=() missing_optional=()
for p in "${PACKAGES[@]}"; do installed "$p" || missing+=("$p"); done
for p in "${OPTIONAL[@]}"; do installed "$p" || missing_optional+=("$p"); done
distro="$( (. /etc/os-release && echo "$PRETTY_NAME") 2>/dev/null || echo "this distribution")"

updated=0
if [ "${#missing[@]}" -gt 0 ] && [ "$check_only" -eq 0 ]; then
    apt-get update -q
    updated=1
fi
# Every package is checked before any is installed: a name this distribution does not
# have (renamed, or in a repository not enabled) stops here, not half-way.
unavailable=()
for p in "${missing[@]}"; do available "$p" || unavailable+=("$p"); done
if [ "${#unavailable[@]}" -gt 0 ]; then
    fail "$distro has no package ${unavailable[*]} (apt-cache policy shows no candidate); nothing was installed. Enable the repository that has it (on Ubuntu, e.g. universe), or see the README's Packages per distribution"
fi
# An optional package the package lists do not have is left out, and is no reason to
# refresh them (on Ubuntu, Chromium would otherwise cost an apt-get update every run).
to_install=("${missing[@]}")
for p in "${missing_optional[@]}"; do
    if available "$p"; then
        to_install+=("$p")
    else
        log "leaving out $p: $distro has no package of it (the suite skips what needs it)"
    fi
done
if [ "$check_only" -eq 1 ]; then
    log "would install: ${to_install[*]:-nothing}"
    exit 0
fi
if [ "${#to_install[@]}" -eq 0 ]; then
    log "packages: all present"
else
    if [ "$updated" -eq 0 ]; then
        apt-get update -q
    fi
    log "installing packages: ${to_install[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # tshark asks whether non-root users may capture; the lab runs as root.
    echo 'wireshark-common wireshark-common/install-setuid boolean false' | debconf-set-selections 2>/dev/null || true
    apt-get install -y -q --no-install-recommends "${to_install[@]}"
fi

# The virtualenv: distribution python (it sees the distribution's mininet module).
stamp="$VENV/.provisioned"
# Reinstall when setup.py or the set of top-level packages changes (an editable
# install maps the packages that existed when it was made).
want="$( (cat "$REPO/setup.py"; cd "$REPO" && ls -d */__init__.py) | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtualenv $VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing fabriclab and its Python dependencies into $VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e "$REPO[test]"
    echo "$want" > "$stamp"
else
    log "virtualenv: up to date"
fi

# Open vSwitch: started, with the datapath this kernel supports.
"$VENV/bin/fabriclab" ovs-start
log "done. Try: make demo (as root)"
