"""The small HTTP endpoint every long-running process serves (learner rank 0, rollout workers,
``reval train``): ``/metrics`` (Prometheus text format), ``/healthz`` (the process is up and its
main loop is not stuck) and ``/readyz`` (it can do its work: e.g. Redis answers, weights loaded).
A thread of the standard library's HTTP server; no framework in the hot processes."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("reval.ops")

Check = Callable[[], tuple[bool, str]]
"""A probe: (ok, detail)."""


def always_ok() -> tuple[bool, str]:
    return True, ""


class PortTaken(OSError):
    """The metrics/health port is in use (or may not be bound here): the message names it and
    the setting that moves it; the commands print it on one line and exit 2."""


def port_taken(port: int, addr: str, err: OSError) -> PortTaken:
    """The PortTaken for ``addr:port`` refusing a bind with ``err``."""
    why = (
        "ports below 1024 need root (or CAP_NET_BIND_SERVICE); pick another"
        if err.errno == errno.EACCES
        else "another process holds the port; stop it, or pick a free one"
    )
    taken = PortTaken(
        f"cannot serve metrics and health on {addr}:{port} ({err.strerror or err}): {why} "
        f"with --set metrics.prometheus_port=<port> (reval rollout: --metrics-port <port>; "
        f"0: any free)"
    )
    taken.errno = err.errno
    return taken


def check_port(port: int, addr: str = "0.0.0.0") -> None:
    """PortTaken now unless ``addr:port`` can be bound (as the server binds it): for a process
    that serves later, after minutes of setting up, or in a child (the learner's rank 0)."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as ThreadingHTTPServer)
        try:
            s.bind((addr, port))
        except OSError as err:
            raise port_taken(port, addr, err) from None


class OpsServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` on a daemon thread; a port it cannot
    bind raises PortTaken."""

    def __init__(
        self,
        port: int,
        registry: CollectorRegistry,
        addr: str = "0.0.0.0",
        health: Check = always_ok,
        ready: Check = always_ok,
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # an idle connection does not hold its thread for ever

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(outer.registry), CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    probe = outer.health if path == "/healthz" else outer.ready
                    try:
                        ok, detail = probe()
                    except Exception as err:  # a probe that fails is a failed probe
                        ok, detail = False, f"{type(err).__name__}: {err}"
                    body = json.dumps({"ok": ok, "detail": detail}).encode()
                    self._send(200 if ok else 503, body, "application/json")
                else:
                    self._send(404, b'{"detail": "not found"}', "application/json")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
                return

        self.registry = registry
        self.health, self.ready = health, ready
        try:
            self.httpd = ThreadingHTTPServer((addr, port), Handler)
        except OSError as err:
            raise port_taken(port, addr, err) from None
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="ops-http",
                                       daemon=True)  # fmt: skip
        self.thread.start()
        log.info("metrics and health on %s:%d", addr, self.port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
