"""The lab's transports against yardsticks measured side by side, on one path.

  1. goodput of one RC and one MRC flow / iperf3 TCP goodput, same rate-limited
     path (goal >= 1.0), and / the line rate (goal >= 0.95);
  2. transport packets per CPU-second (all its logic) / a bare raw-socket send of
     pre-built frames from the same host on the same path (goal >= 0.5). Measured
     flat out, on a path fast enough (FAST_PATH_MBPS) that no link holds either
     sender back: per core means what one core can push. The same figure at the
     paced line rate of part 1 is printed too: there a sender sleeps between
     bursts, and every wake-up costs (task switch, poll, timers);
  3. the highest link rate at which the GPU hosts keep up (goodput >= 80% of the
     line, sender below 90% CPU): emulation is only faithful below it. This is
     `fabriclab calibrate` (lab/fabric/calibrate.py), which the lab uses to scale its
     experiments' defaults on slower machines.

A 1 KB RoCE MTU carries 1024 payload bytes in a 1102-byte MRC frame (92.9%; RC's
middle packets 1082, 94.6%), TCP's 1448-byte MSS 95.6% of a 1514-byte frame: on
the same link RoCE's goodput can reach 0.97-0.99 of TCP's, not 1.0; the table
prints that ceiling too.

    sudo .venv/bin/python bench/transport.py [--rate-mbps 100] [--sweep 50,100,200,400]
"""
import argparse
import json
import subprocess
import sys

from lab.core.state import RunLock
from lab.session import Session
from lab.fabric import calibrate
from lab.fabric.calibrate import flow, two_leaves
from lab.fabric.gpus import iperf3_tcp
from traffic.constants import DEFAULT_MTU_BYTES, IMMDT_BYTES, RETH_BYTES
from traffic.roce import WRITE_OVERHEAD_BYTES

MRC_OVERHEAD_BYTES = WRITE_OVERHEAD_BYTES + RETH_BYTES + IMMDT_BYTES   # every MRC packet's
PAYLOAD_CEILING = DEFAULT_MTU_BYTES / (DEFAULT_MTU_BYTES + MRC_OVERHEAD_BYTES)
# far above what a sender here reaches (OVS's userspace datapath forwards ~60k frames/s)
FAST_PATH_MBPS = 10000.0
FAST_FLOW_BYTES = 40 << 20          # 40960 packets: one MRC message holds at most 65535
BARE_FRAMES = 20000

BARE_SENDER = """
import json, socket, sys, time, errno
from traffic.roce import Framer, Path
from traffic.constants import DSCP_ROCE_DATA, Ecn
intf, mac, nh, src, dst, n = sys.argv[1:7]
frame = Framer(Path(mac, nh, src, dst), DSCP_ROCE_DATA, Ecn.ECT_0).frame(0xC000, 0x0A, 1, 0, payload=bytes(1024))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW); s.bind((intf, 0))
sent, cpu0, t0 = 0, time.process_time(), time.monotonic()
while sent < int(n):
    try:
        s.send(frame); sent += 1
    except OSError as e:
        if e.errno != errno.ENOBUFS: raise
        time.sleep(0.0002)
print(json.dumps({"sent": sent, "cpu_s": time.process_time() - cpu0, "elapsed_s": time.monotonic() - t0}))
"""


