"""Hand-run benchmark of the Redis replay ring (``buffer/redis_ring.py``).

For 2 KB records (256 tokens: prompt 64 + response 192) and 40 KB records (5,000 tokens: prompt
200 + response 4,800), and for each batch size B, it measures:

- insert: ``RedisRing.insert`` of batches of B pre-built trajectories (client-side encode and
  validation, then one MULTI/EXEC per chunk: an HSET of the records to a stage hash and the
  INSERT script, which gives them positions and renames the stage into the ring), records/s and
  MB/s;
- encode-only / decode-only: ``buffer.record_codec.encode_many`` / ``decode_many`` alone on one core
  in batches of 1024, the client's share of an insert / a sample;
- sample: ``RedisRing.sample(B)`` repeated (the O(1) SAMPLE script, B positions drawn by the
  client, one MULTI/EXEC of an HMGET per chunk touched and a BITFIELD of the use counts, then
  decode and validation of every record, and the ``reval_buffer_*`` metrics a learner
  updates), records/s, MB/s and per-call latency p50/p99; once
  more from a ring filled by batches of 64 (more, smaller chunks to read from);
- beside it, the server ceiling: ``redis-benchmark`` LPUSH of 2 KB / 40 KB values, pipelined
  (-P 16, its default 50 clients), in db 15 (it writes its own key ``mylist`` there, up to about
  0.8 GB at --scale 1, deleted after each run; skipped when db 15 already holds a ``mylist`` this
  script did not create).

Run it by hand, from the repository root, with Redis on 127.0.0.1:6379 and the machine otherwise
idle (the full run takes a minute or two; ``--scale 0.2`` is a quick end-to-end check):

    .venv/bin/python benchmarks/buffer_bench.py
    .venv/bin/python benchmarks/buffer_bench.py --json runs/buffer_bench.json

It prints markdown tables to stdout; the figures go into docs/buffer.md, with the header line
(Redis version, CPUs, load). MB is 10^6 bytes of encoded records. Every key it writes is under
``reval-bench:<pid>:`` and is deleted at the end, also on an error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import numpy as np
import redis

from buffer.metrics import BufferMetrics
from buffer.prefetch import Prefetcher
from buffer.record_codec import decode_many, encode_many
from buffer.records import Trajectory
from buffer.redis_ring import RedisRing
from reval.redis import ring_keys

VOCAB = 151_936  # token ids drawn below this (a Qwen-sized vocabulary)
MB = 1e6
WARMUP_BATCHES = 2  # insert batches on a throwaway ring before each timed insert run
WARMUP_SAMPLES = 3  # sample calls before each timed sample run
CEILING_DB = 15  # redis-benchmark writes its key "mylist" in this db
CEILING_KEY = "mylist"
TARGET_RPS = 100_000.0
TARGET_P50_S = 0.25


@dataclass(frozen=True)
class SizeSpec:
    name: str
    label: str
    prompt_tokens: int
    response_tokens: int
    insert_records: int
    """Records inserted per batch size at --scale 1."""
    sample_records: int
    """Records sampled per batch size at --scale 1."""
    capacity: int
    """Default ring capacity M."""


SIZES: dict[str, SizeSpec] = {
    "2k": SizeSpec("2k", "2 KB", 64, 192, 20_000, 200_000, 50_000),
    "40k": SizeSpec("40k", "40 KB", 200, 4_800, 4_000, 40_000, 5_120),
}
CEILING_RUNS = ((2_048, 200_000), (40_960, 20_000))  # (value bytes, requests at --scale 1)


@dataclass
class CodecResult:
    size: str
    prompt_tokens: int
    response_tokens: int
    records: int
    mean_bytes: float
    encode_rps: float
    encode_mbps: float
    decode_rps: float
    decode_mbps: float


@dataclass
class InsertResult:
    size: str
    mode: str
    """``call``: each insert waits for its round trip; ``background``: a sender thread sends
    while the caller encodes the next batch (``RedisRing(background=True)``)."""
    batch: int
    capacity: int
    records: int
    seconds: float
    rps: float
    mbps: float
    evicted: int


@dataclass
class SampleResult:
    size: str
    mode: str
    """``call``: one ``sample`` after another; ``prefetch``: ``buffer.prefetch.Prefetcher`` with
    two threads, one waiting on Redis while the other decodes (how the learner samples)."""
    batch: int
    held: int
    calls: int
    seconds: float
    rps: float
    mbps: float
    p50_ms: float
    p99_ms: float
    latencies_ms: list[float] = field(repr=False)


@dataclass
class CeilingResult:
    value_bytes: int
    requests: int
    ops_per_s: float | None
    mbps: float | None
    note: str = ""


@dataclass
class ClientCeiling:
    """redis-py moving raw blobs with no record logic: what the Python client alone reaches."""

    value_bytes: int
    batch: int
    records: int
    push_rps: float
    read_rps: float
    encode_push_rps: float | None = None
    """``encode_many`` + LPUSH of the benchmark's own records: the least an insert must do."""
    read_decode_rps: float | None = None
    """LRANGE + ``decode_many`` (validation included): the least a sample must do."""


