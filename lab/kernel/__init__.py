"""The kernel plumbing the lab and the controller apps both drive: rtnetlink (tcnl.py),
network namespaces (netns.py), BPF (bpf.py, and the per-packet data path:
dataplane.py with dataplane.bpf.c, dataplane.h and the PFC sender, pfc_sender.c),
the queues of a port (queues.py), Open vSwitch (ovs.py), netem (netem.py), packet
impairment (impair.py) and probes sent from a namespace (probe.py). Imports the pure
layers (topologies, traffic) and lab.core only."""
