"""A fabric across machines, for real: two lab VMs on one host joined by a virtual
network (lab/vm/pair.py), a leaf-spine split between them, its crossing links in OVS
VXLAN tunnels (lab/cluster.py). Run by `make test` after the kernel tier (`-m cluster`);
it boots the VMs from the host, so it runs natively, never inside a VM."""
import json
import os
import re
import shutil

import pytest

import wire
from lab.vm import pair
from lab.vm.image import REPO
from topologies.fabric import Fabric, interface_name
from traffic import pause
from traffic.constants import PRIORITY_ROCE_DATA

pytestmark = pytest.mark.cluster
MACHINES = f"{pair.address(0)},{pair.target(1)}"
# "required" (CI, .ci/run): a host without room for two lab VMs fails the tier instead of
# skipping it
REQUIRED_ENV = "FABRICLAB_CLUSTER_TIER"


@pytest.fixture(autouse=True)
def room_for_two_lab_vms():
    """A host without the memory for two lab VMs (a 4 GB Vagrant VM) skips the tier,
    saying why (`make test` prints it: -rs); CI requires it."""
    why = pair.room()
    if why and os.environ.get(REQUIRED_ENV) == "required":
        pytest.fail(why)
    if why:
        pytest.skip(f"the cluster tier did not run: {why}")


def test_every_pair_reachable_and_an_allreduce_ring_across_two_lab_vms():
    """Two heads in turn, each starting its worker on machine 1 over ssh:
    1. verify: 4 leaves of 2 GPUs and 2 spines, each machine a spine and two leaves with
       their GPUs, so every path between the halves crosses the tunnel: every one of
       the 56 pairs answers, over a shortest path (the verify warns of any longer one).
    2. all-reduce of 0.7, 0.9, 0.6, 0.8 over 4 GPUs (2 per leaf, a leaf per machine):
       the ring g0 g1 g2 g3 crosses between the machines twice; the GPU agents of
       machine 1 run there, driven by the head through the worker; every host holds
       0.75, the numpy mean.
    Both machines take their parts down (machine 1's log reaches the head through
    ssh) and exit 0."""
    head, worker = pair.run_cluster(
        f"fabriclab verify --machines {MACHINES} --set spines=2 --set leaves=4 "
        f"--set hosts_per_leaf=2 && fabriclab allreduce --machines {MACHINES} "
        f"--values 0.7,0.9,0.6,0.8", timeout_min=20, echo=None)
    out = "\n".join(head.lines)
    assert head.exit_code == 0, out
    assert "reachable: 56/56 host pairs" in out, out
    assert re.search(r"\b4 links cross\b", out), out
    assert "longer path" not in out, out
    for host, value in (("g0", "0.7"), ("g1", "0.9"), ("g2", "0.6"), ("g3", "0.8")):
        assert re.search(rf"^\s*{host}: {value} -> 0\.75$", out, re.M), out
    assert "every host agrees with the numpy mean" in out, out
    assert worker.exit_code == 0, "\n".join(worker.lines)
    assert sum(re.search(r"\[machine 1\] .*the part is down", ln) is not None
               for ln in head.lines) == 2, out


def test_an_incast_with_pfc_frames_crossing_the_tunnel():
    """tests/cluster/pfc_incast.py on the head: 4 GPUs of machine 1 send 200 KB each to g0
    on machine 0 over the 2-spine 4-leaf fabric, PFC on (no ECN), each machine's own
    congestion app and data path handling its switches. The receiver's leaf pauses the
    spines feeding it, one across the tunnel, and the spines pause the senders' leaves,
    across it the other way: PFC frames cross both ways, and each is honoured where it
    arrives. Lossless and in order: every flow intact, every frame sent received once
    and in order (no NAK, no resend), no queue drop, none lost in the tunnel; and for
    every crossing link the PFC frames one end sent are the frames the other end
    received, on the other machine."""
    head, worker = pair.run_cluster(f"python3 tests/cluster/pfc_incast.py {MACHINES}",
                                    timeout_min=20, echo=None)
    out = "\n".join(head.lines)
    print(out)          # (shown when the test fails)
    assert head.exit_code == 0, out
    found = re.search(r"RESULT (\{.*\})\s*$", out, re.M)
    assert found, out
    result = json.loads(found.group(1))
    assert result["placement"] == {"g0": 0, "g4": 1, "g5": 1, "g6": 1, "g7": 1}, out
    # machine 1's worker, its part up, starts nothing but an agent in a host of its own
    code, elsewhere = result["forged"]
    assert code and "not a GPU agent's arguments" in code, result["forged"]
    assert elsewhere and "g0 is not a host of this machine's part" in elsewhere, result["forged"]
    flows = result["flows"]
    assert len(flows) == 4 and all(f["completion_s"] is not None and f["intact"]
                                   for f in flows), flows
    # lossless: every frame a sender sent (its resends too) reached the receiver, no
    # queue dropped one, and what each crossing port sent into the tunnel arrived at the
    # far port; no retransmission timer fired; and in order: no receiver NAKed, nothing
    # was resent. (Receivers NAKed frames that arrived out of order, none lost, until
    # RC's first packet travelled alone and every link end steered a flow to one CPU:
    # README, a fabric across machines.)
    assert all(f["sender"]["sent"] == f["receiver"]["received"] and f["timeouts"] == 0
               for f in flows), flows
    assert all(f["naks_sent"] == 0 and f["retransmitted"] == 0
               and f["receiver"]["out_of_order"] == 0 for f in flows), flows
    queues = result["queues"]
    assert queues and not any(c["drop_packets"] for c in queues.values()), queues

    def pfc(node: str, port: int) -> dict:
        return result["counters"].get(f"{node}:{port}", {}).get(str(PRIORITY_ROCE_DATA), {})
    crossed = 0
    for c in result["crossings"]:
        for (src, sp), (dst, dp) in ((("a", "a_port"), ("b", "b_port")),
                                     (("b", "b_port"), ("a", "a_port"))):
            sent = pfc(c[src], c[sp]).get("pause_frames_sent", 0)
            received = pfc(c[dst], c[dp]).get("pause_frames_received", 0)
            assert sent == received, (c, src, sent, received)
            crossed += sent
            out, came = (queues[f"{c[src]}:{c[sp]}"]["out_packets"],
                         queues[f"{c[dst]}:{c[dp]}"]["rx_packets"])
            assert out == came, (c, src, out, came)
    assert crossed > 0, result["counters"]
    assert any(f["pause_frames_received"] for f in flows), flows   # the senders paused too
    assert worker.exit_code == 0, "\n".join(worker.lines)