@dataclass
class Target:
    name: str
    measured: str
    passed: bool | None  # None: not measured in this run


# -- records ------------------------------------------------------------------------------------


def build_records(spec: SizeSpec, n: int, rng: np.random.Generator) -> list[Trajectory]:
    """``n`` distinct records of the given shape (rows of one array each: no per-record copy)."""
    p, total = spec.prompt_tokens, spec.prompt_tokens + spec.response_tokens
    ids = rng.integers(0, VOCAB, size=(n, total), dtype=np.int32)
    logprobs = -rng.exponential(1.0, size=(n, spec.response_tokens)).astype(np.float32)
    rewards = rng.integers(0, 2, size=n)
    return [
        Trajectory(
            prompt_ids=ids[i, :p],
            response_ids=ids[i, p:],
            logprobs=logprobs[i],
            reward_raw=float(rewards[i]),
            reward=float(rewards[i]) - 0.5,
            prompt_id=f"bench-{i % 1000:04d}",
            group_id=f"group-{i // 8:06d}",
            worker_id="bench-worker-0",
            run_id="bench",
        )
        for i in range(n)
    ]


def fresh_ids(records: Sequence[Trajectory]) -> list[Trajectory]:
    """The same records under new trajectory ids (arrays shared, not copied)."""
    return [dataclasses.replace(t, traj_id=uuid.uuid4().hex) for t in records]


def records_for(spec: SizeSpec, batch: int, scale: float) -> int:
    """Records inserted for one batch size: whole batches, at least two of them."""
    want = max(spec.insert_records * scale, 2 * batch)
    return math.ceil(want / batch) * batch


def bench_codec(spec: SizeSpec, records: Sequence[Trajectory]) -> CodecResult:
    decode_many(encode_many(records[:256]))  # warm-up
    # In batches of 1024, as insert and sample do (array checks vectorized per batch).
    t0 = time.perf_counter()
    blobs = [b for i in range(0, len(records), 1024) for b in encode_many(records[i : i + 1024])]
    enc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(0, len(blobs), 1024):
        decode_many(blobs[i : i + 1024])
    dec_s = time.perf_counter() - t0
    total = sum(len(b) for b in blobs)
    n = len(blobs)
    return CodecResult(
        size=spec.name,
        prompt_tokens=spec.prompt_tokens,
        response_tokens=spec.response_tokens,
        records=n,
        mean_bytes=total / n,
        encode_rps=n / enc_s,
        encode_mbps=total / enc_s / MB,
        decode_rps=n / dec_s,
        decode_mbps=total / dec_s / MB,
    )


# -- the ring -----------------------------------------------------------------------------------


