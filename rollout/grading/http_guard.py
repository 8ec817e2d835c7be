"""What ``http_reward`` may reach and send, and the one guarded POST it makes. The URL, its
addresses and ``token_env`` come from ``task.reward_args`` (the user's config, over REST too), so
each is checked against the operator's lists, the same way where the REST API creates a run
(``check_target``, a 422) and where a grading process sends (``post_json``, an error that scores
the chunk 0).

- **Scheme**: ``http`` or ``https``, nothing else (``file://`` is refused before anything opens).
- **Addresses**: the host is resolved (``getaddrinfo``) and every address it gives is checked:
  loopback, link-local (``169.254.0.0/16``, ``fe80::/10``), private (``10/8``, ``172.16/12``,
  ``192.168/16``, ``fc00::/7``), unspecified, multicast and every other non-global address are
  refused unless ``REVAL_HTTP_REWARD_HOSTS`` (comma-separated addresses, networks such as
  ``10.0.0.0/8``, or host names) lists them. The connection goes to an address that was checked
  (the host name still goes in ``Host`` and in TLS's server name), so a DNS answer that changes
  between the check and the connection (rebinding) cannot redirect it.
- **Redirects**: none is followed (a redirect could carry the token to another origin): a 3xx
  answer is an error.
- **Token**: ``token_env`` must start with ``REVAL_REWARD_`` or be listed in
  ``REVAL_HTTP_REWARD_TOKEN_ENVS`` (comma-separated), and is never one of ``NEVER_TOKENS`` nor a
  ``REVAL__`` config variable, whatever the list says.
- **Size and time**: the answer is read up to ``MAX_RESPONSE_BYTES``; one deadline of
  ``timeout_s`` covers the whole request (resolving, connecting, sending, every byte of the
  answer), enforced by closing the socket when it passes, not per socket operation.

Both lists are read from the environment of the process that checks: the operator's (the API
passes them on to the runs it launches, ``services/api/runs.py: run_env``).
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

HOSTS_ENV = "REVAL_HTTP_REWARD_HOSTS"
"""Operator's list of non-global addresses, networks or host names ``http_reward`` may reach."""
TOKEN_ENVS_ENV = "REVAL_HTTP_REWARD_TOKEN_ENVS"
"""Operator's list of extra variable names ``token_env`` may name."""
TOKEN_PREFIX = "REVAL_REWARD_"
"""Variables whose name starts with this may always be named by ``token_env``."""
NEVER_TOKENS = frozenset({
    "REVAL_API_TOKEN", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HUGGINGFACE_TOKEN",
    "REDIS_PASSWORD", "REDIS_URL", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN", "GITHUB_TOKEN", "OPENAI_API_KEY", "ANTHROPIC_API_KEY",
})  # fmt: skip
"""Never sent, whatever the lists say (with every ``REVAL__`` variable: the Redis URL, ...)."""
MAX_RESPONSE_BYTES = 16 << 20
"""The largest answer read (bytes); a longer one is an error."""

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class RewardUrlRefused(ValueError):
    """A URL, address or ``token_env`` that ``http_reward`` will not use; ``field`` names the
    ``task.reward_args`` key at fault (``url`` or ``token_env``)."""

    def __init__(self, message: str, field: str = "url") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect (``addresses``, every one allowed) and what to ask."""

    scheme: str
    host: str
    port: int
    path: str
    addresses: tuple[str, ...]


def _listed(env: Mapping[str, str], name: str) -> list[str]:
    return [p.strip() for p in env.get(name, "").split(",") if p.strip()]


def check_token_env(name: str | None, env: Mapping[str, str] | None = None) -> None:
    """``name`` may be sent as a bearer token (None: no token). Raises ``RewardUrlRefused``."""
    if name is None:
        return
    env = os.environ if env is None else env
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RewardUrlRefused("http_reward: token_env must be a variable name", "token_env")
    listed = name.startswith(TOKEN_PREFIX) or name in _listed(env, TOKEN_ENVS_ENV)
    if name in NEVER_TOKENS or name.startswith("REVAL__") or not listed:
        raise RewardUrlRefused(
            f"http_reward: token_env {name!r} is not allowed: name a variable starting with "
            f"{TOKEN_PREFIX} (or one the operator lists in {TOKEN_ENVS_ENV})",
            "token_env",
        )


def _allowed_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, host: str,
                     allow: list[str]) -> bool:  # fmt: skip
    """Whether ``ip`` (an address of ``host``) may be reached: a global unicast address, or one
    the operator lists (the address, its network or the host name)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    public = ip.is_global and not (
        ip.is_multicast or ip.is_unspecified or ip.is_reserved or ip.is_link_local
    )
    if public:
        return True
    for entry in allow:
        if entry.lower() == host.lower():
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue  # a host name of the list, not this one
    return False


