"""The REST control plane: ``reval serve`` runs its FastAPI app under uvicorn (``serve``); in a
Ray cluster ``reval serve --ray`` mounts the same app as a Ray Serve deployment (``ray_app``,
``run_on_ray``; ``services/api_serve.py`` is the import path for Serve's CLI and KubeRay).

| module | what it holds |
|---|---|
| ``app.py`` | ``create_app``: the app, its middleware and metrics, the routers over one service |
| ``routes.py`` | the endpoints, each asking the service and returning what it built |
| ``runs.py`` | ``RunService``: what each endpoint does; ``Store``, the API's registry of runs |
| ``run_checks.py`` | what a POSTed run config may ask (``confine``, ``check_user_code``): 422s |
| ``models.py`` | the request and response bodies |
| ``security.py`` | the token check, the body size limit, ``token_problem`` |
| ``serving.py`` | ``serve`` (uvicorn) and the Ray Serve deployment |

Everything the API knows lives in Redis (the runs it manages in its registry hash, each run's
control, status and events keys, the replay ring's counters, the worker registry; every key is
built in ``reval/redis.py`` and read through the ground floor's readers), so the API restarts
without losing anything while runs go on. A run is started as a ``reval launch`` process (its own
session, so it outlives an API restart); every later action is a write to the run's control
keys, which the learner, the workers and the launch driver follow between steps.

Security: mutating endpoints need ``Authorization: Bearer <token>`` (the token from the
environment variable ``api.token_env``, compared in constant time); ``serve`` refuses to start
with an empty, default, short or low-entropy token (``token_problem``) unless ``dev``; reads
(and ``/docs``, ``/openapi.json``) need it too with ``auth_reads``, by default whenever the API
binds a non-loopback address, and ``/metrics`` there unless ``open_metrics``. Bodies beyond
``max_body_bytes`` get 413. The listen address is loopback unless configured. A POSTed config
reads local files only under ``models_dir``, names installed code only from the plugin list
(checked in a throw-away process, ``reval.paths.check_isolated``), and the runs it launches get
a scrubbed environment (``runs.run_env``).
"""

from services.api.app import API_VERSION, create_app
from services.api.security import token_problem
from services.api.serving import DEPLOYMENT, ray_app, run_on_ray, serve

__all__ = ["API_VERSION", "DEPLOYMENT", "create_app", "ray_app", "run_on_ray", "serve",
           "token_problem"]  # fmt: skip
