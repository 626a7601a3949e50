"""Errors the CLI turns into one line and an exit code (never a traceback)."""


class LabError(Exception):
    """The lab cannot do what was asked; the message says what to do."""
    exit_code = 1


class UsageError(LabError):
    """Bad input: the message names the parameter."""
    exit_code = 2


class Terminated(BaseException):
    """SIGTERM arrived; raised so that teardown runs as for Ctrl-C. A BaseException,
    like KeyboardInterrupt, so that no `except Exception` in Mininet swallows it."""