def test_fabriclab_run_incast_across_two_machines_gathers_its_results_on_the_head():
    """`fabriclab run incast --machines` on the head (PFC, 7 senders to g0 over the 2-spine
    4-leaf fabric: g1-g3 on machine 0, g4-g7 on machine 1, each at 2 Mb/s; its
    headroom's response 60 ms and a 192 KB buffer, as pauses between two software-CPU
    VMs need: tests/cluster/pfc_incast.py says why): every claim holds (intact, no drop at the bottleneck, pause frames sent),
    and the results are the head's: config.json names the machines, where each node
    ran and how far machine 1's clock was off; queues.csv holds both machines' switch
    queues; the captures of machine 1's ports were made there and copied into the
    head's results. Counters equal the wire: the PFC frames the senders' NICs took in
    are the frames captured on their switch ports (machine 1's among them), and the
    PFC frames the receiver's leaf sent are those captured leaving its ports."""
    out = "results/cluster-incast"
    shutil.rmtree(REPO / out, ignore_errors=True)
    settings = ("spines=2 leaves=4 hosts_per_leaf=2 host_rate_mbps=2 fabric_rate_mbps=2 "
                "senders=7 variants=pfc pfc_flow_kb=200 pfc_response_ms=60 buffer_kb=192").split()
    head, worker = pair.run_cluster(
        f"fabriclab run incast --machines {MACHINES} --out {out} "
        + " ".join(f"--set {kv}" for kv in settings)
        + " --capture fl-lf0,g2,g3,g4,g5,g6,g7", timeout_min=25, echo=None)
    log = "\n".join(head.lines)
    print(log)          # (shown when the test fails)
    try:
        assert head.exit_code == 0, log
        results = REPO / out
        config = json.loads((results / "config.json").read_text())
        where = config["machines"]["placement"]
        assert [where[f"g{i}"] for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1], where
        assert "1" in config["machines"]["clock_offsets_ms"], config["machines"]
        m = json.loads((results / "metrics.json").read_text())
        assert m["passed"], m["claims"]
        pfc = m["metrics"]["pfc"]
        assert pfc["drops_packets"] == 0 and pfc["drops_elsewhere"] == {}, pfc
        switches = {row.split(",")[1] for row in
                    (results / "queues.csv").read_text().splitlines()[1:]}
        assert {"fl-lf0", "fl-lf3"} <= switches, switches       # one of each machine
        fabric = Fabric.load(results / "fabric.json")
        ports = m["metrics"]["captures"]["ports"]
        assert all(p["dropped_by_tcpdump"] == 0 and not p["reached_cap"]
                   for p in ports.values()), ports
        frames = {i: wire.read(results / "captures" / f"{i}.pcap") for i in ports}

        def port_of(host: str) -> str:
            i = fabric.host(host).interface()
            return interface_name(i.switch, i.port)
        senders = [f"g{i}" for i in range(1, 8)]
        paused = {h: sum(f.pfc(PRIORITY_ROCE_DATA) is not None for f in frames[port_of(h)])
                  for h in senders}
        assert sum(paused.values()) == pfc["sender_pause_frames_received"], paused
        assert sum(paused[h] for h in senders if where[h] == 1) > 0, paused
        lf0 = next(s for s in fabric.switches if s.name == "fl-lf0")
        sent = sum(f.pfc(PRIORITY_ROCE_DATA) is not None
                   and f.src_mac == pause.port_mac(lf0.dpid, int(i.rpartition("eth")[2]))
                   for i in ports if i.startswith("fl-lf0-") for f in frames[i])
        assert sent == pfc["pause_frames_sent"] > 0, (sent, pfc["pfc_frames_sent"])
        assert worker.exit_code == 0, "\n".join(worker.lines)
    finally:
        shutil.rmtree(REPO / out, ignore_errors=True)
