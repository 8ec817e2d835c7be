"""Serving the app: ``reval serve`` under uvicorn, or as a Ray Serve deployment (``ray_app``,
``run_on_ray``; ``services/api_serve.py`` is the import path for Serve's CLI and KubeRay)."""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from reval.config import ApiConfig
from services.api.app import create_app
from services.api.security import token_problem

log = logging.getLogger("reval.api")


def serve(cfg: ApiConfig, ray: bool = False, replicas: int = 1, access_log: bool = False) -> int:
    """``reval serve``: uvicorn on ``cfg.host:cfg.port`` (or Ray Serve with ``ray``). No line per
    request unless ``access_log``: ``reval_api_requests_total`` counts them."""

    token = os.environ.get(cfg.token_env, "")
    problem = token_problem(token)
    if not cfg.dev and problem is not None:
        print(
            f"reval serve: {cfg.token_env} {problem}: set it to a random secret, e.g. "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'` "
            "(or --dev for development only)",
            file=sys.stderr,
        )
        return 2
    if cfg.dev and not token:
        log.warning("dev mode with no token: every mutating request is refused (403)")
    guarded = [what for what, need in (("reads, /docs and /openapi.json", cfg.reads_need_token()),
                                       ("/metrics", cfg.metrics_need_token())) if need]  # fmt: skip
    log.info("on %s: the token guards writes%s", cfg.host,
             "".join(f", {g}" for g in guarded))  # fmt: skip
    if ray:
        run_on_ray(cfg, replicas)
        return 0
    import uvicorn

    uvicorn.run(create_app(cfg), host=cfg.host, port=cfg.port, log_level="info",
                access_log=access_log)  # fmt: skip
    return 0


# -- Ray Serve ---------------------------------------------------------------------------------
# (here, beside the app it mounts; ``services/api_serve.py`` is the entry point for Serve's CLI
# and KubeRay)

DEPLOYMENT = "reval-api"


def ray_app(cfg: ApiConfig, replicas: int = 1) -> Any:
    """The bound Serve application of the API: ``serve.ingress`` with a builder evaluated on
    each replica, so each builds its own app (its Redis connections are not pickled across)."""
    from ray import serve

    cfg_json = cfg.model_dump_json()

    def builder() -> Any:  # runs on each replica
        return create_app(ApiConfig.model_validate_json(cfg_json))

    @serve.deployment(name=DEPLOYMENT, num_replicas=replicas,
                      ray_actor_options={"num_cpus": 0.1})  # fmt: skip
    @serve.ingress(builder)
    class RevalApi:
        pass

    return RevalApi.bind()  # type: ignore[attr-defined]


def run_on_ray(cfg: ApiConfig, replicas: int = 1, block: bool = True) -> None:
    """Start Serve's HTTP proxy on ``cfg.host:cfg.port`` and deploy the API on it (the Ray
    cluster at ``RAY_ADDRESS``, or a local one)."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, namespace="reval") if address else ray.init(namespace="reval")
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(ray_app(cfg, replicas), name="reval", route_prefix="/")
    while block:
        time.sleep(3600)
