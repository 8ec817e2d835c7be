"""Schemathesis fuzzes the REST API from its own OpenAPI document (real Redis behind it, the
token given, runs registered but never really launched): no input gives a server error."""

from __future__ import annotations

import os
import tempfile
import uuid

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from reval.config import ApiConfig
from services.api import create_app
from tests.conftest import REDIS_URL

TOKEN = "fuzz-token-0123456789abcdef"
PREFIX = f"reval-test:{os.getpid()}:{uuid.uuid4().hex[:8]}:"
os.environ.setdefault("REVAL_API_TOKEN", TOKEN)
APP = create_app(
    ApiConfig(redis_url=REDIS_URL, key_prefix=PREFIX, output_dir=tempfile.mkdtemp()),
    launcher=lambda name, path: 0,  # (a pid nobody has: the run shows as not running)
)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture(scope="module", autouse=True)
def _own_keys(redis_url):
    yield
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=PREFIX + "*", count=1000))
    if keys:
        client.delete(*keys)


@schema.parametrize()
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
def test_no_input_is_a_server_error(case):
    token = os.environ["REVAL_API_TOKEN"]
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"},
                           checks=[not_a_server_error])  # fmt: skip
