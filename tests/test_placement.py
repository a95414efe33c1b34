"""Placement as plain data: offload order, KV rule, hot-row budget, index lifecycle.

No torch devices here; the placement oracle of ``docs/architecture.md#tests``.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerpy.formats.constants import Names
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gpuidx import GpuIndex, default_gpuidx_path
from powerpy.placement.budget import ATTN, DENSE_LEVELS, FFN_NORM, kv_cache_bytes
from powerpy.placement.lifecycle import resolve_placement
from powerpy.placement.placement import HOT_FFN, KV, Placement

# write_pwri_test_model (conftest): 2 layers, n_embd 64, n_ff 512, GQA 32, F16 matrices
N_LAYER, N_FF, N_EMBD, GQA = 2, 512, 64, 32
NEURON_BYTES = 3 * N_EMBD * 2  # a gate, up and down_t row in F16
N_CTX = 256
KV_ONE = kv_cache_bytes(GQA, N_LAYER, N_CTX, 2)  # the V (or K) cache


@pytest.fixture
def model(pwri_test_model):
    with read_gguf(pwri_test_model()) as f:
        yield f


def dense_entries(p: Placement):
    return [e for e in p.plan.entries if e.category in DENSE_LEVELS]


def same_buckets(p: Placement, q: Placement) -> bool:
    pairs = zip(p.gpu_buckets(), q.gpu_buckets(), strict=True)
    return all(np.array_equal(a, b) for a, b in pairs)


def full_index(n_layer: int = N_LAYER, n_ff: int = N_FF, capacity: int = 0) -> GpuIndex:
    return GpuIndex.from_buckets([np.arange(n_ff)] * n_layer, n_ff, vram_capacity=capacity)


# --------------------------------------------------------------------------- offload order
def test_offload_stops_at_first_tensor_that_does_not_fit(model):
    entries = dense_entries(Placement.for_model(model, 0, n_ctx=N_CTX))
    assert entries[0].category == ATTN and entries[0].name == Names.ATTN_NORM.format(l=0)
    # stop at layer 0's attn_q (8 KiB) with 8 KiB - 1 left: the later tiny norms would fit
    i = next(j for j, e in enumerate(entries) if e.name == Names.ATTN_Q.format(l=0))
    budget = sum(e.nbytes for e in entries[:i]) + entries[i].nbytes - 1
    p = Placement.for_model(model, budget, full_index(), n_ctx=N_CTX)
    assert p.gpu_tensors == tuple(e.name for e in entries[:i])
    assert p.plan.stopped_at is not None and p.plan.stopped_at.name == entries[i].name
    later_small = [e for e in entries[i + 1 :] if e.nbytes < entries[i].nbytes]
    assert any(e.category == FFN_NORM for e in later_small)  # they would fit, but are not tried
    assert not set(p.gpu_tensors) & {e.name for e in later_small}
    assert not p.kv_on_gpu and p.n_hot == 0  # dense incomplete: no KV, split skipped
    assert p.empty_reason == p.plan.stop_message and "split is skipped" in p.empty_reason
    assert p.index is not None and p.index_capacity == 0
    assert p.used <= budget


def test_kv_on_accelerator_only_when_all_dense_fit(model):
    dense = sum(e.nbytes for e in dense_entries(Placement.for_model(model, 0, n_ctx=N_CTX)))
    cases = {
        dense + 2 * KV_ONE: True,
        dense + 2 * KV_ONE - 1: False,  # V fits, K does not: both stay on the host
        dense + KV_ONE - 1: False,
        dense - 1: False,
    }
    for budget, kv in cases.items():
        p = Placement.for_model(model, budget, n_ctx=N_CTX)
        assert p.kv_on_gpu is kv, budget
        assert p.bytes_by_category[KV] == (2 * KV_ONE if kv else 0)
        assert p.used <= budget
    p = Placement.for_model(model, dense + 2 * KV_ONE - 1, n_ctx=N_CTX)
    assert any("V cache fit but the K cache did not" in n for n in p.notes)
    assert any("V cache fit but the K cache did not" in n for n in p.summary().splitlines())
    assert len(p.gpu_tensors) == len(dense_entries(p))  # all dense placed


def test_hot_bytes_are_exact_rows_and_truncation_is_deterministic(model, caplog):
    dense = sum(e.nbytes for e in dense_entries(Placement.for_model(model, 0, n_ctx=N_CTX)))
    room = 300  # neurons that fit after dense + KV
    budget = dense + 2 * KV_ONE + room * NEURON_BYTES + NEURON_BYTES - 1
    rng = np.random.default_rng(0)
    stats = [rng.random(N_FF) for _ in range(N_LAYER)]
    with caplog.at_level(logging.WARNING, logger="powerpy.placement.split"):
        p = Placement.for_model(model, budget, full_index(), n_ctx=N_CTX, stats=stats)
    assert "truncated" in caplog.text
    assert p.n_hot == room and p.hot_bytes == room * NEURON_BYTES
    assert [lp.k for lp in p.layers] == [150, 150]
    assert p.used <= budget and p.remaining < NEURON_BYTES
    for lp, s in zip(p.layers, stats, strict=True):  # the hottest neurons survive
        assert np.array_equal(lp.gpu_bucket, np.sort(np.argsort(-s, kind="stable")[: lp.k]))
    again = Placement.for_model(model, budget, full_index(), n_ctx=N_CTX, stats=stats)
    assert same_buckets(p, again)
    lowest = Placement.for_model(model, budget, full_index(), n_ctx=N_CTX)  # no stats
    assert np.array_equal(lowest.layers[0].gpu_bucket, np.arange(150))


def test_index_that_fits_is_applied_unchanged(model):
    b0, b1 = np.arange(0, N_FF, 2), np.array([7])
    index = GpuIndex.from_buckets([b0, b1], N_FF, vram_capacity=12345)
    p = Placement.for_model(model, 1 << 30, index, n_ctx=N_CTX)
    assert np.array_equal(p.layers[0].gpu_bucket, b0) and np.array_equal(p.layers[1].gpu_bucket, b1)
    assert p.layers[0].share == 0.5 and p.layers[1].k == 1
    assert np.array_equal(p.layers[1].gpu_idx(), index.gpu_idx[1])
    assert p.bytes_by_category[HOT_FFN] == (N_FF // 2 + 1) * NEURON_BYTES
    assert p.index_capacity == 12345 and not p.notes


def test_index_must_match_the_model(model):
    with pytest.raises(ValueError, match="needs"):
        Placement.for_model(model, 1 << 30, full_index(n_layer=3), n_ctx=N_CTX)
    with pytest.raises(ValueError, match="n_ff"):
        Placement.for_model(model, 1 << 30, full_index(n_ff=256), n_ctx=N_CTX)


def layer_rows(text: str) -> dict[str, list[str]]:
    """The per-layer table of a summary: first column (layer or "total") -> the row's fields."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "GPU % of neurons" in line)
    rows = {}
    for line in lines[start + 1 :]:
        fields = line.split()
        if not fields or not (fields[0].isdigit() or fields[0] == "total"):
            break
        rows[fields[0]] = fields[1:]
    return rows


