"""fabriclab's command line (also `python -m lab`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
import time
from pathlib import Path

from lab.core import console
from lab.core.errors import LabError, Terminated, UsageError
from topologies.params import ParamError, key_value
from topologies.registry import TOPOLOGIES, build_topo

log = logging.getLogger(__name__)

# Options whose value is a comma-separated list of numbers, any of which may be negative
# (gradients are as often negative as positive). argparse takes a token that starts with
# "-" and is not a plain negative number ("-0.5,0.3") for an option, so the parser joins
# a value that starts with a minus and a digit to its option ("--values=-0.5,0.3") before
# parsing; the option's own check then says what is wrong with it, if anything.
NUMBER_LIST_OPTIONS = ("--values",)
_NEGATIVE_START = re.compile(r"-\.?\d")


def join_number_lists(argv: list[str]) -> list[str]:
    """argv with `--values -0.5,0.3` as `--values=-0.5,0.3` (nothing after `--`)."""
    out: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            out += [token, *tokens]
            break
        out.append(token)
        if token in NUMBER_LIST_OPTIONS:
            value = next(tokens, None)
            if value is None:
                break
            if _NEGATIVE_START.match(value):
                out[-1] = f"{token}={value}"
            else:
                out.append(value)
    return out


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), and a number list option
    (NUMBER_LIST_OPTIONS) takes a value starting with a minus sign."""

    def error(self, message: str):
        old = re.search(r"unrecognized arguments: --([\w-]+)", message)
        if old and old.group(1).replace("-", "_") in {"topology", *_topology_params()}:
            # the fabric's shape has one spelling, `run`'s: --set KEY=VALUE
            message += (f" (the fabric is set with --set KEY=VALUE, as for `run`: "
                        f"--set {old.group(1).replace('-', '_')}=...)")
        raise UsageError(message)

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(join_number_lists(args), namespace)


def _topology_params() -> set[str]:
    return {f.name for cls in TOPOLOGIES.values() for f in dataclasses.fields(cls.Params)}


def add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="the fabric, as for `run`: topology=" + "|".join(TOPOLOGIES) +
                        " (default leaf-spine) and its parameters (README, Topologies), "
                        "e.g. --set spines=4 --set hosts_per_leaf=8; repeatable")


def topology_from_args(args):
    """--set items -> the topology they describe."""
    try:
        values = dict(key_value(item) for item in args.set)
        return build_topo(values.pop("topology", "leaf-spine"), **values)
    except ParamError as e:
        raise UsageError(str(e)) from None


def add_runtime_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controller-runtime", choices=["os-ken", "ryu"], default="os-ken",
                   help="run the controller apps on os-ken (default) or on Ryu 4.34 "
                        "(installed on first use)")


# --- commands --------------------------------------------------------------------------
def cmd_doctor(args) -> int:
    from lab.fabric import doctor
    caps = doctor.capabilities()
    print(json.dumps(doctor.as_dict(caps), indent=1) if args.json else doctor.render(caps))
    return 0 if doctor.can_run(caps) else 1


def cmd_verify(args) -> int:
    from lab.fabric import verify
    from lab.session import Session
    topo = topology_from_args(args)
    if args.sample is not None and args.sample < 1:
        raise UsageError("--sample must be at least 1 (destinations per host)")
    print(verify.announce(verify.planned(topo.fabric, args.sample), args.sample))
    if args.machines:
        with _cluster(topo, args) as c:
            print(f"fabric ready on {len(args.machines)} machines in "
                  f"{c.timings['ready_s']:.1f} s; probing")
            report = c.verify(per_host=args.sample)
        timings = f"torn down in {c.timings['teardown_s']:.1f} s"
    else:
        with Session(topo, "fabriclab verify", verbose=args.verbose,
                     controller_runtime=args.controller_runtime) as s:
            net = s.net
            print(f"fabric ready in {net.timings['ready_s']:.1f} s; probing")
            pids = {h.name: net.host_pid(h.name) for h in net.fabric.hosts}
            t0 = time.monotonic()
            report = verify.measure(net.fabric, pids, per_host=args.sample)
            print(f"probed in {time.monotonic() - t0:.1f} s")
        timings = (f"built in {net.timings['build_s']:.1f} s, torn down in "
                   f"{net.timings['teardown_s']:.1f} s")
    for line in report.lines():
        print(line)
    _warn_wrong_hops(report)
    print(timings)
    return 0 if report.reachable == len(report.pairs) else 1


