"""The lab's side of congestion handling: ECN mode and PFC for a running fabric.

    set_congestion(net, CongestionParams(ecn="auto", pfc=True))

resolves the ECN mode ("auto": kernel RED where this kernel has sch_red, else the
per-packet marking of the BPF data path (lab/kernel/dataplane.py), else the controller's
sampled marking), puts RED on or off the switches' RoCE queues, hands the
controller its configuration (controllers/congestion.py) and waits until it has
applied it. `read_state(net)` returns the controller's counters.

Thresholds are in bytes of the emulated queues; the defaults suit the default
64 KB RoCE buffer. ECN marks from Kmin 2 KB to Kmax 16 KB with Pmax 0.2 (HPCC's
DCQCN setting), so DCQCN holds the queue at a few frames.

PFC, where the BPF data path runs, is accounted per ingress port as shared-buffer
switches do (lab/kernel/dataplane.bpf.c): each queue keeps headroom for every port that
feeds it, 2 x (link delay + response) x rate + 2 MTU each, and an ingress port
pauses when the bytes it sent into the switch pass alpha (`pfc_alpha`) x the free
part of the queue above that headroom, or `xoff_kb` if less; it resumes at the same
ratio of `xon_kb`. The response is the lab's own: from the frame that crosses the
threshold to the upstream sender stopping (the program's signal, the controller's
wake-up, the pause frame, the sender's transport or gate). Measured on 2 cores
(bench/reaction.py, the incast): p99 0.6 ms, p99.9 under 1.5 ms, so
`pfc_response_ms` is 1 ms on the reference machine, stretched on a slower one as
the sampling period is. Without the data path (the controller samples the queues,
1 ms) XOFF and XON apply to each queue's backlog and a pause goes to every port
that feeds it: 56 KB above XOFF at 8 KB held what 8 senders resuming together
sent before the pause held (40-58 KB), and 14 KB overflowed now and then.

Packet trimming (`trim`, the BPF data path only): a RoCE data frame that would take its
switch queue past `trim_kb` (0: the buffer, so trimming replaces the drops) is cut to
its headers and sent on with DSCP DSCP_TRIMMED (traffic/constants.py: the fabric's one
value, which receivers know trimmed headers by), in the CNPs' strict-priority class;
an MRC receiver answers it with a NACK and the sender resends that packet at once.

PFC protects the priorities listed in `lossless` ("3": RoCE data), each with its own
XOFF/XON: "3,0:12/6" makes priority 0 lossless too, pausing at 12 KB and resuming at
6 KB of its class's backlog (a priority without its own pair uses xoff_kb/xon_kb).
"""
from __future__ import annotations

import dataclasses
import subprocess
import time
from dataclasses import dataclass

from controllers import protocol
from lab.core.errors import LabError, UsageError
from lab.fabric import doctor
from lab.fabric import events as lab_events
from lab.kernel import queues
from traffic.constants import DSCP_TRIMMED, PRIORITY_ROCE_DATA

ECN_MODES = ("auto", "red", "bpf", "controller", "off")
# The controller's sampling period on the reference machine. On a slower one the runner
# lowers the link rates (lab/fabric/calibrate.py) and the period stretches with them: its
# marking lag is part of the control loop DCQCN's constants were tuned on
# (traffic/dcqcn.py). Measured with the 8-to-1 incast at x0.10 rates (1 Mb/s, 1200 KB
# flows): sampling every 1 ms left a sender 33% off the fair share, every 10 ms 7% and
# 12% (2 runs), as the incast does at full rate and 1 ms.
REFERENCE_SAMPLE_MS = 1.0
# The PFC response the data path's headroom is sized for on the reference machine
# (the module's docstring says what was measured); stretched on a slower one.
REFERENCE_RESPONSE_MS = 1.0


