"""The /metrics, /healthz, /readyz endpoint of every long-running process."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Counter

from reval.ops_http import OpsServer


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_probes_and_metrics():
    registry = CollectorRegistry()
    Counter("reval_test_things", "Things", registry=registry).inc(3)
    state = {"ready": False}

    def ready() -> tuple[bool, str]:
        return state["ready"], "weights" if state["ready"] else "no weights yet"

    def broken() -> tuple[bool, str]:
        raise ConnectionError("redis is down")

    server = OpsServer(0, registry, "127.0.0.1", ready=ready)
    try:
        code, body = get(server.port, "/metrics")
        assert code == 200 and "reval_test_things_total 3.0" in body
        assert get(server.port, "/healthz") == (200, json.dumps({"ok": True, "detail": ""}))
        code, body = get(server.port, "/readyz")
        assert code == 503 and json.loads(body) == {"ok": False, "detail": "no weights yet"}
        state["ready"] = True
        assert get(server.port, "/readyz")[0] == 200
        assert get(server.port, "/nothing")[0] == 404
        server.ready = broken
        code, body = get(server.port, "/readyz")
        assert code == 503 and "redis is down" in body
    finally:
        server.close()
