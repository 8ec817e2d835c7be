"""Weight files over HTTP (``reval/weights/http_files.py``, issue 43): the learner's read-only
file server and a worker's fetcher, over real HTTP on loopback."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from reval.weights.files import WeightStore, save_tensors
from reval.weights.http_files import FileFetcher, FileServer


def _version(directory: Path, version: int) -> Path:
    path = directory / f"v{version:08d}.safetensors"
    save_tensors([("w", torch.full((64, 64), float(version)))], path, version)
    return path


@pytest.fixture
def served(tmp_path):
    learner = tmp_path / "learner"
    learner.mkdir()
    server = FileServer(learner, host="127.0.0.1", bind="127.0.0.1")
    yield learner, server
    server.close()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_a_worker_without_the_learners_disk_fetches_each_version(served, tmp_path):
    learner, server = served
    fetcher = FileFetcher(tmp_path / "worker", keep=2)
    gone = tmp_path / "elsewhere" / "v00000001.safetensors"  # (the path this host does not see)
    for version in (1, 2, 3):
        _version(learner, version)
        got = fetcher.local(gone.with_name(f"v{version:08d}.safetensors"), server.url)
        assert got.parent == fetcher.dir
        assert torch.equal(WeightStore.load(got)[0][1], torch.full((64, 64), float(version)))
    assert fetcher.fetched == 3
    deadline = time.monotonic() + 10  # (the server counts a file after its thread has sent it,
    while server.served < 3:  # which may be after the worker has read it all)
        assert time.monotonic() < deadline, server.served
        time.sleep(0.01)
    assert len(list(fetcher.dir.glob("*.safetensors"))) == 2  # (the last two kept)
    again = fetcher.local(gone.with_name("v00000003.safetensors"), server.url)
    assert again == got and fetcher.fetched == 3  # (in the cache: not fetched twice)


def test_a_file_this_host_sees_is_read_where_it_is(served, tmp_path):
    learner, server = served
    path = _version(learner, 4)
    fetcher = FileFetcher(tmp_path / "worker")
    assert fetcher.local(path, server.url) == path and fetcher.fetched == 0
    assert fetcher.local(tmp_path / "nowhere.safetensors", None) == tmp_path / "nowhere.safetensors"


def test_only_version_files_and_bases_under_the_secret(served, tmp_path):
    learner, server = served
    _version(learner, 1)
    (learner / "secret.txt").write_text("no")
    (learner / "base-abc123.safetensors").write_bytes(b"x" * 10)
    root = server.url.rsplit("/", 2)[0]
    assert _status(server.url + "v00000001.safetensors") == 200
    assert _status(server.url + "base-abc123.safetensors") == 200
    assert _status(f"{root}/{'0' * 32}/v00000001.safetensors") == 403  # a wrong secret
    assert _status(server.url + "secret.txt") == 404
    assert _status(server.url + "..%2Fsecret.txt") == 404
    assert _status(server.url + "../learner/v00000001.safetensors") == 404
    assert _status(server.url + "v00000009.safetensors") == 404  # (pruned, or never written)
    fetcher = FileFetcher(tmp_path / "worker")
    with pytest.raises(OSError, match="could not fetch v00000009"):
        fetcher.local(tmp_path / "x" / "v00000009.safetensors", server.url)
    assert list(fetcher.dir.iterdir()) == []  # (nothing half-written left)


def test_a_new_learner_reusing_a_version_number_is_fetched_anew(tmp_path):
    """The cache is keyed by the server too: a resumed learner (a new lineage) may publish a
    version number again with other weights."""
    fetcher = FileFetcher(tmp_path / "worker")
    name = tmp_path / "x" / "v00000002.safetensors"
    for value in (2.0, 7.0):
        learner = tmp_path / f"learner{value}"
        learner.mkdir()
        save_tensors([("w", torch.full((4,), value))], learner / name.name, 2)
        server = FileServer(learner, host="127.0.0.1", bind="127.0.0.1")
        try:
            got = fetcher.local(name, server.url)
        finally:
            server.close()
        assert torch.equal(WeightStore.load(got)[0][1], torch.full((4,), value))


def test_a_short_body_a_stale_local_file_a_backoff_and_no_proxy(served, tmp_path, monkeypatch):
    """A body cut short is not kept; a file on this host from another lineage (the learner ran
    here before) is fetched anew; a failed fetch is not tried again at once; a proxy in the
    environment is not used (the learner is on the cluster's own network)."""
    import http.server
    import threading

    from reval.weights.buckets import TensorMeta
    from reval.weights.files import file_lineage, safetensors_header

    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # (nothing listens there)
    learner, server = served
    meta = [TensorMeta("w", "float32", (4,), 0, 16)]
    (learner / "v00000005.safetensors").write_bytes(safetensors_header(meta, 5, "new") + bytes(16))
    stale = tmp_path / "here" / "v00000005.safetensors"  # (same path, an old lineage's file)
    stale.parent.mkdir()
    stale.write_bytes(safetensors_header(meta, 5, "old") + bytes(16))
    fetcher = FileFetcher(tmp_path / "worker")
    got = fetcher.local(stale, server.url, "new")
    assert got != stale and file_lineage(got) == "new" and fetcher.fetched == 1
    assert fetcher.local(stale, server.url, "old") == stale  # (its own lineage: read there)

    class Short(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 10)  # then the connection closes

        def log_message(self, *args: object) -> None:
            return

    short = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Short)
    threading.Thread(target=short.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{short.server_address[1]}/s/"
        with pytest.raises(OSError, match="could not fetch v00000007"):
            fetcher.local(tmp_path / "x" / "v00000007.safetensors", url)
        assert not any(p.name.endswith("v00000007.safetensors") for p in fetcher.dir.iterdir())
        with pytest.raises(OSError, match="next try in"):  # (backing off: no request)
            fetcher.local(tmp_path / "x" / "v00000007.safetensors", url)
    finally:
        short.shutdown()
        short.server_close()
