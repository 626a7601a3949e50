# fabriclab: `sudo make demo` and `sudo make test` install what they need first
# (vagrant/provision.sh: packages, .venv, Open vSwitch), then run.
VENV ?= $(or $(FABRICLAB_VENV),.venv)
FABRICLAB := $(VENV)/bin/fabriclab

.PHONY: setup demo test bench clean

setup:
	FABRICLAB_VENV=$(abspath $(VENV)) bash vagrant/provision.sh

demo: setup
	$(FABRICLAB) doctor
	$(FABRICLAB) verify

test: setup
	$(VENV)/bin/python -m pytest -q

bench: setup
	$(VENV)/bin/python bench/scale.py

clean:
	$(FABRICLAB) clean
