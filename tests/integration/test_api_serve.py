"""The same API app as a Ray Serve deployment on a local Ray (``reval serve --ray``)."""

from __future__ import annotations

import socket

import httpx
import pytest

from reval.config import ApiConfig

TOKEN = "serve-test-token-0123456789"


@pytest.mark.timeout(300)
def test_api_as_a_ray_serve_deployment(tmp_path, redis_url, redis_prefix, monkeypatch):
    import ray
    from ray import serve

    from services.api import run_on_ray

    monkeypatch.setenv("REVAL_API_TOKEN", TOKEN)  # (the replicas inherit the environment)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = ApiConfig(port=port, redis_url=redis_url, key_prefix=redis_prefix,
                    output_dir=str(tmp_path))  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        run_on_ray(cfg, replicas=2, block=False)
        assert httpx.get(f"{base}/healthz").json() == {"ok": True, "detail": ""}
        assert httpx.get(f"{base}/readyz").status_code == 200
        auth = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(f"{base}/v1/runs", headers=auth, timeout=30,
                       json={"config": {"name": "served"}, "start": False})  # fmt: skip
        assert r.status_code == 201, r.text
        # Either replica answers from the same state in Redis.
        for _ in range(6):
            assert httpx.get(f"{base}/v1/runs/served").json()["phase"] == "registered"
        assert httpx.post(f"{base}/v1/runs/served/pause").status_code == 401
        assert httpx.post(f"{base}/v1/runs/served/pause", headers=auth).status_code == 409
        assert "/v1/runs/{name}/hparams" in httpx.get(f"{base}/openapi.json").json()["paths"]
    finally:
        serve.shutdown()
        ray.shutdown()
