"""Weight files over HTTP (``sync.serve_files``, issue 43): workers on hosts that do not share
the learner's disk still read every version's file, a late joiner's first one included.

- ``FileServer``: on the learner's rank 0, a read-only HTTP server over the weights directory.
  It serves the version files and the lineage's LoRA base (``v{version:08d}.safetensors``,
  ``base-{lineage}.safetensors``) and nothing else, under the run's secret
  (``/{secret}/{name}``; anything else is 404, a wrong secret 403). Its URL is announced with
  every version (the weights hash's ``files_url``, ``reval/weights/files.py``), at the address
  the hub is announced at (``sync.broadcast_host``).
- ``FileFetcher``: a subscriber's side. An announced file that is on this host's disk (a shared
  directory, or one host) is read where it is; one that is not is fetched into a cache
  directory of the worker's own (written to a temporary name, checked against the length the
  server sent, renamed; the last version and the newest base kept), and that copy is loaded. A
  local file of another lineage (a host the learner ran on before) is fetched anew. A failed
  fetch is a file that could not be read: the weights in hand stay in use, and the file is not
  asked for again for a while (``BACKOFF_S``). No proxy: the server is on the cluster's network.
  The fetch runs in the worker's update, between decode steps: the broadcast, when on, brings
  every version after a worker's first without one.

Plain ``http.server`` and ``urllib``: the files are the learner's own, written once and
renamed into place (a request never sees half a file); the transfer is one GET per version per
worker. The broadcast stays the fast path; files are what newcomers read first.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from reval.weights.files import file_lineage

log = logging.getLogger("reval.weights")

SERVED = re.compile(r"(v\d{8}|base-[0-9a-f]+)\.safetensors")
"""The only names the server hands out: version files and LoRA bases."""
CHUNK = 1 << 20
HANDLER_TIMEOUT_S = 60.0
"""A connection of the server's idle this long is closed."""
BACKOFF_S = (1.0, 30.0)
"""A failed fetch of a file is not tried again for the first, doubling up to the second."""
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""No proxy: the learner is on the cluster's own network (a proxy from the environment would
not reach it, and would see the run's secret)."""


class FileServer:
    """The learner's weights directory, read-only over HTTP (``url``: what is announced)."""

    def __init__(self, directory: str | Path, host: str, bind: str, port: int = 0) -> None:
        self.directory = Path(directory).resolve()  # (as it is now: a link may go)
        self.secret = secrets.token_hex(16)
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = HANDLER_TIMEOUT_S  # (an idle connection does not hold a thread forever)

            def do_GET(self) -> None:
                server._get(self)

            def log_message(self, format: str, *args: Any) -> None:
                return  # (every GET would be a line in the learner's log)

        self.httpd = ThreadingHTTPServer((bind, port), Handler)
        self.httpd.daemon_threads = True
        self.port = int(self.httpd.server_address[1])
        self.url = f"http://{host}:{self.port}/{self.secret}/"
        self.served = 0
        """Files sent whole."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="reval-weight-files")  # fmt: skip
        self._thread.start()

    def _get(self, req: BaseHTTPRequestHandler) -> None:
        parts = req.path.split("?")[0].strip("/").split("/")
        if len(parts) != 2 or not SERVED.fullmatch(parts[1]):
            req.send_error(404)
            return
        if not hmac.compare_digest(parts[0].encode(), self.secret.encode()):
            req.send_error(403)
            return
        try:
            f = open(self.directory / parts[1], "rb")  # noqa: SIM115 (closed below)
        except OSError:  # (pruned since it was announced, or never written)
            req.send_error(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            req.send_response(200)
            req.send_header("Content-Type", "application/octet-stream")
            req.send_header("Content-Length", str(size))
            req.end_headers()
            try:
                req.connection.sendfile(f)  # (the kernel copies; the GIL stays with training)
            except OSError:  # (the worker went away mid-file)
                return
        self.served += 1

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FileFetcher:
    """Announced weight files as paths on this host: where they are when this host sees them,
    else fetched from the learner's ``files_url`` into ``cache_dir`` (a temporary directory of
    its own by default, removed by ``close``)."""

    def __init__(
        self, cache_dir: str | Path | None = None, keep: int = 1, timeout_s: float = 60.0
    ) -> None:
        self._tmp = None if cache_dir is not None else tempfile.TemporaryDirectory(
            prefix="reval-weights-")  # fmt: skip
        self.dir = Path(cache_dir if cache_dir is not None else self._tmp.name)  # type: ignore[union-attr]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        self.timeout_s = timeout_s
        self.fetched = 0
        """Files fetched over HTTP so far."""
        self._failed: dict[str, tuple[float, int]] = {}
        """Cache names whose last fetch failed: (when, failures in a row)."""

    def local(self, path: Path, url: str | None, lineage: str | None = None) -> Path:
        """``path`` if this host has it (and, with a server to ask, the file is ``lineage``'s:
        a host the learner ran on before keeps its last files, whose version numbers a resumed
        learner reuses); else a fetched copy from ``url`` (the announced ``files_url``). Raises
        OSError when neither is to be had (as a missing file does), at once while a failed
        fetch of the file backs off (``BACKOFF_S``)."""
        if url is None:
            return path
        if path.is_file() and (lineage is None or file_lineage(path) in (lineage, None)):
            return path
        # (named by the server too: a resumed learner's new lineage may reuse version numbers)
        dest = self.dir / f"{hashlib.sha1(url.encode()).hexdigest()[:10]}-{path.name}"
        if dest.is_file():
            return dest
        failed, tries = self._failed.get(dest.name, (0.0, 0))
        wait = min(BACKOFF_S[0] * 2 ** max(tries - 1, 0), BACKOFF_S[1])
        if tries and time.monotonic() < failed + wait:
            raise OSError(f"{path.name}: the last fetch failed; next try in {wait:.0f} s")
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
        where = urllib.parse.urlsplit(url).netloc  # (not the path: it holds the run's secret)
        try:
            with _DIRECT.open(url + path.name, timeout=self.timeout_s) as resp:
                want = int(resp.headers.get("Content-Length", -1))
                free = shutil.disk_usage(self.dir).free
                if want > free:
                    raise OSError(f"{want} bytes do not fit in {self.dir} ({free} free)")
                with open(tmp, "wb") as out:
                    shutil.copyfileobj(resp, out, CHUNK)
                got = tmp.stat().st_size
            if got != want:
                raise OSError(f"{got} of {want} bytes arrived")
            os.replace(tmp, dest)
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
            tmp.unlink(missing_ok=True)
            self._failed[dest.name] = (time.monotonic(), tries + 1)
            reason = getattr(err, "reason", None) or err
            raise OSError(f"could not fetch {path.name} from the learner at {where}: "
                          f"{reason}") from None  # fmt: skip
        self._failed.pop(dest.name, None)
        self.fetched += 1
        self._prune(dest)
        return dest

    def _prune(self, newest: Path) -> None:
        """Keep the last ``keep`` version files (one by default: a version is loaded, copied
        into the engine, before the next is fetched) and the newest base."""
        kind = "-base-" if "-base-" in newest.name else "-v"
        same = sorted((p for p in self.dir.glob(f"*{kind}*.safetensors")),
                      key=lambda p: p.stat().st_mtime_ns)  # fmt: skip
        keep = 1 if kind == "-base-" else self.keep
        for old in same[:-keep]:
            if old != newest:
                old.unlink(missing_ok=True)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


__all__ = ["SERVED", "FileFetcher", "FileServer"]