def _cluster(topo, args):
    from lab.cluster import Cluster
    return Cluster(topo, args.machines, reach=_reach(args),
                   controller_runtime=getattr(args, "controller_runtime", "os-ken"))


def _reach(args):
    """How the head reaches the other machines (lab/ssh.py), from --ssh,
    --remote-fabriclab and --wait."""
    from lab.ssh import Reach
    return Reach(**{k: v for k, v in (("ssh", args.ssh),
                                      ("remote_fabriclab", args.remote_fabriclab),
                                      ("connect_timeout_s", args.wait)) if v is not None})


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--machines", metavar="HEAD,[USER@]ADDR,...",
                   type=lambda v: [x for x in v.split(",") if x],
                   help="spread the fabric over machines: this machine's address, then each "
                        "other's as ssh reaches it; the head starts a worker on each over "
                        "ssh (README: A fabric across machines)")
    p.add_argument("--ssh", metavar="COMMAND",
                   help="with --machines: the ssh command, with your options (default ssh)")
    p.add_argument("--remote-fabriclab", metavar="PATH",
                   help="with --machines: the fabriclab command on the other machines "
                        "(default: this one's path)")
    p.add_argument("--wait", type=float, metavar="S",
                   help="with --machines: how long to keep trying a machine ssh cannot "
                        "reach yet (default 60)")


def _warn_wrong_hops(report) -> None:
    wrong = report.wrong_hops
    if wrong:
        p, r = wrong[0]
        print(f"warning: {len(wrong)} pairs took a longer path than the shortest "
              f"(e.g. {p.src}->{p.dst}: {r.hops} hops, expected {p.expected_hops})")


def cmd_cluster_worker(args) -> int:
    from lab import ssh
    from lab.cluster import Worker
    if sys.stdin.isatty():
        raise UsageError("a cluster worker is started by the head over ssh and speaks on "
                         "its stdin and stdout: run `fabriclab verify --machines "
                         "HEAD,[USER@]THIS,...` on the head (README: A fabric across machines)")
    channel = ssh.stdio_channel()
    console.attach("stderr")            # its log: what ssh shows the head
    Worker().serve(channel)
    return 0


def cmd_up(args) -> int:
    from mininet.log import setLogLevel

    from lab.session import Session
    from lab.shell import FabricCLI
    topo = topology_from_args(args)
    with Session(topo, "fabriclab up", verbose=args.verbose,
                 controller_runtime=args.controller_runtime) as s:
        net = s.net
        hosts = [h.name for h in net.fabric.hosts]
        leaf = net.fabric.host(hosts[0]).interface().switch
        print(f"{net.fabric.summary()} is up. GPU hosts {hosts[0]}..{hosts[-1]}; try:\n"
              f"  {hosts[0]} ping -c1 {net.fabric.hosts[-1].ip}\n"
              f"  flows {leaf}     queues {hosts[0]}     capture {hosts[0]} 10\n"
              f"  {leaf} ovs-ofctl -O OpenFlow15 dump-ports {leaf}\n"
              f"  help   (exit: Ctrl-D)")
        setLogLevel("info" if args.verbose else "output")   # the CLI prints at "output"
        FabricCLI(net.mininet, net.fabric)
    return 0


def cmd_list(args) -> int:
    from lab import runner
    for name, mod in sorted(runner.available().items()):
        fields = ", ".join(f"{f.name}={f.default}" for f in dataclasses.fields(mod.Params))
        print(f"{name:16} {mod.DESCRIPTION}\n{'':16} --set {fields}")
    return 0


