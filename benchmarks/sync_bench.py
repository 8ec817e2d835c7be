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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from reval.broadcast import IN_FLIGHT
from reval.weights import Bucket, pack_buckets, plan_buckets, unpack_bucket


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
        times: dict[str, list[float]] = {"flat": [], "bucketed": [], "memcpy": [], "sent": []}
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
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.broadcast(flat, src=0)
            times["flat"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            # What BroadcastHub.sync / BroadcastReceiver do: headers first, then the buckets,
            # packing the next one while the previous one is sent (IN_FLIGHT bound).
            if rank == 0:
                plan = plan_buckets(tensors, int(bucket_mb * (1 << 20)), version=1)
                headers = [b.header() for b in plan]
            hdr = [headers if rank == 0 else None]
            dist.broadcast_object_list(hdr, src=0)
            if rank == 0:
                in_flight = []
                for planned in plan:
                    data = planned.pack().data
                    in_flight.append((data, dist.broadcast(data, src=0, async_op=True)))
                    if len(in_flight) > IN_FLIGHT:
                        in_flight.pop(0)[1].wait()
                for _, work in in_flight:
                    work.wait()
            else:
                posted = []
                for h in hdr[0]:
                    v, n, metas = Bucket.metas_from_header(h)
                    data = torch.empty(n, dtype=torch.uint8)
                    posted.append((Bucket(metas, data, v), dist.broadcast(data, 0, async_op=True)))
                for bucket, work in posted:
                    work.wait()
                    for _name, view in unpack_bucket(bucket):
                        _ = view  # what load_weights copies from
            times["bucketed"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            for w in [dist.broadcast(d, src=0, async_op=True) for d in ready]:
                w.wait()
            times["sent"].append(time.perf_counter() - t0)
            dst = torch.empty_like(flat)
            t0 = time.perf_counter()
            dst.copy_(flat)
            times["memcpy"].append(time.perf_counter() - t0)
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
        "sync GB/s (pack, send, unpack) | sync / flat | memcpy GB/s |"
    )
    print("|---|---|---|---|---|---|---|")
    for _mb, nbytes, med in results:
        gb = nbytes / 1e9
        flat, buck, mem = gb / med["flat"], gb / med["bucketed"], gb / med["memcpy"]
        sent = gb / med["sent"]
        print(
            f"| {nbytes / 1e6:,.0f} MB | {flat:.2f} | {sent:.2f} | {sent / flat:.2f} | "
            f"{buck:.2f} | {buck / flat:.2f} | {mem:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
