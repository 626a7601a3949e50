"""The shell of `fabriclab up`: Mininet's CLI, with the lab's switch names and commands.

Mininet's CLI reads a command's first word as an identifier (letters, digits, `_`), so
`fl-lf0 ovs-ofctl ...` reached it as the command `fl` and answered "Unknown command".
Here a node name may hold `-`, and three commands show what a newcomer looks for:

    flows fl-lf0          the switch's OpenFlow flows and groups
    queues fl-lf0:1       the port's queues: backlog, drops, CE marks, paused (also g0)
    capture g0 [N] [F]    N packets (default 20) on the port, printed, or saved to F.pcap

Ports are named as everywhere in the lab (lab/fabric/capture.py): SWITCH:PORT, an interface
(fl-lf0-eth1), a GPU host (the switch port it hangs on); a switch means all its ports.
"""
from __future__ import annotations

import subprocess

from mininet.cli import CLI
from mininet.log import error, output

from lab.core.errors import UsageError
from lab.fabric import capture
from lab.kernel import queues
from topologies.fabric import Fabric

OPENFLOW = "OpenFlow15"       # what the lab's bridges speak (lab/fabric/network.py)
CAPTURE_PACKETS = 20

HELP = """
The lab's commands:
  flows SWITCH           OpenFlow flows and groups of a switch (e.g. flows fl-lf0)
  queues PORT            a port's queues, per priority (e.g. queues fl-lf0:1, queues g0)
  capture PORT [N] [F]   N packets on a port (default 20), printed; or saved to F (.pcap)
A port is SWITCH:PORT, an interface (fl-lf0-eth1), a GPU host (its switch port) or a
switch (all its ports). Any node runs a shell command: fl-lf0 ovs-ofctl -O OpenFlow15
dump-flows fl-lf0; g0 ping -c1 10.1.1.1.
"""


class FabricCLI(CLI):
    """Mininet's CLI over a running fabric; `fabric` is its description."""

    prompt = "fabriclab> "
    identchars = CLI.identchars + "-"    # switch names: fl-lf0, fl-sp1, ...
    helpStr = CLI.helpStr + HELP

    def __init__(self, mininet, fabric: Fabric, **kwargs):
        self.fabric = fabric
        super().__init__(mininet, **kwargs)    # runs the command loop (or the script)

    # --- the lab's commands ----------------------------------------------------------
    def do_flows(self, line: str) -> None:
        """OpenFlow flows and groups of a switch: flows SWITCH"""
        switch = line.strip()
        switches = [s.name for s in self.fabric.switches]
        if switch not in switches:
            error(f"flows: no switch {switch!r}; the switches are {', '.join(switches)}\n")
            return
        for what in ("dump-flows", "dump-groups"):
            self.run_command(["ovs-ofctl", "-O", OPENFLOW, what, switch])

    def do_queues(self, line: str) -> None:
        """A port's queues, per priority: queues PORT (SWITCH:PORT, interface, GPU host)"""
        interfaces = self._ports("queues", line.strip())
        if not interfaces:
            return
        from lab.fabric.telemetry import render
        port_of = {intf: f"{sw}:{port}" for sw, port, intf, _ in queues.switch_ports(self.fabric)}
        wanted = {port_of[i] for i in interfaces}
        rows = sorted((k, s) for k, s in self.queue_samples().items()
                      if k.rpartition(":")[0] in wanted)
        output((render(rows) if rows else "no queues on that port (is the fabric up?)") + "\n")
        output("the kernel's own view: " + "; ".join(f"tc -s class show dev {i}"
                                                     for i in interfaces) + "\n")

    def do_capture(self, line: str) -> None:
        """Packets on a port: capture PORT [N] [FILE.pcap] (N default 20; Ctrl-C stops)"""
        args = line.split()
        rest = args[1:]
        count = CAPTURE_PACKETS
        if rest and rest[0].isdigit():
            count = int(rest.pop(0))
        if not args or len(rest) > 1:
            error("usage: capture PORT [N] [FILE.pcap]\n")
            return
        interfaces = self._ports("capture", args[0])
        if not interfaces:
            return
        if len(interfaces) > 1:
            error(f"capture: {args[0]} has {len(interfaces)} ports; name one "
                  f"({', '.join(interfaces)})\n")
            return
        # -e: link-level headers, where PFC pause frames show; -n: addresses as numbers
        command = ["tcpdump", "-i", interfaces[0], "-n", "-e", "-c", str(count)]
        if rest:
            command += ["-w", rest[0]]
        if self.run_command(command) == 0 and rest:
            from traffic.samples import WIRESHARK_LUA
            output(f"saved {rest[0]}; open it with the lab's dissector: "
                   f"wireshark -X lua_script:{WIRESHARK_LUA} {rest[0]}\n")

    # --- helpers (replaced by the tests) ---------------------------------------------
    def _ports(self, command: str, spec: str) -> list[str]:
        """A port spec as switch interfaces; [] after saying what is wrong."""
        if not spec:
            error(f"usage: {command} PORT (SWITCH:PORT, an interface or a GPU host)\n")
            return []
        try:
            return capture.resolve(self.fabric, spec, what=command)
        except UsageError as e:
            error(f"{e}\n")
            return []

    def run_command(self, argv: list[str]) -> int:
        """A command in the root namespace (where switch ports live), its output on the
        terminal; Ctrl-C stops it, not the shell."""
        try:
            return subprocess.call(argv)
        except KeyboardInterrupt:
            return 130
        except FileNotFoundError:
            error(f"{argv[0]} is not installed (vagrant/provision.sh installs it)\n")
            return 127

    def queue_samples(self) -> dict:
        """Every lab switch queue now: "switch:port:priority" -> QueueSample."""
        from lab.fabric.telemetry import QueueTelemetry
        return QueueTelemetry(self.fabric, None).snapshot()