def cmd_run(args) -> int:
    from lab import readable, report, runner
    console.attach("stderr" if args.json else "stdout")   # stdout: the JSON alone
    if args.repeat < 1:
        raise UsageError("--repeat must be at least 1")
    if args.capture_snaplen < 0:
        raise UsageError("--capture-snaplen must be 0 (whole frames) or more")
    across = {"machines": args.machines, "reach": _reach(args)} if args.machines else {}
    if args.repeat > 1:
        out, summary = runner.repeat(args.name, args.set or [], args.repeat, args.out,
                                     capture=args.capture,
                                     capture_mb=args.capture_mb,
                                     capture_snaplen=args.capture_snaplen,
                                     controller_runtime=args.controller_runtime,
                                     use_dataplane=args.congestion_datapath == "bpf", **across)
        if args.json:
            print(json.dumps(summary, indent=1))
        else:
            print(runner.render_repeat(summary))
            print(f"results: {out}/repeat.json (each run in {out}/run-N/)")
        return 0 if summary["all_held"] else 1
    workdir, result = runner.run(args.name, args.set or [], args.out, capture=args.capture,
                                 live=args.live, capture_mb=args.capture_mb,
                                 capture_snaplen=args.capture_snaplen,
                                 controller_runtime=args.controller_runtime,
                                 use_dataplane=args.congestion_datapath == "bpf", **across)
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0 if result["passed"] else 1
    print(summary_table(report.variants(result["metrics"])))
    for c in result["claims"]:
        print(f"  [{readable.verdict(c)}] {c['name']}: measured "
              f"{readable.claim_measured(c)}, expected {c['expected']}")
    print(f"results: {workdir}/metrics.json\nreport:  {workdir}/report.html "
          f"(and report.md)")
    return 0 if result["passed"] else 1


def cmd_tour(args) -> int:
    import time

    from lab import readable, tour
    from lab.fabric import calibrate
    t0 = time.monotonic()
    t_calibrated = 0.0
    if calibrate.load() is None:   # once per machine: the defaults must fit its speed
        from lab.core.state import RunLock
        log.info("calibrating this machine first (once; `fabriclab calibrate` redoes it)")
        with RunLock("fabriclab tour: calibrating"), console.nested():
            calibrate.save(calibrate.measure())
        t_calibrated = time.monotonic() - t0
    out, done = tour.run(args.out, args.only)
    failed = [r for r in done if r.error]
    claims = [c for r in done for c in r.claims]
    held = sum(c["passed"] for c in claims)
    print(f"tour: {len(done) - len(failed)}/{len(done)} chapters ran, {held}/{len(claims)} "
          f"claims hold, {(time.monotonic() - t0) / 60:.1f} min")
    print(f"  time: {tour.render_split(tour.time_split(done))}" + (
        f", calibration {t_calibrated / 60:.1f} min" if t_calibrated else ""))
    for r in done:
        for c in r.claims:
            if not c["passed"]:
                print(f"  [{readable.verdict(c)}] {r.chapter.experiment}: {c['name']}: "
                      f"measured {readable.claim_measured(c)}, expected {c['expected']}")
    for r in failed:
        print(f"  [DID NOT RUN] {r.chapter.experiment}: {r.error}")
    if failed:
        print(f"warning: {len(failed)} chapter(s) could not run on this machine; where the "
              f"chapters warn that hosts were CPU-bound, the machine is too slow for the "
              f"default link rates (see bench/fidelity.py and docs/)")
    print(f"report: {out / 'index.html'} (and index.md)")
    return 1 if args.strict and (failed or held < len(claims)) else 0


def cmd_calibrate(args) -> int:
    from lab.core.state import RunLock
    from lab.fabric import calibrate
    print(f"calibrating: one GPU host's flow at rising link rates until it falls behind, "
          f"then {calibrate.BUSY_PAIRS} flows at once")
    with RunLock("fabriclab calibrate"):
        c = calibrate.measure(tuple(args.rates) if args.rates else calibrate.SWEEP_MBPS,
                              tuple(args.busy_rates) if args.busy_rates
                              else calibrate.BUSY_SWEEP_MBPS)
    path = calibrate.save(c)
    print(f"this machine's GPU hosts keep up with {c.keep_up_mbps:g} Mb/s (reference "
          f"{calibrate.REFERENCE_KEEP_UP_MBPS:g}), {c.busy_keep_up_mbps:g} Mb/s with "
          f"{2 * calibrate.BUSY_PAIRS} busy at once (reference "
          f"{calibrate.REFERENCE_BUSY_KEEP_UP_MBPS:g}): experiments' default rates and "
          f"sizes run x{c.factor:.2f} with 2 hosts busy, down to x{c.busy_factor:.2f} with "
          f"{2 * calibrate.BUSY_PAIRS}; saved in {path}")
    return 0


