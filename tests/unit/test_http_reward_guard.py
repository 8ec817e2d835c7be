"""``http_reward``'s guard (issue 37), against real local HTTP servers: what it refuses before
any connection (``file://``, the metadata address ``169.254.169.254``, loopback unless the
operator lists it, a ``token_env`` off the list), a redirect to another origin (the token never
reaches it), an answer over the size cap, and a slow drip past the one overall deadline."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.grading.graders import http_reward
from rollout.grading.http_guard import (
    HOSTS_ENV,
    MAX_RESPONSE_BYTES,
    TOKEN_ENVS_ENV,
    RewardUrlRefused,
    check_target,
    check_token_env,
)

TOKEN = "REVAL_REWARD_TEST_TOKEN"


class Server:
    """A local HTTP server whose POST answer is ``answer(handler)``; it records each request's
    path and ``Authorization`` header."""

    def __init__(self, answer) -> None:
        self.seen: list[tuple[str, str | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.seen.append((self.path, self.headers.get("Authorization")))
                answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def ok(handler: BaseHTTPRequestHandler, body: bytes = b'{"rewards": [1.0]}') -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    made: list[Server] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def loopback_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator lists 127.0.0.1 (loopback is refused by default) and sets the token."""
    monkeypatch.setenv(HOSTS_ENV, "127.0.0.1")
    monkeypatch.setenv(TOKEN, "s3cret-reward-token")


def call(url: str, **args):
    return http_reward(["p"], ["c"], [{}], url=url, **args)


def test_file_urls_and_other_schemes_are_refused_before_anything_opens(tmp_path, monkeypatch):
    secret = tmp_path / "secret.txt"
    secret.write_text("the-file-content-never-leaks")
    monkeypatch.setenv(HOSTS_ENV, "127.0.0.1")
    for url in (f"file://{secret}", "ftp://example.com/x", "gopher://127.0.0.1/", "/etc/passwd"):
        with pytest.raises(RewardUrlRefused) as err:
            call(url)
        assert "http:// or https://" in str(err.value)
        assert "never-leaks" not in str(err.value)


def test_metadata_loopback_and_private_addresses_are_refused_unless_listed(monkeypatch):
    monkeypatch.delenv(HOSTS_ENV, raising=False)
    monkeypatch.setenv(TOKEN, "s3cret")
    for url in ("http://169.254.169.254/latest/meta-data/", "http://127.0.0.1:1/",
                "http://localhost/", "http://10.1.2.3/", "http://192.168.0.1/",
                "http://172.16.0.1/", "http://[::1]/", "http://[fe80::1]/", "http://0.0.0.0/",
                "http://224.0.0.1/", "http://[::ffff:169.254.169.254]/"):  # fmt: skip
        t0 = time.monotonic()
        with pytest.raises(RewardUrlRefused, match=HOSTS_ENV):
            call(url, token_env=TOKEN, timeout_s=30)
        assert time.monotonic() - t0 < 1  # refused before any connection, not timed out
    # Listed by the operator: an address, a network, or the host name.
    for listed in ("127.0.0.1", "127.0.0.0/8"):
        env = {HOSTS_ENV: f"10.0.0.0/8, {listed}"}
        assert check_target("http://127.0.0.1:9/x", env).addresses == ("127.0.0.1",)
    assert check_target("http://localhost:9/x", {HOSTS_ENV: "localhost"}).addresses
    # Listing the loopback does not open the metadata address.
    with pytest.raises(RewardUrlRefused):
        check_target("http://169.254.169.254/", {HOSTS_ENV: "127.0.0.1"})


def test_token_env_comes_from_the_list_only():
    for name in ("REVAL_API_TOKEN", "HF_TOKEN", "REDIS_PASSWORD", "REVAL__REDIS__URL",
                 "MY_TOKEN", "PATH", "bad name"):  # fmt: skip
        with pytest.raises(RewardUrlRefused) as err:
            check_token_env(name, {})
        assert err.value.field == "token_env"
    check_token_env("REVAL_REWARD_KEY", {})
    check_token_env(None, {})
    check_token_env("MY_TOKEN", {TOKEN_ENVS_ENV: "OTHER, MY_TOKEN"})
    # Never these, even listed.
    for name in ("REVAL_API_TOKEN", "HF_TOKEN", "REVAL__REDIS__URL"):
        with pytest.raises(RewardUrlRefused):
            check_token_env(name, {TOKEN_ENVS_ENV: name})


def test_a_token_env_off_the_list_is_never_read_or_sent(servers, monkeypatch, loopback_allowed):
    server = Server(ok)
    servers.append(server)
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_you")
    with pytest.raises(RewardUrlRefused, match="token_env"):
        call(server.url, token_env="HF_TOKEN")
    assert server.seen == []
    # On the list it goes, and the answer is read.
    assert call(server.url, token_env=TOKEN) == [1.0]
    assert server.seen == [("/score", "Bearer s3cret-reward-token")]


def test_a_redirect_to_another_origin_is_refused_and_the_token_stays_home(
    servers, loopback_allowed
):
    other = Server(ok)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", other.url)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    first = Server(redirect)
    servers.extend([other, first])
    with pytest.raises(ValueError, match="redirect"):
        call(first.url, token_env=TOKEN)
    assert first.seen == [("/score", "Bearer s3cret-reward-token")]
    assert other.seen == []  # never followed: the token never reached the second origin


def test_an_answer_over_the_size_cap_is_refused(servers, loopback_allowed):
    def huge(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()  # (no length: read until the server closes)
        chunk = b" " * (1 << 20)
        try:
            for _ in range(MAX_RESPONSE_BYTES // len(chunk) + 2):
                handler.wfile.write(chunk)
        except OSError:
            pass  # the client stopped reading

    server = Server(huge)
    servers.append(server)
    with pytest.raises(ValueError, match="over"):
        call(server.url, timeout_s=20)


def test_a_slow_drip_ends_at_the_one_overall_deadline(servers, loopback_allowed):
    def drip(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", "1000")
        handler.end_headers()
        try:
            for _ in range(1000):  # one byte every 0.1 s: each read is quick, the whole is not
                handler.wfile.write(b" ")
                handler.wfile.flush()
                time.sleep(0.1)
        except OSError:
            pass

    server = Server(drip)
    servers.append(server)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 1 s"):
        call(server.url, timeout_s=1.0)
    assert time.monotonic() - t0 < 2.5


def test_a_good_answer_is_read(servers, loopback_allowed):
    body = json.dumps({"rewards": [{"score": 0.5, "x": 1}]}).encode()
    server = Server(lambda h: ok(h, body))
    servers.append(server)
    assert call(server.url, token_env=TOKEN, headers={"X-Run": "r"}) == [{"score": 0.5, "x": 1}]
