"""Runs controller apps on os-ken, listening on loopback only.

os-ken 4.x ships no manager command; this is the few lines it takes.
    python -m controllers.launch --port 6653 --fabric fabric.json --status status
"""
import argparse
import sys

from os_ken import cfg, log
from os_ken.base.app_manager import AppManager

GIL_SWITCH_INTERVAL_S = 0.0002
DEFAULT_APPS = ["controllers.fabric_router", "controllers.congestion"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True, help="OpenFlow TCP port on 127.0.0.1")
    ap.add_argument("--fabric", required=True, help="fabric description JSON")
    ap.add_argument("--status", required=True, help="file the app marks programmed switches in")
    ap.add_argument("--congestion", default="", help="ECN/PFC configuration file (JSON)")
    ap.add_argument("--app", action="append", help="app module (default: the fabric router)")
    args = ap.parse_args(argv)
    apps = args.app or DEFAULT_APPS
    for app in apps:
        __import__(app)   # an app registers its options at import: before they are parsed
    cfg.CONF(args=["--ofp-listen-host", "127.0.0.1", "--ofp-tcp-listen-port", str(args.port),
                   "--fabriclab-fabric-file", args.fabric,
                   "--fabriclab-status-file", args.status,
                   "--fabriclab-congestion-file", args.congestion],
             project="os_ken")
    log.init_log()
    # The congestion app's sampling thread must not wait for the interpreter lock
    # behind the OpenFlow threads for Python's default 5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    AppManager.run_apps(apps)


if __name__ == "__main__":
    main()
