"""A producer process for the Redis tests: streams ``--count`` records with ids
``{tag}-{i:06d}`` in batches, then flushes its spool and prints how many were spooled/dropped."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from buffer.metrics import BufferMetrics
from buffer.redis_ring import RedisRing
from tests.conftest import make_traj


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--run", default="mp")
    ap.add_argument("--capacity", type=int, default=100_000)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--count", type=int, default=500)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--flush-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    metrics = BufferMetrics()
    ring = RedisRing(args.run, args.capacity, url=args.url, key_prefix=args.prefix, metrics=metrics)
    # Fail fast on a dead server so the spool, not the socket, absorbs an outage.
    ring.client.connection_pool.connection_kwargs["socket_timeout"] = 2.0
    max_spooled = 0
    for lo in range(0, args.count, args.batch):
        batch = []
        for i in range(lo, min(lo + args.batch, args.count)):
            t = make_traj(i)
            t.traj_id = f"{args.tag}-{i:06d}"
            batch.append(t)
        ring.insert(batch)
        max_spooled = max(max_spooled, ring.spooled)
        if args.sleep:
            time.sleep(args.sleep)
    ring.close(flush_s=args.flush_s)
    errors = metrics.registry.get_sample_value("reval_buffer_backend_errors_total")
    print(
        json.dumps(
            {
                "left": ring.spooled,
                "max_spooled": max_spooled,
                "dropped": ring.spool_dropped,
                "errors": errors,
            }
        )
    )
    return 0 if ring.spooled == 0 else 3


if __name__ == "__main__":
    sys.exit(main())
