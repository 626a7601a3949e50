"""fabriclab: the session (runner, results, report, tour, CLI, API) over its layers:
lab.core (errors, paths, the run lock), lab.kernel (kernel plumbing), lab.fabric (the
running fabric), lab.experiments and lab.vm. README, "Architecture", draws them;
tests/test_structure.py keeps every import pointing down."""

from lab.core import console  # noqa: F401  (first: the lab's loggers stay plain Loggers)
