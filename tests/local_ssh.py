"""Stands in for ssh in tests/test_cluster.py, where there is no second machine: runs
the remote command here, with this process's stdin, stdout and stderr, as ssh runs it
there. What comes before `--` (ssh's options and the target) is ssh's business."""
import os
import sys

argv = sys.argv[1:]
os.execv("/bin/sh", ["sh", "-c", argv[argv.index("--") + 1]])