def check_target(url: str, env: Mapping[str, str] | None = None) -> Target:
    """``url`` checked: http(s), a host, and every address it resolves to allowed (see the
    module's doc). Raises ``RewardUrlRefused`` naming what is wrong, never echoing what a
    refused URL would have returned."""
    env = os.environ if env is None else env
    if not isinstance(url, str):
        raise RewardUrlRefused("http_reward: url must be a string")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise RewardUrlRefused("http_reward: url is not a valid URL") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise RewardUrlRefused(f"http_reward: url must be http:// or https:// (got {scheme!r})")
    host = parts.hostname
    if not host:
        raise RewardUrlRefused("http_reward: url has no host")
    if parts.username is not None or parts.password is not None:
        raise RewardUrlRefused("http_reward: no credentials in the url (use token_env)")
    port = port or (443 if scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise RewardUrlRefused(f"http_reward: the host {host!r} does not resolve") from None
    addresses: list[str] = []
    allow = _listed(env, HOSTS_ENV)
    for info in infos:
        address = str(info[4][0]).split("%")[0]
        ip = ipaddress.ip_address(address)
        if not _allowed_address(ip, host, allow):
            raise RewardUrlRefused(
                f"http_reward: {host!r} resolves to {address}, a loopback, link-local, private "
                f"or otherwise non-public address: refused unless the operator lists it in "
                f"{HOSTS_ENV}"
            )
        if address not in addresses:
            addresses.append(address)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(scheme, host, port, path, tuple(addresses))


class _Pinned(http.client.HTTPConnection):
    """An HTTP connection to one checked address (``Host`` stays the URL's host)."""

    def __init__(self, target: Target, address: str, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)


class _PinnedTLS(http.client.HTTPSConnection):
    """HTTPS to one checked address; the certificate is checked against the URL's host."""

    def __init__(self, target: Target, address: str, timeout: float) -> None:
        self.tls = ssl.create_default_context()
        super().__init__(target.host, target.port, timeout=timeout, context=self.tls)
        self.address = address

    def connect(self) -> None:
        raw = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self.tls.wrap_socket(raw, server_hostname=self.host)


def _close_at(sock: socket.socket, fired: threading.Event) -> None:
    """The deadline: the socket shut down under whatever reads it (the response keeps reading
    it after ``http.client`` hands it over, so it is the socket itself, not the connection)."""
    fired.set()
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def post_json(
    url: str,
    body: bytes,
    headers: Mapping[str, str],
    timeout_s: float,
    max_bytes: int = MAX_RESPONSE_BYTES,
    env: Mapping[str, str] | None = None,
) -> bytes:
    """POST ``body`` to ``url`` (checked by ``check_target``) and return the answer's body:
    no redirect followed, at most ``max_bytes`` read, the whole exchange within ``timeout_s``.
    Raises ``RewardUrlRefused``, ``TimeoutError`` or ``OSError``/``ValueError`` naming what
    failed."""
    deadline = time.monotonic() + timeout_s
    target = check_target(url, env)
    kind = _PinnedTLS if target.scheme == "https" else _Pinned
    last: Exception | None = None
    for address in target.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn = kind(target, address, left)
        try:
            conn.connect()
        except OSError as err:
            last = err
            conn.close()
            continue
        fired = threading.Event()
        left = max(0.0, deadline - time.monotonic())
        timer = threading.Timer(left, _close_at, (conn.sock, fired))
        timer.daemon = True
        timer.start()
        try:
            return _exchange(conn, target, body, headers, max_bytes, deadline, fired)
        except (OSError, http.client.HTTPException) as err:
            if fired.is_set() or time.monotonic() >= deadline:
                raise TimeoutError(
                    f"http_reward: no full answer from {target.host} within {timeout_s:g} s"
                ) from None
            raise OSError(f"http_reward: {target.host}: {type(err).__name__}: {err}") from None
        finally:
            timer.cancel()
            conn.close()
    if last is not None and time.monotonic() < deadline:
        raise OSError(f"http_reward: cannot connect to {target.host}: {last}")
    raise TimeoutError(f"http_reward: no connection to {target.host} within {timeout_s:g} s")


def _exchange(
    conn: http.client.HTTPConnection,
    target: Target,
    body: bytes,
    headers: Mapping[str, str],
    max_bytes: int,
    deadline: float,
    fired: threading.Event,
) -> bytes:
    conn.request("POST", target.path, body=body, headers=dict(headers))
    response = conn.getresponse()
    if 300 <= response.status < 400:
        raise ValueError(
            f"http_reward: {target.host} answered a redirect (HTTP {response.status}): refused "
            "(a redirect is never followed)"
        )
    if not 200 <= response.status < 300:
        raise ValueError(f"http_reward: {target.host} answered HTTP {response.status} "
                         f"{response.reason}")  # fmt: skip
    chunks, seen = [], 0
    while True:
        chunk = response.read(min(1 << 16, max_bytes + 1 - seen))
        if not chunk:
            break
        seen += len(chunk)
        if seen > max_bytes:
            raise ValueError(f"http_reward: the answer of {target.host} is over {max_bytes} bytes")
        chunks.append(chunk)
        if time.monotonic() >= deadline:
            raise TimeoutError("deadline")
    if fired.is_set() or time.monotonic() >= deadline:  # (an end of file the deadline made)
        raise TimeoutError("deadline")
    return b"".join(chunks)
