"""The running fabric: the Mininet network with its switches and controller
(network.py, controller.py, ryu.py), the GPU agents (gpus.py) and what runs on them
(collective.py, calibrate.py), congestion settings (congestion.py), telemetry,
captures, the controller's events, Soft-RoCE hosts (rxe.py), reachability checks
(verify.py), doctor and cleanup. Built on lab.kernel, lab.core and the controller
apps; experiments and the session (runner, api, cli, tour) use it."""