class Rings:
    """Creates rings under the benchmark's key prefix and deletes every one of them."""

    def __init__(self, client: redis.Redis, prefix: str, seed: int) -> None:
        self.client, self.prefix, self.seed = client, prefix, seed
        self.open: list[RedisRing] = []

    def make(self, run: str, capacity: int, background: bool = False) -> RedisRing:
        self.client.delete(*ring_keys(self.prefix, run).stored)  # left by an earlier process
        ring = RedisRing(
            run,
            capacity,
            client=self.client,
            key_prefix=self.prefix,
            seed=self.seed,
            retry_s=5.0,
            background=background,
            reset=True,
            metrics=BufferMetrics(),  # as the learner and the workers run it
        )
        self.open.append(ring)
        return ring

    def drop(self, ring: RedisRing) -> None:
        ring.delete()
        self.open.remove(ring)

    def cleanup(self) -> None:
        for ring in list(self.open):
            try:
                self.drop(ring)
            except Exception as err:  # keep going: the prefix sweep below catches the rest
                print(f"warning: could not delete ring {ring.run}: {err}", file=sys.stderr)
        keys = list(self.client.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            self.client.delete(*keys)


def bench_insert(
    rings: Rings,
    spec: SizeSpec,
    batch: int,
    capacity: int,
    records: Sequence[Trajectory],
    mean_bytes: float,
    background: bool = False,
) -> InsertResult:
    batches = [records[i : i + batch] for i in range(0, len(records), batch)]
    warm = rings.make(f"{spec.name}-warm-b{batch}", capacity)  # connection, script cache
    for b in batches[:WARMUP_BATCHES]:
        warm.insert(b)
    rings.drop(warm)

    ring = rings.make(f"{spec.name}-insert-b{batch}", capacity, background)
    evicted = 0
    t0 = time.perf_counter()
    for b in batches:
        evicted += ring.insert(b)
    if background and not ring.wait_sent(timeout=120):
        raise RuntimeError("the background sender did not finish")
    seconds = time.perf_counter() - t0
    if background:
        evicted = ring.stats().evicted
        ring.close()  # stops the sender thread (the shared client stays open)
    if ring.spooled:
        raise RuntimeError(f"Redis was unreachable: {ring.spooled} records left in the spool")
    held = len(ring)
    if held != min(len(records), capacity):
        raise RuntimeError(f"ring holds {held} after inserting {len(records)} (M = {capacity})")
    rings.drop(ring)
    return InsertResult(
        size=spec.name,
        mode="background" if background else "call",
        batch=batch,
        capacity=capacity,
        records=len(records),
        seconds=seconds,
        rps=len(records) / seconds,
        mbps=len(records) * mean_bytes / seconds / MB,
        evicted=evicted,
    )


def fill(ring: RedisRing, records: Sequence[Trajectory], target: int, batch: int = 1024) -> None:
    """Insert ``target`` records (the given ones, repeated under new ids) in batches of
    ``batch`` (each batch is one chunk of the ring: a sample reads each chunk it touches with one
    HMGET), untimed."""
    done = 0
    while done < target:
        chunk = fresh_ids(records[: target - done]) if done else list(records[:target])
        for i in range(0, len(chunk), batch):
            ring.insert(chunk[i : i + batch])
        done += len(chunk)
    if ring.spooled:
        raise RuntimeError(f"Redis was unreachable: {ring.spooled} records left in the spool")


def bench_sample(
    ring: RedisRing,
    spec: SizeSpec,
    batch: int,
    calls: int,
    mean_bytes: float,
    prefetch: bool = False,
) -> SampleResult:
    for _ in range(WARMUP_SAMPLES):
        ring.sample(batch)
    lat = np.empty(calls)
    pf = Prefetcher(ring, batch, depth=2, workers=2) if prefetch else None
    start = time.perf_counter()
    try:
        for k in range(calls):
            t0 = time.perf_counter()
            got = pf.get(timeout=60) if pf is not None else ring.sample(batch)
            lat[k] = time.perf_counter() - t0
            if len(got.trajectories) != batch:
                raise RuntimeError(f"sample({batch}) returned {len(got.trajectories)} records")
        seconds = time.perf_counter() - start
    finally:
        if pf is not None:
            pf.close()
    n = calls * batch
    return SampleResult(
        size=spec.name,
        mode="prefetch" if prefetch else "call",
        batch=batch,
        held=len(ring),
        calls=calls,
        seconds=seconds,
        rps=n / seconds,
        mbps=n * mean_bytes / seconds / MB,
        p50_ms=float(np.percentile(lat, 50)) * 1e3,
        p99_ms=float(np.percentile(lat, 99)) * 1e3,
        latencies_ms=[round(float(x) * 1e3, 4) for x in lat],
    )


# -- the server ceiling -------------------------------------------------------------------------


def server_ceiling(url: str, scale: float) -> list[CeilingResult]:
    runs = [(size, max(1_000, int(n * scale))) for size, n in CEILING_RUNS]
    exe = shutil.which("redis-benchmark")
    u = urlparse(url)
    if exe is None or u.scheme not in ("redis", ""):
        why = "redis-benchmark not found" if exe is None else f"{u.scheme}:// URL not supported"
        return [CeilingResult(size, n, None, None, f"not measured: {why}") for size, n in runs]
    host, port = u.hostname or "127.0.0.1", u.port or 6379
    auth: list[str] = []
    if u.password:
        auth = ["-a", u.password] + (["--user", u.username] if u.username else [])
    probe = redis.Redis(
        host=host, port=port, db=CEILING_DB, username=u.username, password=u.password
    )
    out: list[CeilingResult] = []
    try:
        for size, n in runs:
            if probe.exists(CEILING_KEY):
                note = f"skipped: db {CEILING_DB} already holds a '{CEILING_KEY}' not made here"
                out.append(CeilingResult(size, n, None, None, note))
                continue
            cmd = [exe, "-h", host, "-p", str(port), *auth, "--dbnum", str(CEILING_DB)]
            cmd += ["-P", "16", "-t", "lpush", "-d", str(size), "-n", str(n), "-q"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            except subprocess.TimeoutExpired:
                out.append(CeilingResult(size, n, None, None, "failed: ran past 600 s"))
                continue
            finally:
                probe.delete(CEILING_KEY)  # it did not exist before this run: it is ours
            text = proc.stdout.replace("\r", "\n")
            found = re.findall(r"LPUSH:\s*([\d.]+)\s+requests per second", text)
            if proc.returncode != 0 or not found:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                note = f"failed (rc {proc.returncode}): {' '.join(tail)}"
                out.append(CeilingResult(size, n, None, None, note))
                continue
            ops = float(found[-1])
            out.append(CeilingResult(size, n, ops, ops * size / MB))
    finally:
        probe.close()
    return out


def client_ceiling(
    client: redis.Redis,
    key: str,
    size: int,
    batch: int,
    n: int,
    records: Sequence[Trajectory] = (),
) -> ClientCeiling:
    """LPUSH of ``batch`` ready-made ``size``-byte blobs per command, then LRANGE of ``batch`` per
    command: one round trip per batch, no encoding, decoding or ring bookkeeping. With
    ``records``, the same with this project's record format: ``encode_many`` then LPUSH, LRANGE
    then ``decode_many``; that is the least any insert or sample of these records does, so the
    ring's rates against it say what the ring itself (positions, eviction, use counts, limiter,
    random access) costs on the same machine in the same run."""
    blob = np.random.default_rng(0).bytes(size)
    values = [blob[:-8] + i.to_bytes(8, "little") for i in range(batch)]
    rounds = max(1, n // batch)
    client.delete(key)
    encode_push = read_decode = None
    try:
        t0 = time.perf_counter()
        for _ in range(rounds):
            client.lpush(key, *values)
        push = rounds * batch / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(rounds):
            got = client.lrange(key, i * batch, (i + 1) * batch - 1)
            assert len(got) == batch
        read = rounds * batch / (time.perf_counter() - t0)
        if len(records) >= batch:
            client.delete(key)
            chunks = [records[i : i + batch] for i in range(0, len(records) - batch + 1, batch)]
            t0 = time.perf_counter()
            for i in range(rounds):
                client.lpush(key, *encode_many(chunks[i % len(chunks)]))
            encode_push = rounds * batch / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for i in range(rounds):
                good, bad = decode_many(client.lrange(key, i * batch, (i + 1) * batch - 1))
                assert len(good) == batch and not bad
            read_decode = rounds * batch / (time.perf_counter() - t0)
    finally:
        client.delete(key)
    return ClientCeiling(size, batch, rounds * batch, push, read, encode_push, read_decode)


# -- report -------------------------------------------------------------------------------------


def targets(inserts: Sequence[InsertResult], samples: Sequence[SampleResult]) -> list[Target]:
    out: list[Target] = []
    for kind, rows in (("insert", inserts), ("sample", samples)):
        small = [r for r in rows if r.size == "2k"]
        name = f"2 KB {kind} >= {TARGET_RPS / 1e3:.0f}k rec/s (best B and mode)"
        if not small:
            out.append(Target(name, "not measured", None))
            continue
        best = max(small, key=lambda r: r.rps)
        got = f"{best.rps:,.0f} rec/s (B={best.batch}, {best.mode})"
        out.append(Target(name, got, best.rps >= TARGET_RPS))
    name = f"40 KB sample B=1024 p50 < {TARGET_P50_S} s"
    big = [r for r in samples if r.size == "40k" and r.batch == 1024 and r.mode == "call"]
    if big:
        p50 = big[0].p50_ms / 1e3
        out.append(Target(name, f"{p50:.3f} s", p50 < TARGET_P50_S))
    else:
        out.append(Target(name, "not measured", None))
    return out


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(
    meta: dict[str, Any],
    codecs: Sequence[CodecResult],
    inserts: Sequence[InsertResult],
    samples: Sequence[SampleResult],
    ceiling: Sequence[CeilingResult],
    goals: Sequence[Target],
    clients: Sequence[ClientCeiling] = (),
) -> str:
    label = {s.name: s.label for s in SIZES.values()}
    parts = [
        "# Redis replay ring benchmark",
        f"Redis {meta['redis_version']} at {meta['url']}; Python {meta['python']}; "
        f"{meta['cpus']} CPUs, load {meta['load']}; scale {meta['scale']}; {meta['when']}",
        "## Records: client codec alone (one core)",
        table(
            [
                "size",
                "tokens (P + T)",
                "encoded bytes",
                "encode rec/s",
                "encode MB/s",
                "decode rec/s",
                "decode MB/s",
            ],
            [
                [
                    label[c.size],
                    f"{c.prompt_tokens} + {c.response_tokens}",
                    f"{c.mean_bytes:,.0f}",
                    f"{c.encode_rps:,.0f}",
                    f"{c.encode_mbps:,.1f}",
                    f"{c.decode_rps:,.0f}",
                    f"{c.decode_mbps:,.1f}",
                ]
                for c in codecs
            ],
        ),
        "## RedisRing insert (encode + validate, then MULTI: HSET to a stage + the INSERT script)",
        table(
            ["size", "mode", "B", "M", "records", "rec/s", "MB/s", "evicted"],
            [
                [
                    label[r.size],
                    r.mode,
                    str(r.batch),
                    f"{r.capacity:,}",
                    f"{r.records:,}",
                    f"{r.rps:,.0f}",
                    f"{r.mbps:,.1f}",
                    f"{r.evicted:,}",
                ]
                for r in inserts
            ],
        ),
        "## RedisRing sample (SAMPLE script, then MULTI: HMGET per chunk + BITFIELD; decode)",
        table(
            ["size", "mode", "B", "held", "calls", "rec/s", "MB/s", "p50 ms", "p99 ms"],
            [
                [
                    label[r.size],
                    r.mode,
                    str(r.batch),
                    f"{r.held:,}",
                    str(r.calls),
                    f"{r.rps:,.0f}",
                    f"{r.mbps:,.1f}",
                    f"{r.p50_ms:,.2f}",
                    f"{r.p99_ms:,.2f}",
                ]
                for r in samples
            ],
        ),
        "## Server ceiling: redis-benchmark LPUSH (-P 16, 50 clients, db 15)",
        table(
            ["value bytes", "requests", "ops/s", "MB/s", "note"],
            [
                [
                    f"{c.value_bytes:,}",
                    f"{c.requests:,}",
                    "-" if c.ops_per_s is None else f"{c.ops_per_s:,.0f}",
                    "-" if c.mbps is None else f"{c.mbps:,.1f}",
                    c.note,
                ]
                for c in ceiling
            ],
        ),
        "## Python client ceiling: redis-py, one command per batch (LPUSH / LRANGE); raw blobs, "
        "then the 2 KB records with encode_many / decode_many",
        table(
            [
                "value bytes",
                "batch",
                "records",
                "push rec/s",
                "read rec/s",
                "encode + push rec/s",
                "read + decode rec/s",
            ],
            [
                [
                    f"{c.value_bytes:,}",
                    f"{c.batch:,}",
                    f"{c.records:,}",
                    f"{c.push_rps:,.0f}",
                    f"{c.read_rps:,.0f}",
                    "-" if c.encode_push_rps is None else f"{c.encode_push_rps:,.0f}",
                    "-" if c.read_decode_rps is None else f"{c.read_decode_rps:,.0f}",
                ]
                for c in clients
            ],
        ),
        "## Targets",
        table(
            ["target", "measured", "result"],
            [
                [g.name, g.measured, "n/a" if g.passed is None else "PASS" if g.passed else "FAIL"]
                for g in goals
            ],
        ),
    ]
    return "\n\n".join(parts) + "\n"


# -- main ---------------------------------------------------------------------------------------


def parse_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--url", default="redis://127.0.0.1:6379/0", help="Redis URL of the rings")
    ap.add_argument(
        "--scale", type=float, default=1.0, help="multiply record and sample counts (0.2: quick)"
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    ap.add_argument("--sizes", default="2k,40k", help="record sizes: 2k, 40k (comma-separated)")
    ap.add_argument("--batches", default="64,1024", help="batch sizes B (comma-separated)")
    ap.add_argument("--capacity-2k", type=int, default=SIZES["2k"].capacity, help="M for 2 KB")
    ap.add_argument("--capacity-40k", type=int, default=SIZES["40k"].capacity, help="M for 40 KB")
    ap.add_argument(
        "--min-calls", type=int, default=30, help="at least this many timed sample calls per B"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-ceiling", action="store_true", help="skip redis-benchmark")
    args = ap.parse_args(argv)
    args.sizes = parse_list(args.sizes)
    bad = [s for s in args.sizes if s not in SIZES]
    if bad or not args.sizes:
        ap.error(f"--sizes: unknown {bad}; choose from {sorted(SIZES)}")
    try:
        args.batches = [int(b) for b in parse_list(args.batches)]
    except ValueError:
        ap.error(f"--batches: not integers: {args.batches!r}")
    if not args.batches or min(args.batches) < 1:
        ap.error("--batches: give positive integers")
    if args.scale <= 0:
        ap.error("--scale must be > 0")
    args.capacity = {"2k": args.capacity_2k, "40k": args.capacity_40k}
    for s in args.sizes:
        if args.capacity[s] < max(args.batches):
            ap.error(f"capacity for {s} ({args.capacity[s]}) is below the largest B")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the keys are deleted
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    client = redis.Redis.from_url(args.url, socket_timeout=60, socket_connect_timeout=2)
    try:
        info = client.info("server")
    except redis.ConnectionError as err:
        print(f"cannot reach Redis at {args.url}: {err}", file=sys.stderr)
        return 2
    meta: dict[str, Any] = {
        "url": args.url,
        "redis_version": info.get("redis_version", "?"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load": f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "?",
        "scale": args.scale,
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "sizes": args.sizes,
        "batches": args.batches,
        "capacity": {s: args.capacity[s] for s in args.sizes},
    }
    prefix = f"reval-bench:{os.getpid()}:"
    rings = Rings(client, prefix, args.seed)
    rng = np.random.default_rng(args.seed)
    codecs: list[CodecResult] = []
    inserts: list[InsertResult] = []
    samples: list[SampleResult] = []
    ceiling: list[CeilingResult] = []
    clients: list[ClientCeiling] = []
    small: list[Trajectory] = []
    try:
        for name in args.sizes:
            spec, capacity = SIZES[name], args.capacity[name]
            pool = build_records(
                spec, max(records_for(spec, b, args.scale) for b in args.batches), rng
            )
            print(f"[{spec.label}] {len(pool):,} records built", file=sys.stderr, flush=True)
            codec = bench_codec(spec, pool)
            codecs.append(codec)
            for b in args.batches:
                recs = pool[: records_for(spec, b, args.scale)]
                for bg in (False, True):
                    inserts.append(
                        bench_insert(rings, spec, b, capacity, recs, codec.mean_bytes, bg)
                    )
                    print(
                        f"[{spec.label}] insert B={b} {inserts[-1].mode}: "
                        f"{inserts[-1].rps:,.0f} rec/s",
                        file=sys.stderr,
                        flush=True,
                    )
            ring = rings.make(f"{spec.name}-sample", capacity)
            fill(ring, pool, capacity)
            for b in args.batches:
                calls = max(args.min_calls, math.ceil(spec.sample_records * args.scale / b))
                for pre in (False, True):
                    samples.append(bench_sample(ring, spec, b, calls, codec.mean_bytes, pre))
                print(
                    f"[{spec.label}] sample B={b}: {samples[-1].rps:,.0f} rec/s",
                    file=sys.stderr,
                    flush=True,
                )
            rings.drop(ring)
            # The same from a ring filled by small producer batches (64: a worker's 8 prompts
            # x 8 answers), so a sample touches up to B chunks instead of ~M/1024.
            ring = rings.make(f"{spec.name}-sample64", capacity)
            fill(ring, pool, capacity, batch=64)
            b = max(args.batches)
            calls = max(args.min_calls, math.ceil(spec.sample_records * args.scale / b))
            samples.append(bench_sample(ring, spec, b, calls, codec.mean_bytes, False))
            samples[-1].mode = "call, filled by 64"
            print(f"[{spec.label}] sample B={b} (filled by 64): {samples[-1].rps:,.0f} rec/s",
                  file=sys.stderr, flush=True)  # fmt: skip
            rings.drop(ring)
            if spec.name == "2k":
                small = pool[:4096]  # for the client ceiling with this record format
            del pool
        if "2k" in args.sizes:
            n = max(10_240, int(50_000 * args.scale))
            c = client_ceiling(client, f"{prefix}client-ceiling", 2048, 1024, n, small)
            clients.append(c)
            line = (
                f"[2 KB] redis-py ceiling: push {c.push_rps:,.0f} rec/s, read {c.read_rps:,.0f}"
                f" rec/s; encode + push {c.encode_push_rps or 0:,.0f}, read + decode"
                f" {c.read_decode_rps or 0:,.0f}"
            )
            print(line, file=sys.stderr, flush=True)
        rings.cleanup()  # free the memory before redis-benchmark fills db 15
        if not args.no_ceiling:
            ceiling = server_ceiling(args.url, args.scale)
    finally:
        rings.cleanup()
        client.close()

    goals = targets(inserts, samples)
    print(report(meta, codecs, inserts, samples, ceiling, goals, clients))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        raw = {
            "meta": meta,
            "codec": [dataclasses.asdict(c) for c in codecs],
            "insert": [dataclasses.asdict(r) for r in inserts],
            "sample": [dataclasses.asdict(r) for r in samples],
            "ceiling": [dataclasses.asdict(c) for c in ceiling],
            "client_ceiling": [dataclasses.asdict(c) for c in clients],
            "targets": [dataclasses.asdict(g) for g in goals],
        }
        args.json.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"raw figures written to {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