@dataclass
class CongestionParams:
    ecn: str = "off"            # auto | red | controller | off
    kmin_kb: float = 2.0
    kmax_kb: float = 16.0
    pmax: float = 0.2
    pfc: bool = False
    xoff_kb: float = 8.0
    xon_kb: float = 4.0
    lossless: str = str(PRIORITY_ROCE_DATA)   # PFC priorities: "PRIO[:XOFF_KB/XON_KB],..."
    pause_quanta: int = 0xFFFF
    pfc_response_ms: float = 0.0    # the headroom's response time; 0: the machine's default
    pfc_alpha: float = 1.0      # per-ingress dynamic threshold: alpha x the free buffer
    sample_ms: float = 0.0      # how often the controller reads the queues; 0: auto,
    # REFERENCE_SAMPLE_MS stretched on a machine slower than the reference (see it above)
    watchdog_ms: float = 500.0  # report a queue paused longer than this
    trim: bool = False          # trim RoCE data instead of dropping it (the data path)
    trim_kb: float = 0.0        # ...past this backlog; 0: the RoCE buffer

    def thresholds_kb(self) -> dict[int, tuple[float, float]]:
        """Lossless priority -> (XOFF, XON) in KB, from `lossless`."""
        out = {}
        for item in filter(None, (x.strip() for x in self.lossless.split(","))):
            prio, _, pair = item.partition(":")
            try:
                xoff, xon = (float(v) for v in pair.split("/")) if pair else (self.xoff_kb,
                                                                             self.xon_kb)
                out[int(prio)] = (xoff, xon)
            except ValueError:
                raise UsageError(f"lossless: {item!r} is not PRIO or PRIO:XOFF_KB/XON_KB "
                                 f"(e.g. '3' or '3,0:12/6')") from None
        return out

    def validate(self, q: queues.QueueParams) -> None:
        if self.ecn not in ECN_MODES:
            raise UsageError(f"ecn must be one of {', '.join(ECN_MODES)}, got {self.ecn!r}")
        if not 0 < self.kmin_kb < self.kmax_kb <= q.buffer_kb:
            raise UsageError(f"need 0 < kmin_kb < kmax_kb <= buffer_kb ({q.buffer_kb}); got "
                             f"kmin_kb={self.kmin_kb}, kmax_kb={self.kmax_kb}")
        if not 0 < self.pmax <= 1:
            raise UsageError(f"pmax must be in (0, 1], got {self.pmax}")
        for prio, (xoff, xon) in (self.thresholds_kb() if self.pfc else {}).items():
            buffer_kb = q.buffer_bytes(prio) / 1024 if 0 <= prio <= 7 else 0
            if not buffer_kb:
                raise UsageError(f"lossless: priority {prio} is not one of 0-7")
            if not 0 < xon < xoff < buffer_kb:
                raise UsageError(f"need 0 < xon_kb < xoff_kb < the buffer of priority {prio} "
                                 f"({buffer_kb:g} KB); got xon_kb={xon}, xoff_kb={xoff}")
        if self.sample_ms < 0:
            raise UsageError("sample_ms must be positive (or 0: the machine's default)")
        if self.pfc_response_ms < 0:
            raise UsageError("pfc_response_ms must be positive (or 0: the machine's default)")
        if not 0 < self.pfc_alpha <= 64:
            raise UsageError(f"pfc_alpha must be in (0, 64], got {self.pfc_alpha}")
        if not 0 <= self.trim_kb <= q.buffer_kb:
            raise UsageError(f"trim_kb must be in [0, buffer_kb ({q.buffer_kb})] (0: the "
                             f"buffer), got {self.trim_kb}")

    def trim_bytes(self, q: queues.QueueParams) -> int:
        """Where trimming starts (0: off)."""
        if not self.trim:
            return 0
        return int(self.trim_kb * 1024) or q.buffer_bytes(PRIORITY_ROCE_DATA)

    def sample_period_ms(self, machine_factor: float) -> float:
        return self.sample_ms or REFERENCE_SAMPLE_MS / machine_factor

    def response_ms(self, machine_factor: float) -> float:
        return self.pfc_response_ms or REFERENCE_RESPONSE_MS / machine_factor

    def red(self) -> queues.RedParams:
        return queues.RedParams(self.kmin_kb, self.kmax_kb, self.pmax)


