"""BPF from Python: maps, programs from a clang-built ELF object, ring buffers, mmap.

The lab's data-path programs (lab/kernel/dataplane.bpf.c) need only what is here, so
neither libbpf's Python bindings nor bpftool are needed at run time:

    obj = ElfObject(Path("prog.o"))
    ports = Map.create(BPF_MAP_TYPE_ARRAY, 4, 256, 64, flags=BPF_F_MMAPABLE, name="fl_ports")
    fd = obj.load("tc/egress", maps={"ports": ports.fd})

Maps are created here (the object's `maps` section only names them: no BTF is
needed, so the same object loads on the lab VM's 6.1 kernel). Load errors carry
the verifier's log.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
SYS_BPF = 321     # x86_64

BPF_MAP_CREATE, BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM = 0, 1, 2
BPF_PROG_LOAD, BPF_OBJ_PIN, BPF_OBJ_GET = 5, 6, 7
BPF_MAP_TYPE_ARRAY, BPF_MAP_TYPE_LRU_HASH, BPF_MAP_TYPE_RINGBUF = 2, 9, 27
BPF_PROG_TYPE_SCHED_CLS = 3
BPF_F_MMAPABLE = 0x400
BPF_PSEUDO_MAP_FD = 1
BPF_FS = Path("/sys/fs/bpf")

_MAP_CREATE = struct.Struct("=IIIIIII16s")
_ELEM = struct.Struct("=IIQQQ")
_PROG_LOAD = struct.Struct("=IIQQIIQII16sII")
_OBJ = struct.Struct("=QII")
_INSN = struct.Struct("=BBhi")     # opcode, dst/src registers, offset, immediate
BPF_LD_IMM64 = 0x18


class BpfError(OSError):
    pass


def _sys(cmd: int, attr: bytes) -> int:
    buf = ctypes.create_string_buffer(attr, len(attr))
    r = _libc.syscall(SYS_BPF, cmd, buf, len(attr))
    if r < 0:
        e = ctypes.get_errno()
        raise BpfError(e, f"bpf({cmd}): {os.strerror(e)}")
    return r


def available() -> str | None:
    """None if this kernel and process can load BPF; else why not."""
    try:
        fd = _sys(BPF_MAP_CREATE, _MAP_CREATE.pack(BPF_MAP_TYPE_RINGBUF, 0, 0, 4096, 0, 0, 0,
                                                   b"fl_probe"))
        os.close(fd)
    except BpfError as e:
        return (f"the bpf() system call fails ({e.strerror}): a kernel without BPF ring "
                f"buffers (before 5.8) or no CAP_BPF")
    return None


class Map:
    def __init__(self, fd: int, value_size: int, max_entries: int):
        self.fd, self.value_size, self.max_entries = fd, value_size, max_entries

    @classmethod
    def create(cls, map_type: int, key_size: int, value_size: int, max_entries: int,
               flags: int = 0, name: str = "") -> "Map":
        fd = _sys(BPF_MAP_CREATE, _MAP_CREATE.pack(map_type, key_size, value_size, max_entries,
                                                   flags, 0, 0, name.encode()[:15]))
        return cls(fd, value_size, max_entries)

    def update(self, key: bytes, value: bytes) -> None:
        k, v = ctypes.create_string_buffer(key), ctypes.create_string_buffer(value)
        _sys(BPF_MAP_UPDATE_ELEM, _ELEM.pack(self.fd, 0, ctypes.addressof(k),
                                             ctypes.addressof(v), 0))

    def lookup(self, key: bytes) -> bytes:
        k, v = ctypes.create_string_buffer(key), ctypes.create_string_buffer(self.value_size)
        _sys(BPF_MAP_LOOKUP_ELEM, _ELEM.pack(self.fd, 0, ctypes.addressof(k),
                                             ctypes.addressof(v), 0))
        return v.raw

    def pin(self, path: Path) -> None:
        p = ctypes.create_string_buffer(str(path).encode())
        _sys(BPF_OBJ_PIN, _OBJ.pack(ctypes.addressof(p), self.fd, 0))

    @classmethod
    def open_pinned(cls, path: Path, value_size: int, max_entries: int) -> "Map":
        p = ctypes.create_string_buffer(str(path).encode())
        return cls(_sys(BPF_OBJ_GET, _OBJ.pack(ctypes.addressof(p), 0, 0)), value_size,
                   max_entries)

    def mmap(self) -> mmap.mmap:
        """An array made with BPF_F_MMAPABLE, shared with the programs: its values
        back to back, each rounded up to 8 bytes."""
        size = ((self.value_size + 7) & ~7) * self.max_entries
        return mmap.mmap(self.fd, (size + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1),
                         mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mount_bpffs() -> None:
    """bpffs at /sys/fs/bpf (not mounted by default here), for pinned maps."""
    if os.path.ismount(BPF_FS):
        return
    r = _libc.mount(b"bpf", str(BPF_FS).encode(), b"bpf", 0, None)
    if r != 0:
        e = ctypes.get_errno()
        raise BpfError(e, f"mount bpffs at {BPF_FS}: {os.strerror(e)}")


class RingBuffer:
    """The consumer side of a BPF ring buffer map: records as bytes; select() on it
    (fileno) says when there are some."""
    BUSY, DISCARD = 1 << 31, 1 << 30

    def __init__(self, m: Map):
        page = mmap.PAGESIZE
        self.map = m
        self.mask = m.max_entries - 1
        self.consumer = mmap.mmap(m.fd, page, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        # the producer page, then the data pages mapped twice (a record never wraps)
        self.producer = mmap.mmap(m.fd, page + 2 * m.max_entries, mmap.MAP_SHARED,
                                  mmap.PROT_READ, offset=page)
        self.data_at = page

    def fileno(self) -> int:
        return self.map.fd

    def records(self) -> list[bytes]:
        cons = struct.unpack_from("=Q", self.consumer, 0)[0]
        prod = struct.unpack_from("=Q", self.producer, 0)[0]
        out = []
        while cons < prod:
            at = self.data_at + (cons & self.mask)
            length = struct.unpack_from("=I", self.producer, at)[0]
            if length & self.BUSY:
                break
            size = length & ~(self.BUSY | self.DISCARD)
            if not length & self.DISCARD:
                out.append(self.producer[at + 8:at + 8 + size])
            cons += (size + 8 + 7) & ~7
        struct.pack_into("=Q", self.consumer, 0, cons)
        return out


# --- ELF -----------------------------------------------------------------------------
class ElfObject:
    """A clang -target bpf object: program sections and their map relocations."""

    def __init__(self, path: Path):
        self.path = path
        data = self.data = path.read_bytes()
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise BpfError(errno.ENOEXEC, f"{path}: not a 64-bit little-endian ELF object")
        shoff, = struct.unpack_from("=Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("=HHH", data, 0x3A)
        self.sections = []
        for i in range(shnum):
            name, stype, _, _, off, size, link, info, _, entsize = struct.unpack_from(
                "=IIQQQQIIQQ", data, shoff + i * shentsize)
            self.sections.append({"name": name, "type": stype, "off": off, "size": size,
                                  "link": link, "info": info, "entsize": entsize})
        strtab = self.sections[shstrndx]
        for s in self.sections:
            s["name"] = self._str(strtab, s["name"])
        self.by_name = {s["name"]: i for i, s in enumerate(self.sections)}
        symtab = next(s for s in self.sections if s["type"] == 2)   # SHT_SYMTAB
        self.symbols = []
        for i in range(symtab["size"] // 24):
            name, info, _, shndx, value, size = struct.unpack_from(
                "=IBBHQQ", data, symtab["off"] + i * 24)
            self.symbols.append({"name": self._str(self.sections[symtab["link"]], name),
                                 "shndx": shndx, "value": value, "size": size})

    def _str(self, strtab: dict, off: int) -> str:
        start = strtab["off"] + off
        return self.data[start:self.data.index(b"\0", start)].decode()

    def section(self, name: str) -> bytes:
        s = self.sections[self.by_name[name]]
        return self.data[s["off"]:s["off"] + s["size"]]

    def license(self) -> bytes:
        return self.section("license").rstrip(b"\0") + b"\0"

    def load(self, section: str, maps: dict[str, int], name: str) -> int:
        """Program `section` with its map references bound to the fds in `maps`;
        returns the program's fd."""
        insns = bytearray(self.section(section))
        rel_index = self.by_name.get(".rel" + section)
        rel = self.sections[rel_index] if rel_index is not None else {"size": 0, "off": 0}
        for i in range(rel["size"] // 16):
            off, info = struct.unpack_from("=QQ", self.data, rel["off"] + i * 16)
            sym = self.symbols[info >> 32]
            op, regs, o, imm = _INSN.unpack_from(insns, off)
            if op != BPF_LD_IMM64:
                raise BpfError(errno.EINVAL, f"{self.path}: relocation at {off} of "
                                             f"{section} is not a 64-bit load")
            if sym["name"] not in maps:     # e.g. .rodata: the lab's programs keep none
                raise BpfError(errno.EINVAL, f"{self.path}: {section} refers to "
                                             f"{sym['name']!r}, which the loader lacks")
            _INSN.pack_into(insns, off, op, (regs & 0x0F) | BPF_PSEUDO_MAP_FD << 4, o,
                            maps[sym["name"]])
        return _prog_load(bytes(insns), self.license(), name)


def _prog_load(insns: bytes, license: bytes, name: str) -> int:
    code = ctypes.create_string_buffer(insns, len(insns))
    lic = ctypes.create_string_buffer(license)
    attr = _PROG_LOAD.pack(BPF_PROG_TYPE_SCHED_CLS, len(insns) // 8, ctypes.addressof(code),
                           ctypes.addressof(lic), 0, 0, 0, 0, 0, name.encode()[:15], 0, 0)
    try:
        return _sys(BPF_PROG_LOAD, attr)
    except BpfError:
        log = ctypes.create_string_buffer(1 << 20)
        attr = _PROG_LOAD.pack(BPF_PROG_TYPE_SCHED_CLS, len(insns) // 8,
                               ctypes.addressof(code), ctypes.addressof(lic), 1, len(log),
                               ctypes.addressof(log), 0, 0, name.encode()[:15], 0, 0)
        try:
            return _sys(BPF_PROG_LOAD, attr)
        except BpfError as e:
            tail = log.value.decode(errors="replace").strip().splitlines()[-12:]
            raise BpfError(e.errno, f"the kernel refused BPF program {name}: {e.strerror}\n"
                                    + "\n".join(tail)) from None