def cmd_top(args) -> int:
    import time

    from lab.fabric.telemetry import QueueTelemetry, render
    if args.interval <= 0:
        raise UsageError("--interval must be positive")
    tel = QueueTelemetry(None, None, interval_ms=min(10.0, args.interval * 1000))
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    previous, shown = {}, 0
    with tel:
        while not args.count or shown < args.count:
            time.sleep(args.interval)
            hot = tel.hottest(args.n)
            body = render(hot, previous) if hot else "no lab switch queues (is a fabric up?)"
            print(f"{clear}fabriclab top  {time.strftime('%H:%M:%S')}  (Ctrl-C to stop)\n"
                  f"{body}", flush=True)
            previous, shown = tel.latest(), shown + 1
    return 0


def summary_table(sections: dict[str, dict], rows_max: int = 14) -> str:
    """The variants' numbers side by side: a row per measurement, a column per variant."""
    from lab.report import scalars
    if not sections:
        return ""
    names = list(sections)
    keys: list[str] = []
    for s in sections.values():
        keys += [k for k in scalars(s) if k not in keys]
    width = max(len(k) for k in keys[:rows_max])
    lines = [f"{'':{width}}  " + "  ".join(f"{n:>12}" for n in names)]
    for k in keys[:rows_max]:
        cells = [scalars(sections[n]).get(k) for n in names]
        lines.append(f"{k:{width}}  " + "  ".join(
            f"{c:>12.4g}" if isinstance(c, float) else f"{'' if c is None else c:>12}"
            for c in cells))
    return "\n".join(lines)


def cmd_clean(args) -> int:
    from lab.core.state import RunLock
    from lab.fabric import cleanup
    with RunLock("fabriclab clean"):
        found = cleanup.clean()
    total = sum(len(v) for v in found.values())
    if not total:
        print("nothing to clean: no lab objects on this machine")
    for kind, items in found.items():
        if items:
            names = [i["role"] + f" pid {i['pid']}" if isinstance(i, dict) else i for i in items]
            print(f"removed {len(items)} {kind}: {', '.join(names[:8])}"
                  + (" ..." if len(names) > 8 else ""))
    return 0


def cmd_samples(args) -> int:
    from traffic.samples import WIRESHARK_LUA, write_samples
    try:
        samples = write_samples(args.out)
    except OSError as e:
        raise LabError(f"cannot write {args.out}: {e.strerror or e}") from None
    for number, (description, _) in enumerate(samples, start=1):
        print(f"{number:3}  {description}")
    print(f"wrote {len(samples)} frames to {args.out}; open it with the lab's Lua dissector "
          f"to see the MRC fields:\n"
          f"  wireshark -X lua_script:{WIRESHARK_LUA} {args.out}\n"
          f"(or copy {WIRESHARK_LUA.name} into ~/.local/lib/wireshark/plugins/ to load it always)")
    return 0


def cmd_inspect(args) -> int:
    from lab import inspect
    s = inspect.settings_of_run(args.pcap)
    if args.rate_mbps:
        s.rate_mbps = args.rate_mbps
    if args.cnp_interval_ms:
        s.cnp_interval_ms = args.cnp_interval_ms
    if args.reaction_grace_ms is not None:
        s.reaction_grace_ms = args.reaction_grace_ms
    for pair in args.paused_mac or []:
        pausing, _, paused = pair.partition("=")
        if not paused:
            raise UsageError(f"--paused-mac takes PAUSING_MAC=PAUSED_MAC, got {pair!r}")
        s.paused_macs[pausing.lower()] = paused.lower()
    report = inspect.inspect(args.pcap, s)
    print(json.dumps(report, indent=1) if args.json else inspect.render(report))
    return 1 if report["violations"] else 0


