from __future__ import annotations

import pytest
import torch

from reval.weights.buckets import (
    ALIGN,
    Bucket,
    BufferPool,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
)


def named():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(10, 7, generator=g)),
        ("a.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("steps", torch.arange(5, dtype=torch.int64)),
        ("big", torch.randn(300, 100, generator=g)),  # 120 KB: larger than a bucket
        ("mask", torch.tensor([True, False, True])),
    ]


def test_round_trip_mixed_dtypes_and_bucket_sizes():
    tensors = named()
    buckets = list(pack_buckets(tensors, bucket_bytes=4096, version=3))
    assert len(buckets) == 3  # [a.weight, a.bias, steps] [big] [mask]
    for b in buckets[:1] + buckets[2:]:
        assert b.data.numel() <= 4096
    back = [pair for b in buckets for pair in unpack_bucket(b)]
    assert [n for n, _ in back] == [n for n, _ in tensors]
    for (_, want), (_, got) in zip(tensors, back, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert all(m.offset % ALIGN == 0 for b in buckets for m in b.metas)


def test_header_round_trip_and_rejects_garbage():
    b = next(pack_buckets(named()[:3], 1 << 20, version=9))
    version, nbytes, metas = Bucket.metas_from_header(b.header())
    assert (version, nbytes, metas) == (9, b.data.numel(), b.metas)
    with pytest.raises(ValueError, match="malformed"):
        Bucket.metas_from_header(b"\x93\x01")
    bad = Bucket(b.metas, b.data[:8], 1)
    with pytest.raises(ValueError, match="malformed weight header entry"):
        Bucket.metas_from_header(bad.header())


def test_engine_loads_unpacked_buckets():
    from reval.config import TinyModelConfig
    from reval.policy import build_tiny_model
    from rollout.engines import HFEngine

    src = build_tiny_model(TinyModelConfig(), 40, 0, 1, seed=1)
    dst = build_tiny_model(TinyModelConfig(), 40, 0, 1, seed=2)
    eng = HFEngine(dst, 0, 1)
    for bucket in pack_buckets(src.named_parameters(), bucket_bytes=16 << 10, version=4):
        eng.load_weights(unpack_bucket(bucket), version=bucket.version)
    assert eng.policy_version == 4
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


def test_packing_into_pooled_buffers():
    named = [("a", torch.randn(100)), ("b", torch.arange(7)), ("c", torch.randn(3, 3).half())]
    pool = BufferPool(keep=2)
    for _ in range(3):  # the same buffers every round: nothing allocated after the first
        plan = plan_buckets(named, 512, version=4)
        bufs = [pool.get(p.nbytes) for p in plan]
        for p, buf in zip(plan, bufs, strict=True):
            pooled = p.pack(out=buf)  # (alignment padding is not written: compare tensors)
            assert pooled.data.data_ptr() == buf.data_ptr()
            got = dict(unpack_bucket(pooled))
            for m, t in zip(p.metas, p.tensors, strict=True):
                assert torch.equal(got[m.name], t)
        for buf in bufs:
            pool.put(buf)
    assert pool.allocated == len(plan) and len(pool) == min(2, len(plan))
    big = pool.get(10_000)  # larger than any idle one: a new buffer
    assert big.numel() >= 10_000 and pool.allocated == len(plan) + 1
    with pytest.raises(ValueError, match="uint8 buffer"):
        plan[0].pack(out=torch.empty(1, dtype=torch.uint8))


@pytest.mark.parametrize("publish", ["merged", "adapter"])
def test_published_tensors_walked_once_read_anew(publish):
    """The sender's ``PublishedTensors`` gives what ``published_tensors`` gives (names and the
    very tensors, tied weights once, persistent buffers, a LoRA policy's either way), and a
    parameter replaced after the walk is read as it is now."""
    from reval import lora
    from reval.config import LoraConfig, TinyModelConfig
    from reval.policy import build_tiny_model
    from reval.weights.sender import PublishedTensors, published_tensors

    model = build_tiny_model(TinyModelConfig(), 40, 0, 1, seed=0)
    model = lora.wrap(model, LoraConfig(rank=8))
    cached = PublishedTensors(model, None, publish)
    want = published_tensors(model, lora_publish=publish)
    got = cached()
    assert [n for n, _ in got] == [n for n, _ in want] and len(got) > 4
    assert all(a is b for (_, a), (_, b) in zip(got, want, strict=True))
    _, module, attr = cached.owners[-1]
    old = got[-1][1]
    assert module._parameters[attr] is old
    module._parameters[attr] = torch.nn.Parameter(torch.zeros_like(old))
    assert cached()[-1][1] is module._parameters[attr] and cached()[-1][1] is not old
