"""Hand-run benchmark of weight sync: the learner's bucketed broadcast (``reval/weights.py``
buckets, one gloo broadcast per bucket, the receiver unpacking views) against one flat tensor
broadcast of the same bytes and a memcpy, in the same run, for a 50 MB and a 500 MB model
(float32 tensors of transformer-like shapes). Two processes on this machine over gloo.

    .venv/bin/python benchmarks/sync_bench.py            # figures go into docs/learner.md

Target (the learner-service issue): the bucketed broadcast at least 0.9 of the flat one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reval.weights.buckets import pack_buckets
from reval.weights.collective import BroadcastHub, BroadcastReceiver


def model_like(total_mb: int) -> list[tuple[str, torch.Tensor]]:
    """Layers of a transformer: big matrices and small vectors, ``total_mb`` MB of float32."""
    out: list[tuple[str, torch.Tensor]] = []
    hidden = 512 if total_mb <= 100 else 1536
    per_layer = 12 * hidden * hidden + 4 * hidden  # qkv/o + mlp + norms, in floats
    layers = max(1, total_mb * (1 << 20) // 4 // per_layer)
    for i in range(layers):
        out += [
            (f"l{i}.attn.qkv", torch.randn(3 * hidden, hidden)),
            (f"l{i}.attn.o", torch.randn(hidden, hidden)),
            (f"l{i}.mlp.up", torch.randn(4 * hidden, hidden)),
            (f"l{i}.mlp.down", torch.randn(hidden, 4 * hidden)),
            (f"l{i}.norm1", torch.randn(hidden)),
            (f"l{i}.norm2", torch.randn(hidden)),
            (f"l{i}.bias", torch.randn(3 * hidden)),
            (f"l{i}.bias2", torch.randn(hidden)),
        ]
    return out


def _hub_pair(rank: int, bucket_bytes: int) -> tuple[Any, Any]:
    """Rank 0 hosts a BroadcastHub, rank 1 joins it with a BroadcastReceiver."""
    hub = recv = None
    if rank == 0:
        hub = BroadcastHub(0, host="127.0.0.1", timeout_s=120, bucket_bytes=bucket_bytes)
    where = [(hub.port, hub.secret) if hub is not None else None]
    dist.broadcast_object_list(where, src=0)
    if rank == 1:
        port, secret = where[0]
        recv = BroadcastReceiver("127.0.0.1", int(port), "bench", secret, timeout_s=120)
    dist.barrier()
    if hub is not None:
        while int(hub.store.add("tickets", 0)) < 1:
            time.sleep(0.01)
    return hub, recv


def _take(recv: Any, version: int) -> None:
    while True:
        got = recv.take()
        if got is not None and got[0] == version:
            del got
            recv.release()
            return
        time.sleep(0.0005)


def _rank(rank: int, port: int, sizes: list[int], bucket_mb: float, reps: int, q: object) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=dt.timedelta(seconds=600))
    torch.set_num_threads(1)
    results = []
    for mb in sizes:
        tensors = model_like(mb) if rank == 0 else None
        objs = [[(n, tuple(t.shape)) for n, t in tensors] if tensors else None]
        dist.broadcast_object_list(objs, src=0)
        shapes = objs[0]
        if tensors is None:
            tensors = [(n, torch.empty(s)) for n, s in shapes]
        nbytes = sum(t.numel() * 4 for _, t in tensors)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        times: dict[str, list[float]] = {
            "flat": [],
            "bucketed": [],
            "memcpy": [],
            "memcpy_cold": [],
            "sent": [],
        }
        # The buckets alone (packed beforehand): what bucketing costs the transport.
        if rank == 0:
            ready = [b.data for b in pack_buckets(tensors, int(bucket_mb * (1 << 20)), 1)]
            sizes_ = [int(d.numel()) for d in ready]
        else:
            sizes_ = None
        box = [sizes_]
        dist.broadcast_object_list(box, src=0)
        if rank != 0:
            ready = [torch.empty(n, dtype=torch.uint8) for n in box[0]]
        hub, recv = _hub_pair(rank, int(bucket_mb * (1 << 20)))
        version = 0
        if rank == 0:  # the first sync forms the group
            assert hub.sync(tensors, version) == 1
        else:
            _take(recv, version)
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(flat, src=0)
            times["flat"].append(time.perf_counter() - t0)
            # The real thing: BroadcastHub.sync on rank 0, a BroadcastReceiver on rank 1 (the
            # receiver's thread receives; rank 1 takes the version, releases its buffers), then
            # a barrier: the sync is done when the receiver holds the whole version.
            version += 1
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                assert hub.sync(tensors, version) == 1
            else:
                _take(recv, version)
            dist.barrier()
            times["bucketed"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            for w in [dist.broadcast(d, src=0, async_op=True) for d in ready]:
                w.wait()
            times["sent"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst = torch.empty_like(flat)
            dst.copy_(flat)  # into fresh memory: every page faults on first touch
            times["memcpy_cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(flat)  # into memory touched before
            times["memcpy"].append(time.perf_counter() - t0)
        if recv is not None:
            recv.close()
        dist.barrier()
        if rank == 1:
            med = {k: statistics.median(v) for k, v in times.items()}
            results.append((mb, nbytes, med))
    if rank == 1:
        q.put(results)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="50,500")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, port, sizes, args.bucket_mb, args.reps, q))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = q.get()
    for p in procs:
        p.join()
    print(f"# Weight sync, 2 processes over gloo, buckets of {args.bucket_mb:g} MB, "
          f"median of {args.reps}\n")  # fmt: skip
    print(
        "| model | flat GB/s | buckets GB/s (packed before) | buckets / flat | "
        "sync GB/s (BroadcastHub to BroadcastReceiver) | sync / flat | memcpy GB/s | "
        "memcpy into fresh memory GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for _mb, nbytes, med in results:
        gb = nbytes / 1e9
        flat, buck, mem = gb / med["flat"], gb / med["bucketed"], gb / med["memcpy"]
        cold = gb / med["memcpy_cold"]
        sent = gb / med["sent"]
        print(
            f"| {nbytes / 1e6:,.0f} MB | {flat:.2f} | {sent:.2f} | {sent / flat:.2f} | "
            f"{buck:.2f} | {buck / flat:.2f} | {mem:.2f} | {cold:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
