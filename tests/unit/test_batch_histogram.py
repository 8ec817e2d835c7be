"""BatchHistogram (buffer/metrics.py) exposes exactly what prometheus_client's Histogram exposes
for the same values, observed one batch at a time."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from buffer.metrics import BatchHistogram, BufferMetrics

BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)


def series(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.startswith(name) and not s.name.endswith("_created"):
                out[(s.name, s.labels.get("le", ""))] = s.value
    return out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.lists(
            st.one_of(
                st.sampled_from([*BUCKETS, -1, 0.5, 1e9, math.inf]),
                st.floats(-10, 300, allow_nan=False),
            ),
            max_size=30,
        ),
        max_size=5,
    )
)
def test_same_series_as_a_histogram(batches):
    ref_reg, new_reg = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("h", "doc", buckets=BUCKETS, registry=ref_reg)
    new = BatchHistogram("h", "doc", BUCKETS, new_reg)
    for batch in batches:
        for v in batch:
            ref.observe(v)
        new.observe_many(batch)
    got, want = series(new_reg, "h"), series(ref_reg, "h")
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key


def test_a_value_on_a_bound_counts_in_that_bucket():
    reg = CollectorRegistry()
    h = BatchHistogram("h", "doc", BUCKETS, reg)
    h.observe_many([2, 2.0000001, 0])
    h.observe(128)
    assert reg.get_sample_value("h_bucket", {"le": "0.0"}) == 1
    assert reg.get_sample_value("h_bucket", {"le": "2.0"}) == 2
    assert reg.get_sample_value("h_bucket", {"le": "4.0"}) == 3
    assert reg.get_sample_value("h_bucket", {"le": "+Inf"}) == 4
    assert reg.get_sample_value("h_count") == 4
    assert reg.get_sample_value("h_sum") == pytest.approx(132.0000001)


def test_bad_buckets_and_nan_are_refused_and_change_nothing():
    reg = CollectorRegistry()
    with pytest.raises(ValueError, match="increasing"):
        BatchHistogram("bad", "doc", (2, 1), reg)
    with pytest.raises(ValueError, match="increasing"):
        BatchHistogram("bad", "doc", (), reg)
    h = BatchHistogram("h", "doc", BUCKETS, reg)
    h.observe_many([1, 2])
    with pytest.raises(ValueError, match="NaN"):
        h.observe_many([3, float("nan")])
    assert reg.get_sample_value("h_count") == 2


def test_threads_lose_no_counts():
    reg = CollectorRegistry()
    h = BatchHistogram("h", "doc", BUCKETS, reg)
    values = np.arange(100) % 9

    def work():
        for _ in range(200):
            h.observe_many(values)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.get_sample_value("h_count") == 4 * 200 * 100
    assert reg.get_sample_value("h_sum") == 4 * 200 * values.sum()


def test_buffer_metrics_take_generators_and_count_samples():
    m = BufferMetrics()
    m.observe_sample(0.01, 0.0, (s for s in [0, 1, 3]), iter([1, 1, 5]))
    r = m.registry
    assert r.get_sample_value("reval_buffer_samples_total") == 3
    assert r.get_sample_value("reval_buffer_staleness_bucket", {"le": "1.0"}) == 2
    assert r.get_sample_value("reval_buffer_reuse_count_bucket", {"le": "4.0"}) == 2
    assert r.get_sample_value("reval_buffer_reuse_count_sum") == 7