def flow_goodput(net, transport: str, nbytes: int) -> dict:
    """One flow; its packets per CPU-second count the packets the data needs, so a
    retransmission costs CPU and adds nothing."""
    r = flow(net, transport, nbytes)
    needed = -(-nbytes // DEFAULT_MTU_BYTES)
    return {**r, "pps_per_core": needed / r["cpu_s"] if r["cpu_s"] else float("inf")}


def bare_send(net, n_frames: int) -> dict:
    g0, g1 = net.fabric.host("g0"), net.fabric.host("g1")
    subnet = net.fabric.subnet_of(g0.ip)
    args = [sys.executable, "-c", BARE_SENDER, g0.interface().name, g0.interface().mac,
            subnet.gateway_mac, g0.ip, g1.ip, str(n_frames)]
    out, _ = net.mininet["g0"].popen(args, stdout=subprocess.PIPE, text=True).communicate(60)
    r = json.loads(out)
    r["pps_per_core"] = r["sent"] / r["cpu_s"]
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rate-mbps", type=float, default=100)
    ap.add_argument("--seconds", type=float, default=3)
    ap.add_argument("--sweep", default="50,100,200,400")
    a = ap.parse_args()
    nbytes = int(a.rate_mbps * 1e6 / 8 * a.seconds)
    with Session(two_leaves(a.rate_mbps), "bench/transport.py") as s:
        tcp = iperf3_tcp(s.net, "g0", "g1", a.seconds)
        rc = flow_goodput(s.net, "rc", nbytes)
        mrc = flow_goodput(s.net, "mrc", nbytes)
        bare = bare_send(s.net, BARE_FRAMES)
    with Session(two_leaves(FAST_PATH_MBPS), "bench/transport.py") as s:
        fast = {"bare": bare_send(s.net, BARE_FRAMES),
                "RC": flow_goodput(s.net, "rc", FAST_FLOW_BYTES),
                "MRC": flow_goodput(s.net, "mrc", FAST_FLOW_BYTES)}
    print(f"\n1. goodput on one {a.rate_mbps:.0f} Mb/s path (g0 -> leaf -> spine -> leaf -> g1)")
    print(f"   iperf3 TCP  {tcp['received_mbps']:7.1f} Mb/s      (RoCE payload ceiling at a "
          f"{DEFAULT_MTU_BYTES} B MTU: {PAYLOAD_CEILING * a.rate_mbps:.1f} Mb/s)")
    for name, r in (("RC", rc), ("MRC", mrc)):
        print(f"   {name:4} {r['goodput_mbps']:12.1f} Mb/s   / iperf3 = "
              f"{r['goodput_mbps'] / tcp['received_mbps']:.2f} (goal >= 1.0)   / line = "
              f"{r['goodput_mbps'] / a.rate_mbps:.2f} (goal >= 0.95)   intact {r['intact']}")
    print(f"\n2. packets per CPU-second of the sending host, flat out on a "
          f"{FAST_PATH_MBPS:.0f} Mb/s path")
    print(f"   bare raw-socket send of pre-built frames  {fast['bare']['pps_per_core']:9.0f}")
    for name in ("RC", "MRC"):
        r = fast[name]
        print(f"   {name:4} (all its logic) {r['pps_per_core']:23.0f}   / bare = "
              f"{r['pps_per_core'] / fast['bare']['pps_per_core']:.2f} (goal >= 0.5)   "
              f"{r['goodput_mbps']:.0f} Mb/s, sender CPU {r['cpu_fraction']:.0%}, "
              f"intact {r['intact']}")
    print(f"   paced at {a.rate_mbps:.0f} Mb/s (part 1's flows; bare "
          f"{bare['pps_per_core']:.0f}): RC / bare = "
          f"{rc['pps_per_core'] / bare['pps_per_core']:.2f}, MRC / bare = "
          f"{mrc['pps_per_core'] / bare['pps_per_core']:.2f}")
    print("\n3. link rate sweep: do the GPU hosts keep up? (MRC, one flow; "
          "= fabriclab calibrate)")
    with RunLock("bench/transport.py"):
        c = calibrate.measure(tuple(float(x) for x in a.sweep.split(",")))
    for r in c.sweep:
        print(f"   {r['rate_mbps']:6g} Mb/s: goodput {r['goodput_mbps']:.1f} Mb/s, sender CPU "
              f"{r['cpu_fraction']:.0%}: {'keeps up' if r['keeps_up'] else 'falls behind'}")
    print(f"\n   highest rate at which hosts keep up: "
          f"{f'{c.keep_up_mbps:g} Mb/s' if c.keep_up_mbps else 'none of those tried'}")


if __name__ == "__main__":
    main()