def _values(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise UsageError(f"--values takes numbers separated by commas, got {text!r}") from None
    if len(values) < 2:
        raise UsageError("--values needs at least two values (one per GPU host)")
    return values


def cmd_allreduce(args) -> int:
    import numpy as np

    from lab.fabric import collective
    from lab.session import Session
    if args.values is None and args.size_mb is None:
        raise UsageError("give --values V1,V2,... or --size-mb MB")
    if args.values is not None:
        tensors = [np.array([v], np.float32) for v in _values(args.values)]
    else:
        if args.size_mb <= 0 or args.gpus < 2:
            raise UsageError("--size-mb must be positive and --gpus at least 2")
        rng = np.random.default_rng(args.seed)
        elems = max(1, int(args.size_mb * 1e6 / 4))
        tensors = [rng.standard_normal(elems).astype(np.float32) for _ in range(args.gpus)]
    topo = collective.fabric_for(len(tensors), args.algorithm)
    with _cluster(topo, args) if args.machines else Session(topo, "fabriclab allreduce") as s:
        net = s if args.machines else s.net
        where = f" on {len(args.machines)} machines" if args.machines else ""
        print(f"all-reduce ({args.algorithm}, {args.transport}) of "
              f"{tensors[0].nbytes:,} bytes per GPU over {len(tensors)} GPU hosts{where}")
        m = collective.run(net, tensors, args.transport, algorithm=args.algorithm)
    for host, value, result, err in zip(m["hosts"], tensors, m["results"], m["per_host_error"]):
        if args.values is not None:
            print(f"  {host}: {value[0]:g} -> {result[0]:g}")
        else:
            print(f"  {host}: max |result - numpy mean| = {err:.2e}")
    verdict = "every host agrees with" if m["agree"] else "HOSTS DISAGREE with"
    print(f"{verdict} the numpy mean (max error {m['max_abs_error']:.2e})")
    print(f"time {m['time_s'] * 1000:.1f} ms  algbw {m['algbw_mbps']:.2f} Mb/s  busbw "
          f"{m['busbw_mbps']:.2f} Mb/s ({m['busbw_over_link']:.0%} of the "
          f"{m['link_rate_mbps']:.0f} Mb/s link)  retransmitted {m['retransmitted_packets']}")
    return 0 if m["agree"] else 1


def cmd_htsim_export(args) -> int:
    from topologies import htsim
    fabric = topology_from_args(args).fabric
    size = args.size_kb * 1024
    try:
        flows = htsim.incast_flows(fabric, args.senders, size) if args.traffic == "incast" \
            else htsim.permutation_flows(fabric, size, args.seed)
        topo_text = htsim.topology_text(fabric)
        matrix = htsim.connection_matrix_text(fabric, flows)
        shape = htsim.leaf_spine_shape(fabric)
    except ValueError as e:
        raise UsageError(f"htsim cannot take this: {e}") from None
    args.out.mkdir(parents=True, exist_ok=True)
    topo, tm = args.out / "fabric.topo", args.out / f"{args.traffic}.cm"
    topo.write_text(topo_text)
    tm.write_text(matrix)
    print(f"{shape.nodes} GPU hosts, {len(flows)} flows of {args.size_kb} KB ({args.traffic})")
    print(f"  topology: {topo}\n  connections: {tm}")
    print(f"run it with one of htsim's datacenter drivers (bench/htsim_scale.py runs three):\n"
          f"  htsim_roce -topo {topo} -tm {tm} -nodes {shape.nodes} -linkspeed "
          f"{shape.host_link_gbps * 1000} -mtu 1024 -q 64 -end 100000")
    return 0


def cmd_ovs_start(args) -> int:
    from lab.kernel import ovs
    kind = ovs.ensure_running()
    print(f"Open vSwitch running ({kind} datapath)")
    return 0


def build_parser() -> Parser:
    p = Parser(prog="fabriclab", description="Packet-level emulation lab for AI-datacenter "
                                             "networking.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    d = sub.add_parser("doctor", help="what this machine can do, and what is missing")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_doctor)
    for name, func, text in (("verify", cmd_verify, "build a fabric, check all-pairs "
                                                    "reachability, tear it down"),
                             ("up", cmd_up, "build a fabric and open its shell (Mininet's "
                                            "CLI with the lab's commands: flows, queues, "
                                            "capture)")):
        s = sub.add_parser(name, help=text)
        add_topology_args(s)
        s.add_argument("--verbose", "-v", action="store_true", help="Mininet's own log")
        add_runtime_arg(s)
        if name == "verify":
            s.add_argument("--sample", type=int, metavar="N",
                           help="probe N random destinations of each host, not every pair "
                                "(at 1024 hosts all pairs are a million probes)")
            add_cluster_args(s)
        s.set_defaults(func=func)
    sub.add_parser("list", help="the experiments").set_defaults(func=cmd_list)
    r = sub.add_parser("run", help="run an experiment; results in results/NAME-TIME/")
    r.add_argument("name")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="an experiment or topology parameter (repeatable)")
    r.add_argument("--out", type=Path, help="results directory")
    r.add_argument("--json", action="store_true", help="print metrics.json")
    r.add_argument("--capture", type=lambda v: [x for x in v.split(",") if x], default=[],
                   metavar="PORTS", help="pcap these switch ports (SWITCH:PORT, interface "
                   "or GPU host, comma-separated) into captures/")
    r.add_argument("--capture-mb", type=float, default=20.0, metavar="MB",
                   help="size cap of each port's pcap (default 20)")
    r.add_argument("--capture-snaplen", type=int, default=0, metavar="BYTES",
                   help="keep the first BYTES of each frame (128: every header up to "
                        "RoCE's, so the cap holds ~10x the frames); default 0: all")
    r.add_argument("--live", action="store_true",
                   help="print the hottest queues every second while it runs")
    r.add_argument("--congestion-datapath", choices=["bpf", "sampling"], default="bpf",
                   help="ECN marking and the PFC trigger per packet in the switch ports' BPF "
                        "programs (default, where the kernel allows), or by the controller "
                        "sampling the queues every millisecond (the fallback)")
    r.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run it N times (results in OUT/run-1..N) and report each claim's "
                        "pass rate (repeat.json)")
    add_cluster_args(r)
    add_runtime_arg(r)
    r.set_defaults(func=cmd_run)
    tr = sub.add_parser("tour", help="the lab's story, experiment by experiment, in one report "
                                     "(results/tour-TIME/index.html)")
    tr.add_argument("--out", type=Path, help="results directory")
    tr.add_argument("--only", type=lambda v: [x for x in v.split(",") if x], metavar="CHAPTERS",
                    help="chapters to run, by number or experiment (comma-separated)")
    tr.add_argument("--strict", action="store_true",
                    help="exit 1 when a chapter cannot run or a claim fails (by default the "
                         "tour reports them and exits 0 once its report is written)")
    tr.set_defaults(func=cmd_tour)
    ca = sub.add_parser("calibrate", help="measure the link rate this machine's GPU hosts keep "
                                     "up with; the experiments' defaults then fit it"
                   )
    ca.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",") if x],
                    metavar="MBPS", help="the link rates to try, rising (default "
                    "5,10,20,50,100,200)")
    ca.add_argument("--busy-rates", type=lambda v: [float(x) for x in v.split(",") if x],
                    metavar="MBPS", help="the link rates to try with 4 flows at once, "
                    "rising (default 1.25,2.5,5,10)")
    ca.set_defaults(func=cmd_calibrate)
    t = sub.add_parser("top", help="the lab's hottest switch queues, live (any running fabric)")
    t.add_argument("--interval", type=float, default=0.5, metavar="S")
    t.add_argument("--count", type=int, default=0, help="stop after this many screens")
    t.add_argument("-n", type=int, default=12, help="queues to show")
    t.set_defaults(func=cmd_top)
    sub.add_parser("clean", help="remove everything the lab created (and nothing else)"
                   ).set_defaults(func=cmd_clean)
    a = sub.add_parser("allreduce", help="all-reduce values over a small fabric; every host "
                                         "prints its result")
    a.add_argument("--values", metavar="V1,V2,...",
                   help="one value per GPU host, e.g. 0.7,0.9,0.6,0.8; negative values "
                        "too, either spelling: --values -0.5,0.3 or --values=-0.5,0.3")
    a.add_argument("--size-mb", type=float, help="all-reduce random float32 tensors of this size")
    a.add_argument("--gpus", type=int, default=4, help="GPU hosts with --size-mb (default 4)")
    a.add_argument("--transport", choices=["rc", "mrc"], default="rc")
    a.add_argument("--algorithm", choices=["ring", "tree", "hier"], default="ring",
                   help="hier: inside each rack over scale-up links, then across racks")
    a.add_argument("--seed", type=int, default=1)
    add_cluster_args(a)
    a.set_defaults(func=cmd_allreduce)
    ins = sub.add_parser("inspect", help="what a capture (the lab's or real hardware's) shows "
                         "per flow, and the protocol rules it breaks; exit 1 if any")
    ins.add_argument("pcap", type=Path, metavar="PCAP")
    ins.add_argument("--rate-mbps", type=float, help="the link's rate (a pause's length); "
                     "a capture in a lab run's captures/ knows it")
    ins.add_argument("--cnp-interval-ms", type=float,
                     help="DCQCN's CNP interval (default 0.05, a lab run's own if known)")
    ins.add_argument("--reaction-grace-ms", type=float, help="how long after a pause or a "
                     "SACK passed the capture a host may still send what it stops (default 2: "
                     "the lab's NICs react in software)")
    ins.add_argument("--paused-mac", action="append", metavar="PAUSING=PAUSED",
                     help="the paused end's MAC for a MAC that sends pauses (default: every "
                          "other MAC); repeatable")
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    ins.set_defaults(func=cmd_inspect)
    hx = sub.add_parser("htsim-export", help="a fabric and its traffic as htsim's topology "
                        "and connection-matrix files, to simulate sizes no emulation reaches")
    add_topology_args(hx)
    hx.add_argument("--traffic", choices=["incast", "permutation"], default="permutation")
    hx.add_argument("--senders", type=int, default=8, help="incast: senders into the first "
                    "host (default 8)")
    hx.add_argument("--size-kb", type=int, default=1200, help="per flow (default 1200)")
    hx.add_argument("--seed", type=int, default=1, help="permutation: its random cycle")
    hx.add_argument("--out", type=Path, default=Path("htsim-export"), help="where the files go")
    hx.set_defaults(func=cmd_htsim_export)
    cl = sub.add_parser("cluster", help="a fabric over several machines (OVS VXLAN tunnels "
                        "between them, one controller on the first)")
    clsub = cl.add_subparsers(dest="cluster_command", required=True, parser_class=Parser)
    cw = clsub.add_parser("worker", help="started by a cluster's head over ssh: build this "
                          "machine's part when asked, take it down when the head is done "
                          "or gone (speaks on stdin and stdout; listens on nothing)")
    cw.set_defaults(func=cmd_cluster_worker)
    sm = sub.add_parser("samples", help="write a pcap with one frame of each kind the lab sends")
    sm.add_argument("--out", type=Path, required=True, metavar="FILE.pcap", help="pcap to write")
    sm.set_defaults(func=cmd_samples)
    sub.add_parser("ovs-start", help="start Open vSwitch for the lab (used by provisioning)"
                   ).set_defaults(func=cmd_ovs_start)
    from lab import vm   # the lab VM's subcommands live with it (lab/vm/)
    vm.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        console.attach()      # the lab's progress lines (logging), elapsed time first
        return args.func(args)
    except LabError as e:
        print(f"fabriclab: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("fabriclab: interrupted; everything the lab built was torn down", file=sys.stderr)
        return 130
    except Terminated:
        print("fabriclab: terminated; everything the lab built was torn down", file=sys.stderr)
        return 143
