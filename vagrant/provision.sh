#!/usr/bin/env bash
# Installs everything fabriclab needs, on Debian 12 / Ubuntu 24.04, as root.
# Used by `make demo`, `make test`, the Vagrantfile and the lab VM's image. Idempotent:
# each step checks first and skips what is already done. It never calls sudo: run it as
# root (`make demo` in a root shell, or `sudo make demo` as a user with sudo).
#   usage: vagrant/provision.sh [REPO_DIR]
set -euo pipefail

REPO="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
# The venv may live outside the repo (Vagrant: shared folders handle symlinks badly).
VENV="${FABRICLAB_VENV:-$REPO/.venv}"
log() { printf '[provision] %s\n' "$*"; }
fail() { printf '[provision] error: %s\n' "$*" >&2; exit 2; }

if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        fail "provisioning installs packages and needs root: sudo make demo (or sudo bash vagrant/provision.sh)"
    fi
    fail "provisioning installs packages and needs root, and this machine has no sudo: in a root shell (su -), run make demo (or bash vagrant/provision.sh)"
fi

# Debian/Ubuntu packages. python3-venv gives the venv; mininet's python module
# is the distribution's, so the venv is made with --system-site-packages.
PACKAGES=(
    python3 python3-venv python3-pip
    mininet openvswitch-switch iperf3 libiperf0
    tshark tcpdump ethtool iputils-ping net-tools bridge-utils
    iproute2 nftables procps psmisc
    # the per-packet data path (lab/dataplane.bpf.c: ECN marking, the PFC trigger) is
    # compiled at first use; libbpf-dev gives its helper headers
    clang llvm libbpf-dev libc6-dev
    # Soft-RoCE's user space (rxe verbs provider, ibv_devinfo, ib_write_bw): real RoCE
    # peers where the kernel has rdma_rxe (the Vagrant VM, the lab VM)
    rdma-core ibverbs-providers ibverbs-utils perftest
)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    # tshark asks whether non-root users may capture; the lab runs as root.
    echo 'wireshark-common wireshark-common/install-setuid boolean false' | debconf-set-selections 2>/dev/null || true
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
else
    log "packages: all present"
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
