"""Runs the controller apps, listening on loopback (or, for a fabric across machines,
on the cluster's address), on os-ken or on Ryu.

os-ken 4.x ships no manager command; this is the few lines it takes.
    python -m controllers.launch --port 6653 --fabric fabric.json --status status

The apps are written against os-ken, the maintained fork of Ryu. The two share
their API under different names (os_ken.* / ryu.*, OSKenApp / RyuApp), so with
`--runtime ryu` (in an interpreter that has Ryu: lab/fabric/ryu.py) every `os_ken`
import is answered with its `ryu` module and the same apps run unchanged.
"""
import argparse
import importlib
import importlib.abc
import importlib.util
import sys

GIL_SWITCH_INTERVAL_S = 0.0002
DEFAULT_APPS = ["controllers.fabric_router", "controllers.congestion"]


class RyuAsOsKen(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import os_ken.x.y` -> the module ryu.x.y, under both names."""

    def find_spec(self, name, path, target=None):
        if name == "os_ken" or name.startswith("os_ken."):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # the import system hands back whatever sys.modules holds once this returns
        sys.modules[module.__name__] = importlib.import_module("ryu" + module.__name__[6:])


def use_ryu() -> str:
    import eventlet.wsgi
    if not hasattr(eventlet.wsgi, "ALREADY_HANDLED"):
        # Ryu's app manager imports its REST layer (ryu.app.wsgi), which reads this
        # constant at import; the eventlet Ryu can run on (0.33) no longer has it, and
        # the lab runs no REST apps
        eventlet.wsgi.ALREADY_HANDLED = object()
    from ryu.base import app_manager
    from ryu.lib import hub
    hub.patch(thread=True)    # Ryu's hub is eventlet: green sockets and threads
    app_manager.OSKenApp = app_manager.RyuApp
    sys.meta_path.insert(0, RyuAsOsKen())
    return "ryu"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--port", type=int, required=True, help="OpenFlow TCP port")
    ap.add_argument("--listen-host", default="127.0.0.1",
                    help="the address to listen on (loopback, or a cluster's address)")
    ap.add_argument("--fabric", required=True, help="fabric description JSON")
    ap.add_argument("--status", required=True, help="file the app marks programmed switches in")
    ap.add_argument("--congestion", default="", help="ECN/PFC configuration file (JSON)")
    ap.add_argument("--congestion-fabric", default="",
                    help="the congestion app's part of the fabric (JSON; a fabric across "
                         "machines: this machine's); default: --fabric")
    ap.add_argument("--runtime", choices=["os-ken", "ryu"], default="os-ken")
    ap.add_argument("--app", action="append", help="app module, repeatable (default: the fabric router and the congestion app)")
    args = ap.parse_args(argv)
    project = use_ryu() if args.runtime == "ryu" else "os_ken"
    from os_ken import cfg, log
    from os_ken.base.app_manager import AppManager
    apps = args.app or DEFAULT_APPS
    for app in apps:
        __import__(app)   # an app registers its options at import: before they are parsed
    cfg.CONF(args=["--ofp-listen-host", args.listen_host, "--ofp-tcp-listen-port", str(args.port),
                   "--fabriclab-fabric-file", args.fabric,
                   "--fabriclab-status-file", args.status,
                   "--fabriclab-congestion-file", args.congestion,
                   "--fabriclab-congestion-fabric-file", args.congestion_fabric],
             project=project)
    log.init_log()
    # The congestion app's sampling thread must not wait for the interpreter lock
    # behind the OpenFlow threads for Python's default 5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    AppManager.run_apps(apps)


if __name__ == "__main__":
    main()
