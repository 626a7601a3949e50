"""Sockets inside a host's network namespace, made from the lab's own process.

setns() moves only the calling thread, and a socket stays in the namespace it
was created in: so one process can hold sockets in every host of a fabric.
"""
from __future__ import annotations

import ctypes
import os
import socket

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
_libc = ctypes.CDLL(None, use_errno=True)


def in_netns(pid: int, fn):
    """fn() run by this thread inside the network namespace of process `pid`."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the namespace of pid {pid}")
        try:
            return fn()
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the lab's namespace")
    finally:
        os.close(own)
        os.close(target)


def enter(pid: int) -> None:
    """This process, for good, into the network and mount namespaces of process `pid`,
    as `mnexec -a` puts a command there (the mount namespace holds the host's own
    /sys). Only a single-threaded process may change its mount namespace."""
    for kind, flag in (("net", CLONE_NEWNET), ("mnt", CLONE_NEWNS)):
        fd = os.open(f"/proc/{pid}/ns/{kind}", os.O_RDONLY)
        try:
            if _libc.setns(fd, flag) != 0:
                raise OSError(ctypes.get_errno(), f"setns into the {kind} namespace of pid {pid}")
        finally:
            os.close(fd)


def socket_in_netns(pid: int, type_: int, proto: int = 0,
                    family: int = socket.AF_INET) -> socket.socket:
    """A socket inside the network namespace of process `pid` (a Mininet host's shell)."""
    return in_netns(pid, lambda: socket.socket(family, type_, proto))


def ifindex_in_netns(pid: int, intf: str) -> int:
    return in_netns(pid, lambda: socket.if_nametoindex(intf))
