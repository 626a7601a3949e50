"""A newc cpio archive (the initramfs format), written in Python.

The host need not have cpio or busybox installed: the initramfs is a handful of
files, and the format is a fixed ASCII header per entry, padded to 4 bytes.
"""
from __future__ import annotations

import gzip
import stat
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"070701"


@dataclass
class Entry:
    name: str           # path inside the archive, without a leading "/"
    mode: int           # including the file type bits (stat.S_IFREG | 0o755, ...)
    data: bytes = b""   # file contents, or the target of a symlink


def _pad4(n: int) -> bytes:
    return b"\0" * (-n % 4)


def _header(e: Entry, ino: int) -> bytes:
    name = e.name.encode() + b"\0"
    fields = [ino, e.mode, 0, 0, 1, 0, len(e.data), 0, 0, 0, 0, len(name), 0]
    head = MAGIC + b"".join(b"%08X" % f for f in fields)
    return head + name + _pad4(len(head) + len(name))


def archive(entries: list[Entry]) -> bytes:
    out = bytearray()
    for ino, e in enumerate(entries + [Entry("TRAILER!!!", 0)], start=1):
        out += _header(e, ino) + e.data + _pad4(len(e.data))
    return bytes(out)


def directory(name: str) -> Entry:
    return Entry(name, stat.S_IFDIR | 0o755)


def file(name: str, source: Path, mode: int = 0o644) -> Entry:
    return Entry(name, stat.S_IFREG | mode, source.read_bytes())


def symlink(name: str, target: str) -> Entry:
    return Entry(name, stat.S_IFLNK | 0o777, target.encode())


def write_gzip(path: Path, entries: list[Entry]) -> None:
    # level 1: the kernel decompresses it under a software CPU at boot; speed over size
    path.write_bytes(gzip.compress(archive(entries), compresslevel=1))
