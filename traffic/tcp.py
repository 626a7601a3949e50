"""TCP baseline and background traffic with iperf3, through its Python wrapper
(libiperf). Run inside a host namespace by the lab:

    python -m traffic.tcp server --port 5201            (serves one test)
    python -m traffic.tcp client --server IP --seconds 3   -> one JSON line

The wrapper redirects the process's stdout during a test and a Client cannot be
reused, so each test is its own short-lived process.
"""
from __future__ import annotations

import argparse
import json
import sys

import iperf3


def serve(port: int) -> None:
    server = iperf3.Server()
    server.bind_address, server.port = "0.0.0.0", port
    result = server.run()
    print(json.dumps({"received_mbps": getattr(result, "received_Mbps", None),
                      "error": getattr(result, "error", None)}), flush=True)


def client(server_ip: str, port: int, seconds: float, streams: int) -> None:
    c = iperf3.Client()
    c.server_hostname, c.port = server_ip, port
    c.duration, c.num_streams = int(max(1, seconds)), streams
    result = c.run()
    if result.error:
        print(json.dumps({"error": result.error}), flush=True)
        sys.exit(1)
    print(json.dumps({"sent_mbps": result.sent_Mbps, "received_mbps": result.received_Mbps,
                      "retransmits": result.retransmits}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="role", required=True)
    s = sub.add_parser("server")
    s.add_argument("--port", type=int, default=5201)
    c = sub.add_parser("client")
    c.add_argument("--server", required=True)
    c.add_argument("--port", type=int, default=5201)
    c.add_argument("--seconds", type=float, default=3)
    c.add_argument("--streams", type=int, default=1)
    a = ap.parse_args()
    if a.role == "server":
        serve(a.port)
    else:
        client(a.server, a.port, a.seconds, a.streams)


if __name__ == "__main__":
    main()
