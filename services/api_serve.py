"""The REST control plane as a Ray Serve deployment (a Ray cluster's way to serve it): the same
app ``services/api.py`` builds for ``reval serve``, mounted with ``serve.ingress`` through a
builder, so each replica builds its own (its Redis connections are not pickled across).

    reval serve --ray [--port 8080]          # on a node of the cluster (RAY_ADDRESS or local)
    serve run services.api_serve:app_builder redis_url=redis://redis:6379/0   # Serve's CLI

The app keeps no state of its own (all of it is in Redis), so any number of replicas serve the
same runs. Ray Serve's API as used here (ray 2.x): ``serve.deployment``, ``serve.ingress(builder)``
(the builder is evaluated on each replica), ``serve.start(http_options=...)``, ``serve.run``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from reval.config import ApiConfig

DEPLOYMENT = "reval-api"


def build(cfg: ApiConfig, replicas: int = 1) -> Any:
    """The bound Serve application of the API."""
    from ray import serve

    cfg_json = cfg.model_dump_json()

    def builder() -> Any:  # runs on each replica
        from services.api import create_app

        return create_app(ApiConfig.model_validate_json(cfg_json))

    @serve.deployment(name=DEPLOYMENT, num_replicas=replicas,
                      ray_actor_options={"num_cpus": 0.1})  # fmt: skip
    @serve.ingress(builder)
    class RevalApi:
        pass

    return RevalApi.bind()  # type: ignore[attr-defined]


def app_builder(args: dict[str, str]) -> Any:
    """For ``serve run services.api_serve:app_builder key=value ...`` and a RayService's
    ``serveConfigV2`` (ApiConfig fields, plus ``replicas``)."""
    fields = dict(args)
    replicas = int(fields.pop("replicas", 1))
    return build(ApiConfig(**fields), replicas)


def run(cfg: ApiConfig, replicas: int = 1, block: bool = True) -> None:
    """Start Serve's HTTP proxy on ``cfg.host:cfg.port`` and deploy the API on it."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        ray.init(address=address, namespace="reval") if address else ray.init(namespace="reval")
    serve.start(http_options={"host": cfg.host, "port": cfg.port})
    serve.run(build(cfg, replicas), name="reval", route_prefix="/")
    while block:
        time.sleep(3600)
