"""fabriclab orchestration: capabilities, OVS and controller lifecycle, the
Mininet network, kernel queues, cleanup, the experiment runner and the CLI."""
