"""The lab's ground floor: its errors (errors.py), where its files live and the
variables it reads (paths.py), and the run lock with the record of every process it
started (state.py). Imports nothing of the lab's above it: every layer may use it."""