def resolve_ecn(mode: str, dataplane: bool) -> str:
    """'auto' -> 'red' where the kernel has sch_red, else 'bpf' where the data path
    runs, else 'controller'."""
    if mode == "red" and not doctor.qdisc_available("red"):
        raise LabError("ECN mode 'red' needs the kernel's sch_red, which this kernel lacks; "
                       "use ecn=bpf here, or run in the lab VM (fabriclab vm) or "
                       "the Vagrant VM")
    if mode == "bpf" and not dataplane:
        raise LabError("ECN mode 'bpf' needs the lab's BPF data path, which is not running "
                       "(fabriclab doctor says why); use ecn=controller")
    if mode != "auto":
        return mode
    if doctor.qdisc_available("red"):
        return "red"
    return "bpf" if dataplane else "controller"


def set_red(net, red: queues.RedParams | None) -> None:
    """Put kernel RED (ECN) under every switch port's RoCE gate, or a plain FIFO back."""
    q = dataclasses.replace(net.queue_params, red=red)
    lines = [queues.roce_queue_command(intf, rate, q)
             for _, _, intf, rate in queues.switch_ports(net.fabric)]
    r = subprocess.run(["tc", "-batch", "-"], input="\n".join(lines) + "\n",
                       capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"could not set the RoCE queues' discipline: {r.stderr.strip()[:200]}")
    net.queue_params = q


def set_congestion(net, params: CongestionParams, timeout_s: float = 10.0) -> str:
    """Apply ECN and PFC settings to the running fabric; returns the ECN mode in use."""
    params.validate(net.queue_params)
    if params.trim and net.dataplane is None:
        raise LabError("packet trimming needs the lab's BPF data path, which is not running "
                       "(fabriclab doctor says why); without it the queues can only drop")
    mode = resolve_ecn(params.ecn, net.dataplane is not None)
    want_red = params.red() if mode == "red" else None
    if want_red != net.queue_params.red:
        set_red(net, want_red)
    version = net.congestion_version = getattr(net, "congestion_version", 0) + 1
    protocol.CongestionConfig(
        version=version, ecn=mode,
        kmin_bytes=int(params.kmin_kb * 1024), kmax_bytes=int(params.kmax_kb * 1024),
        pmax=params.pmax, red_wlog=queues.red_wlog(params.kmin_kb * 1024, params.kmax_kb * 1024),
        pfc=params.pfc,
        lossless={str(prio): [int(xoff * 1024), int(xon * 1024)]
                  for prio, (xoff, xon) in params.thresholds_kb().items()},
        pause_quanta=params.pause_quanta, sample_ms=params.sample_period_ms(net.machine_factor),
        pfc_response_ms=params.response_ms(net.machine_factor), pfc_alpha=params.pfc_alpha,
        watchdog_ms=params.watchdog_ms, queue=dataclasses.asdict(net.queue_params),
        host_pids={h.name: net.host_pid(h.name) for h in net.fabric.hosts},
        dataplane=net.dataplane is not None, trim_bytes=params.trim_bytes(net.queue_params),
        trim_dscp=DSCP_TRIMMED).write(net.controller.workdir)
    deadline = time.monotonic() + timeout_s
    while protocol.read_state(net.controller.workdir).get("version") != version:
        if time.monotonic() > deadline:
            raise LabError(f"the controller did not apply the congestion settings within "
                           f"{timeout_s:.0f} s; see {net.controller.log_file}")
        time.sleep(0.02)
    return mode


def read_state(net) -> dict:
    """The controller's congestion counters: {"counters": {"switch:port": {prio: {...}}},
    ...}, as the app has them now (its next write waited for: up to STATE_EVERY_S)."""
    try:
        return protocol.read_state(net.controller.workdir, written_after=time.time())
    except TimeoutError as e:
        raise LabError(f"{e}: is the controller running? See {net.controller.log_file}") from e


def events(net, since: float = 0.0) -> list[dict]:
    """The congestion app's events (xoff, xon, gates, marking, watchdog) since `since`,
    up to what it had handled when asked (its next write waited for)."""
    read_state(net)
    return lab_events.read(net.controller.workdir / protocol.EVENTS_FILE, since)
