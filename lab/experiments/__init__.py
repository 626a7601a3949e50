"""Experiments: one module each (see lab/runner.py for what a module holds)."""
