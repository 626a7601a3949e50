"""How far a compiled data path could take the transports' packet rate: the ceiling
behind issue 3's goal (transport packets per CPU-second >= 0.5 of a bare send).

On bench/transport.py's flat-out path, one process in GPU host g0's namespace sends
1 KB RDMA WRITE frames, side by side:
  bare      one pre-built frame, socket.send() per frame (the yardstick)
  python    traffic/roce.py's Framer builds each frame, socket.send() per frame
  C xN      bench/rc_burst.c builds N frames and sends them with one sendmmsg()
None of them runs any transport logic (ACKs, pacing, congestion control): what the
transports add comes on top. The C frames are checked to be the Framer's bytes first.

    sudo .venv/bin/python bench/compiled_ceiling.py      (needs gcc and zlib1g-dev)
"""
import argparse
import ctypes
import errno
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transport import FAST_PATH_MBPS

SOURCE = Path(__file__).with_name("rc_burst.c")
FRAMES = 40000
BURSTS = (16, 32)


def build(out_dir: Path) -> Path:
    if shutil.which("gcc") is None:
        sys.exit("compiled_ceiling: needs a C compiler and zlib's header: "
                 "apt install gcc zlib1g-dev")
    lib = out_dir / "librc_burst.so"
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(lib), str(SOURCE), "-lz"],
                   check=True)
    return lib


def load(lib: Path):
    c = ctypes.CDLL(str(lib))
    c.rc_burst.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                           ctypes.c_int, ctypes.c_uint32, ctypes.c_uint16, ctypes.c_uint32]
    return c


def inside(intf: str, mac: str, next_hop: str, src: str, dst: str, lib: str) -> None:
    """Runs in g0's namespace: check the C frames, then time the three senders."""
    from traffic.constants import BTH_BYTES, DEFAULT_MTU_BYTES as MTU, DSCP_ROCE_DATA, Ecn, Opcode
    from traffic.roce import BTH_OFFSET, Framer, Path as RocePath
    c = load(Path(lib))
    framer = Framer(RocePath(mac, next_hop, src, dst), DSCP_ROCE_DATA, Ecn.ECT_0)
    payload = bytes(range(256)) * (MTU // 256) * (FRAMES + max(BURSTS))
    sport, qpn = 0xC000, 0x12

    def python_frame(psn: int) -> bytes:
        return framer.frame(sport, Opcode.RDMA_WRITE_MIDDLE, qpn, psn,
                            payload=payload[psn * MTU:(psn + 1) * MTU])

    first = python_frame(0)
    template = first[:BTH_OFFSET + BTH_BYTES]      # the headers rc_burst.c patches
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    framer.ip_id = 0
    expected = [python_frame(psn) for psn in range(8)]
    sent = c.rc_burst(a.fileno(), template, payload, MTU, 8, 0, 1, framer.fixed_sum)
    if [b.recv(4096) for _ in range(sent)] != expected:
        sys.exit("compiled_ceiling: the C frames differ from traffic/roce.py's")

    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    sock.bind((intf, 0))

    def per_cpu_second(send_some) -> float:
        done, cpu0 = 0, time.process_time()
        while done < FRAMES:
            n = send_some(done)
            if n > 0:
                done += n
            else:
                time.sleep(0.0002)            # the host queue is full: let it drain
        return done / (time.process_time() - cpu0)

    def one(frame_of):
        def send_some(done: int) -> int:
            try:
                sock.send(frame_of(done))
                return 1
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
                return 0
        return send_some

    def burst(n: int):
        view = memoryview(payload)
        return lambda done: c.rc_burst(sock.fileno(), template,
                                       bytes(view[done * MTU:(done + n) * MTU]), MTU, n,
                                       done, done & 0xFFFF, framer.fixed_sum)

    out = {"bare": per_cpu_second(one(lambda done: first)),
           "python": per_cpu_second(one(python_frame))}
    for n in BURSTS:
        out[f"C x{n}"] = per_cpu_second(burst(n))
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inside", nargs=6, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.inside:
        inside(*a.inside)
        return
    from lab.fabric.calibrate import two_leaves
    from lab.session import Session
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        with Session(two_leaves(FAST_PATH_MBPS), "bench/compiled_ceiling.py",
                     Path(tmp) / "net") as s:
            net = s.net
            g0, g1 = net.fabric.host("g0"), net.fabric.host("g1")
            gateway = net.fabric.subnet_of(g0.ip).gateway_mac
            args = [sys.executable, __file__, "--inside", g0.interface().name,
                    g0.interface().mac, gateway, g0.ip, g1.ip, str(lib)]
            proc = net.mininet["g0"].popen(args, stdout=subprocess.PIPE, text=True)
            out, _ = proc.communicate(300)
        if proc.returncode:
            sys.exit(proc.returncode)
        r = json.loads(out)
        print(f"frames per CPU-second from g0, flat out on a {FAST_PATH_MBPS:.0f} Mb/s path "
              f"(1 KB RDMA WRITE, no transport logic)")
        for name, pps in r.items():
            print(f"   {name:8} {pps:9.0f}   / bare = {pps / r['bare']:.2f}")


if __name__ == "__main__":
    main()
