"""The REST control plane as a Ray Serve application, for Serve's CLI and a KubeRay RayService:
the same app ``services/api/app.py`` builds for ``reval serve``, mounted with ``serve.ingress``
through a builder, so each replica builds its own (its Redis connections are not pickled across).

    reval serve --ray [--port 8080]          # on a node of the cluster (RAY_ADDRESS or local)
    serve run services.api_serve:app_builder redis_url=redis://redis:6379/0   # Serve's CLI

The deployment itself (``ray_app``, ``run_on_ray``) lives in ``services/api/serving.py``, beside
the app, so this module only imports that package (no import circle). The app keeps no state of
its own (all of it is in Redis), so any number of replicas serve the same runs. Ray Serve's API
as used there (ray 2.x): ``serve.deployment``, ``serve.ingress(builder)`` (the builder is
evaluated on each replica), ``serve.start(http_options=...)``, ``serve.run``.
"""

from __future__ import annotations

import os
from typing import Any

from reval.config import ApiConfig
from services.api import ray_app


def app_builder(args: dict[str, str]) -> Any:
    """For ``serve run services.api_serve:app_builder key=value ...`` and a RayService's
    ``serveConfigV2`` (ApiConfig fields, plus ``replicas``). ``$VAR`` and ``${VAR}`` in a value
    are this process's environment variables (a secret from the pod's environment: the Redis
    password in ``redis_url``, deploy/k8s/rayservice-api.yaml)."""
    fields = {k: os.path.expandvars(v) for k, v in args.items()}
    replicas = int(fields.pop("replicas", 1))
    return ray_app(ApiConfig(**fields), replicas)
