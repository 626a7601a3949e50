# fabriclab: `make demo` and `make test`, as root, install what they need first
# (vagrant/provision.sh: packages, .venv, Open vSwitch), then run. As a user with sudo:
# `sudo make demo`. Nothing here calls sudo itself.
VENV ?= $(or $(FABRICLAB_VENV),.venv)
FABRICLAB := $(VENV)/bin/fabriclab

.PHONY: setup demo test test-kernel bench clean

# Every target needs root (packages, network namespaces, Open vSwitch, tc): say so before
# anything runs, in the words that work on this machine (a bare Debian has no sudo).
ifneq ($(shell id -u),0)
ifneq ($(shell command -v sudo),)
$(error make $(or $(MAKECMDGOALS),setup) needs root: sudo make $(or $(MAKECMDGOALS),setup))
else
$(error make $(or $(MAKECMDGOALS),setup) needs root, and this machine has no sudo: run it in a root shell (su -))
endif
endif

# The kernel tier (tests/kernel: netem, OVS kernel datapath, Soft-RoCE) runs natively where
# this kernel has those features (e.g. the Vagrant VM), else in the lab VM.
KERNEL_TIER = if $(FABRICLAB) vm kernel-check; then \
		$(VENV)/bin/python -m pytest -q -m kernel tests/kernel; \
	else \
		$(FABRICLAB) vm test; \
	fi

# The cluster tier (tests/cluster): a fabric across two lab VMs joined by a virtual network,
# booted from here. A machine without the memory for both (a 4 GB Vagrant VM) skips it and
# says why (-rs); CI requires it (.ci/run).
CLUSTER_TIER = $(VENV)/bin/python -m pytest -q -rs -m cluster tests/cluster

setup:
	FABRICLAB_VENV=$(abspath $(VENV)) bash vagrant/provision.sh

# checks the machine, builds and verifies a fabric, then tells the lab's story (the tour
# prints where its report is)
demo: setup
	$(FABRICLAB) doctor
	$(FABRICLAB) verify
	$(FABRICLAB) tour

# the native suite (pytest.ini deselects the kernel tier), then the kernel tier; its
# setup adds the suite's own tools (Chromium for the reports' browser test, Vagrant to
# validate the Vagrantfile), which a demo does not need
test: export FABRICLAB_SUITE_TOOLS := 1
test: setup
	$(VENV)/bin/python -m pytest -q
	$(KERNEL_TIER)
	$(CLUSTER_TIER)

test-kernel: setup
	$(KERNEL_TIER)

bench: setup
	$(VENV)/bin/python bench/scale.py

clean:
	$(FABRICLAB) clean