def test_summary_table(model):
    index = GpuIndex.from_buckets([np.arange(128), []], N_FF, vram_capacity=0)
    text = Placement.for_model(model, 1 << 30, index, n_ctx=N_CTX).summary("cuda:0")
    for word in ("placement on cuda:0", "attn", "predictor", "ffn_norm", "output", "kv", "hot_ffn"):
        assert word in text
    assert "128/1024 neurons" in text
    rows = layer_rows(text)  # hot, GPU %, bytes, coverage ("-": no statistics)
    assert rows == {
        "0": ["128", "25.0%", str(128 * NEURON_BYTES), "-"],
        "1": ["0", "0.0%", "0", "-"],
        "total": ["128", "12.5%", str(128 * NEURON_BYTES), "-"],
    }
    assert "empty placement" not in text


def test_summary_coverage_and_reasons(model):
    stats = [np.arange(N_FF, dtype=float), np.ones(N_FF)]
    index = GpuIndex.from_buckets([np.arange(N_FF // 2, N_FF), []], N_FF, vram_capacity=0)
    p = Placement.for_model(model, 1 << 30, index, n_ctx=N_CTX, stats=stats)
    top_half = sum(range(N_FF // 2, N_FF)) / sum(range(N_FF))
    assert p.coverage == pytest.approx((top_half, 0.0))
    assert p.total_coverage == pytest.approx(
        sum(range(N_FF // 2, N_FF)) / (sum(range(N_FF)) + N_FF)
    )
    rows = layer_rows(p.summary())
    assert rows["0"][-1] == f"{100 * top_half:.2f}%" and rows["1"][-1] == "0.00%"
    bare = Placement.for_model(model, 1 << 30, n_ctx=N_CTX)
    assert bare.empty_reason == "no GPU index" and "empty placement: no GPU index" in bare.summary()
    assert "GPU % of neurons" not in bare.summary()  # no index: no per-layer table
    again = bare.with_index(index)
    assert again.plan is bare.plan and again.n_hot == N_FF // 2 and again.empty_reason is None
    with pytest.raises(ValueError, match="layer 1 has shape"):
        bare.with_index(index, stats=[np.ones(N_FF), np.ones(3)])


# ----------------------------------------------------------------------------------- property
@st.composite
def models(draw):
    n_layer = draw(st.integers(1, 4))
    n_ff = draw(st.sampled_from([32, 64, 96]))
    row = draw(st.sampled_from([8, 64, 128]))  # bytes of one FFN row
    sizes = [("token_embd.weight", 4096)]
    for layer in range(n_layer):
        for template in (Names.ATTN_NORM, Names.ATTN_Q, Names.ATTN_K, Names.ATTN_V):
            sizes.append((template.format(l=layer), draw(st.integers(0, 5000))))
        sizes.append((Names.FFN_NORM.format(l=layer), draw(st.integers(0, 300))))
        for template in (Names.FFN_GATE, Names.FFN_UP, Names.FFN_DOWN_T):
            sizes.append((template.format(l=layer), n_ff * row))
        sizes.append((Names.FC1.format(l=layer), draw(st.integers(0, 3000))))
        sizes.append((Names.FC2.format(l=layer), draw(st.integers(0, 3000))))
    sizes += [(Names.OUTPUT_NORM, 256), (Names.OUTPUT, draw(st.integers(0, 8000)))]
    buckets = [
        np.flatnonzero(draw(st.lists(st.booleans(), min_size=n_ff, max_size=n_ff)))
        for _ in range(n_layer)
    ]
    total = sum(nb for _, nb in sizes)
    return n_layer, n_ff, row, sizes, buckets, total


@settings(max_examples=200, deadline=None)
@given(
    models(),
    st.floats(0.0, 1.3),
    st.sampled_from([1, 16, 64]),
    st.sampled_from([2, 4]),
    st.booleans(),
)
def test_placement_never_exceeds_budget(m, frac, n_ctx, kv_elem, with_stats):
    n_layer, n_ff, row, sizes, buckets, total = m
    budget = int(frac * total)
    index = GpuIndex.from_buckets(buckets, n_ff, vram_capacity=budget)
    stats = [np.arange(n_ff, dtype=float)[::-1] for _ in range(n_layer)] if with_stats else None
    p = Placement.from_tensors(
        sizes,
        n_layer=n_layer,
        n_ff=n_ff,
        n_embd_gqa=8,
        budget=budget,
        index=index,
        n_ctx=n_ctx,
        kv_elem_bytes=kv_elem,
        stats=stats,
    )
    assert 0 <= p.used <= budget and p.remaining == budget - p.used
    assert p.hot_bytes == p.n_hot * 3 * row
    if p.kv_on_gpu or p.n_hot:
        assert p.plan.dense_complete
    for lp, b in zip(p.layers, buckets, strict=True):
        assert set(lp.gpu_bucket) <= set(b)  # truncation only removes neurons
        assert np.all(np.diff(lp.gpu_bucket) > 0) and lp.gpu_bucket.dtype == np.int32
    if p.plan.dense_complete and sum(map(len, buckets)) * 3 * row <= p.plan.split_budget:
        assert p.n_hot == sum(map(len, buckets))  # nothing dropped when it fits
    elif p.plan.dense_complete:
        assert p.plan.split_budget - p.hot_bytes < 3 * row  # truncation fills the budget


# ------------------------------------------------------------------------- index lifecycle
@pytest.fixture
def model_with_stats(pwri_test_model):
    from powerpy.formats.stats import save_activation_stats

    path = pwri_test_model("m.powerinfer.gguf")
    rng = np.random.default_rng(1)
    save_activation_stats(path.parent / "activation", [rng.random(N_FF) for _ in range(N_LAYER)])
    return path


def test_resolve_generates_then_reuses(model_with_stats, caplog):
    idx_path = default_gpuidx_path(model_with_stats)
    budget = 1 << 20
    with read_gguf(model_with_stats) as f:
        p1 = resolve_placement(f, budget, n_ctx=N_CTX)
        assert idx_path.exists() and p1.n_hot > 0 and p1.used <= budget
        assert p1.solve is not None and p1.solve.method == "greedy" and p1.coverage is not None
        assert GpuIndex.read(idx_path) == p1.index
        first = idx_path.read_bytes()
        with caplog.at_level(logging.INFO):
            p2 = resolve_placement(f, 2 * budget, n_ctx=N_CTX)  # more room: reused, hinted
        assert "reset-gpu-index" in caplog.text
        assert idx_path.read_bytes() == first
        assert same_buckets(p1, p2)
        p3 = resolve_placement(f, 2 * budget, n_ctx=N_CTX, reset_gpu_index=True)
        assert idx_path.read_bytes() != first  # regenerated for the larger budget
        assert GpuIndex.read(idx_path).vram_capacity == p3.plan.split_budget


def test_resolve_disable_and_missing_activation(pwri_test_model, caplog):
    path = pwri_test_model("bare.powerinfer.gguf")
    with read_gguf(path) as f:
        p = resolve_placement(f, 1 << 20, n_ctx=N_CTX, disable_gpu_index=True)
        assert p.n_hot == 0 and p.kv_on_gpu and not default_gpuidx_path(path).exists()
        assert "--disable-gpu-index" in (p.empty_reason or "")
        with caplog.at_level(logging.ERROR):
            p = resolve_placement(f, 1 << 20, n_ctx=N_CTX)  # no activation/: not fatal
        assert "activation directory" in caplog.text and p.n_hot == 0
        assert "activation directory" in (p.empty_reason or "")
        assert not default_gpuidx_path(path).exists()


def test_resolve_refuses_dense_models(tmp_path):
    from powerpy.testing import TinySpec, write_tiny_model

    path = tmp_path / "dense.gguf"
    write_tiny_model(path, TinySpec(), sparse=False)
    with read_gguf(path) as f, pytest.raises(ValueError, match="PWRI"):
        resolve_placement(f, 1 << 20)
