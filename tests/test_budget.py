"""Budget tests: capacity parity and the dense offload order
(docs/architecture.md#hot-neuron-capacity, docs/architecture.md#dense-offload-order)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerpy.config import ModelArgs
from powerpy.formats.constants import GGMLType, row_bytes
from powerpy.formats.gguf_reader import read_gguf
from powerpy.placement.budget import (
    ATTN,
    FFN,
    FFN_NORM,
    GIB,
    HOST,
    KV_K,
    KV_V,
    OUTPUT,
    PREDICTOR,
    FfnLayout,
    budget_bytes,
    capacity_exact,
    capacity_upstream,
    classify_tensor,
    hot_capacity,
    kv_cache_bytes,
    plan_offload,
)
from powerpy.placement.placement import Placement
from solver import solve

R = 13_357_166_592  # upstream's worked example (docs/architecture.md#hot-neuron-capacity)


def exact_neuron_bytes(n_embd: int, ggml_type: GGMLType, gate: bool) -> int:
    """The true size of a neuron: ``n_mats · row_bytes(n_embd, type)``."""
    return (3 if gate else 2) * row_bytes(n_embd, ggml_type)


# --- capacity -------------------------------------------------------------------------------------
def test_upstream_worked_example() -> None:
    # 13B, F16, gated: slice 27648, per slice 124416, 107358 * 4
    assert 13824 * 2 == 27648 and int(27648 * 4.5) == 124416
    assert capacity_upstream(R, 13824, GGMLType.F16, has_gate=True) == 429432 == 107358 * 4


@pytest.mark.parametrize(
    ("n_embd", "n_ff", "ggml_type", "gate", "upstream", "exact"),
    [
        (4096, 11008, GGMLType.F16, True, 539288, 543504),  # ReluLLaMA-7B
        (5120, 13824, GGMLType.F16, True, 429432, 434803),  # ReluLLaMA-13B
        (8192, 28672, GGMLType.F16, True, 207048, 271752),  # ReluLLaMA-70B
        (4096, 14336, GGMLType.F16, True, 414096, 543504),  # Bamboo-7B
        (8192, 32768, GGMLType.F16, False, 407628, 407628),  # ReluFalcon-40B
        (5120, 13824, GGMLType.Q4_0, True, 1526880, 1545968),  # 13B Q4_0
    ],
)
def test_capacity_table(
    n_embd: int, n_ff: int, ggml_type: GGMLType, gate: bool, upstream: int, exact: int
) -> None:
    assert capacity_upstream(R, n_ff, ggml_type, has_gate=gate) == upstream
    per_neuron = exact_neuron_bytes(n_embd, ggml_type, gate)
    assert capacity_exact(R, per_neuron) == exact
    ffn = FfnLayout(n_ff, (per_neuron,) * 40, gate, ggml_type)
    assert hot_capacity(R, ffn, "upstream") == upstream
    assert hot_capacity(R, ffn) == exact


def test_solver_floors_capacity_to_whole_groups() -> None:
    stats = [np.ones(13824) for _ in range(40)]
    r = solve(stats, 429432, batch=256)
    assert r.cap_groups == 1677 and r.counts.sum() == 429312


def test_capacity_edge_cases() -> None:
    assert capacity_exact(-5, 384) == 0
    assert capacity_upstream(-5, 512, GGMLType.F16, has_gate=True) == 0
    with pytest.raises(ValueError, match="bytes per neuron"):
        capacity_exact(100, 0)
    ffn = FfnLayout(512, (384,), True, GGMLType.F16)
    with pytest.raises(ValueError, match="capacity mode"):
        hot_capacity(100, ffn, "fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the FFN type"):
        hot_capacity(100, FfnLayout(512, (384,), True), "upstream")


def test_budget_bytes() -> None:
    assert budget_bytes(1.5) == 3 * GIB // 2
    assert budget_bytes(0) == 0
    assert budget_bytes(-1, free_vram=8 * GIB) == 8 * GIB - 256 * 2**20
    assert budget_bytes(-1, free_vram=100) == 0
    assert budget_bytes(-1, 8 * GIB) == 8 * GIB - 256 * 2**20  # free_vram may be positional
    assert budget_bytes(3.0, None) == 3 * GIB
    with pytest.raises(ValueError, match="all free VRAM"):
        budget_bytes(-1)
    with pytest.raises(ValueError, match="finite"):
        budget_bytes(float("nan"))


def test_kv_cache_bytes() -> None:
    # 70B: n_embd_gqa 1024, 80 layers, ctx 2048, f16 -> 320 MiB per cache
    assert kv_cache_bytes(1024, 80, 2048) == 320 * 2**20
    assert kv_cache_bytes(1024, 80, 2048, 4) == 640 * 2**20


# --- classification and order ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("blk.3.attn_norm.weight", ATTN),
        ("blk.3.attn_norm_2.bias", ATTN),
        ("blk.3.attn_qkv.weight", ATTN),
        ("blk.3.attn_output.bias", ATTN),
        ("blk.3.fc1.weight", PREDICTOR),
        ("blk.3.fc2.weight", PREDICTOR),
        ("blk.3.ffn_norm.weight", FFN_NORM),
        ("blk.3.ffn_up.weight", FFN),
        ("blk.3.ffn_down_t.bias", FFN),
        ("output_norm.bias", OUTPUT),
        ("output.weight", OUTPUT),
        ("token_embd.weight", HOST),
        ("position_embd.weight", HOST),
        ("rope_freqs.weight", HOST),
        ("blk.3.mystery.weight", HOST),
    ],
)
def test_classify_tensor(name: str, category: str) -> None:
    assert classify_tensor(name)[0] == category


def llama_tensors(n_layer: int, sizes: dict[str, int]) -> list[tuple[str, int]]:
    """Names in a converter's file order: predictors first (hf converter), then the model."""
    out = [(f"blk.{i}.{k}.weight", sizes[k]) for i in range(n_layer) for k in ("fc1", "fc2")]
    out += [("token_embd.weight", sizes["token_embd"])]
    for i in range(n_layer):
        for k in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"):
            out.append((f"blk.{i}.{k}.weight", sizes[k]))
        for k in ("ffn_gate", "ffn_up", "ffn_down_t"):
            out.append((f"blk.{i}.{k}.weight", sizes["ffn"]))
    out += [("output.weight", sizes["output"]), ("output_norm.weight", sizes["output_norm"])]
    return out


SIZES = {
    "fc1": 20,
    "fc2": 30,
    "token_embd": 1000,
    "attn_norm": 1,
    "attn_q": 10,
    "attn_k": 5,
    "attn_v": 5,
    "attn_output": 10,
    "ffn_norm": 1,
    "ffn": 500,
    "output": 40,
    "output_norm": 1,
}


def test_offload_order() -> None:
    plan = plan_offload(
        llama_tensors(2, SIZES), budget=10_000, n_layer=2, n_embd_gqa=4, n_ctx=8, kv_elem_bytes=2
    )
    names = [e.name for e in plan.entries]
    attn = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output"]
    expected = [f"blk.{i}.{k}.weight" for i in range(2) for k in attn]
    expected += [f"blk.{i}.{k}.weight" for i in range(2) for k in ("fc1", "fc2")]
    expected += ["blk.0.ffn_norm.weight", "blk.1.ffn_norm.weight"]
    expected += ["output_norm.weight", "output.weight", KV_V, KV_K]
    assert names == expected
    assert plan.dense_complete and plan.kv_on_gpu and all(e.on_gpu for e in plan.entries)
    assert plan.host_only == ("token_embd.weight",)
    assert plan.bytes_by_category[KV_V] == plan.bytes_by_category[KV_K] == 4 * 2 * 8 * 2
    dense = 2 * (31 + 50 + 1) + 41
    assert plan.remaining == 10_000 - dense - 2 * 128
    assert plan.split_budget == plan.remaining


def test_offload_stops_at_first_tensor_that_does_not_fit() -> None:
    sizes = dict(SIZES, fc1=200)  # blk.0.fc1 does not fit; smaller tensors after it would
    budget = 2 * 31 + 150
    plan = plan_offload(
        llama_tensors(2, sizes), budget=budget, n_layer=2, n_embd_gqa=4, n_ctx=8, kv_elem_bytes=2
    )
    assert plan.stopped_at is not None and plan.stopped_at.name == "blk.0.fc1.weight"
    on = [e.name for e in plan.entries if e.on_gpu]
    assert on == [e.name for e in plan.entries[: len(on)]]  # a prefix of the order
    assert all(e.category == ATTN for e in plan.entries if e.on_gpu)
    assert not plan.dense_complete and not plan.kv_on_gpu
    assert plan.remaining == 150 and plan.split_budget == 0
    assert plan.stop_message is not None
    assert "stopped at blk.0.fc1.weight" in plan.stop_message
    assert "dense tensors do not all fit" in plan.stop_message


def test_kv_only_when_all_dense_fit() -> None:
    dense = 2 * (31 + 50 + 1) + 41
    kv = 4 * 2 * 8 * 2
    args = dict(n_layer=2, n_embd_gqa=4, n_ctx=8, kv_elem_bytes=2)
    plan = plan_offload(llama_tensors(2, SIZES), budget=dense + kv + kv - 1, **args)
    assert plan.dense_complete
    assert [e.on_gpu for e in plan.entries[-2:]] == [True, False]  # V first, K did not fit
    assert plan.split_budget == kv - 1
    assert "the V cache fit but the K cache did not" in (plan.stop_message or "")
    plan = plan_offload(llama_tensors(2, SIZES), budget=dense - 1, **args)
    assert not plan.dense_complete
    assert plan.bytes_by_category[KV_V] == plan.bytes_by_category[KV_K] == 0


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200), min_size=12, max_size=12),
    n_layer=st.integers(1, 4),
    budget=st.integers(0, 3000),
    n_ctx=st.integers(0, 64),
)
def test_budget_is_never_exceeded(sizes: list[int], n_layer: int, budget: int, n_ctx: int) -> None:
    plan = plan_offload(
        llama_tensors(n_layer, dict(zip(SIZES, sizes, strict=True))),
        budget=budget,
        n_layer=n_layer,
        n_embd_gqa=2,
        n_ctx=n_ctx,
    )
    placed = sum(e.nbytes for e in plan.entries if e.on_gpu)
    assert placed == plan.used == sum(plan.bytes_by_category.values()) <= budget
    assert plan.remaining == budget - placed >= 0
    flags = [e.on_gpu for e in plan.entries]
    assert flags == sorted(flags, reverse=True)  # on-GPU entries form a prefix
    if plan.stopped_at is not None:
        # the first refusal really did not fit in what was left at that point
        before = sum(e.nbytes for e in plan.entries[: flags.index(False)])
        assert plan.stopped_at.nbytes > budget - before
    if not plan.dense_complete:
        assert not any(e.on_gpu for e in plan.entries if e.category in (KV_V, KV_K))
        assert plan.split_budget == 0


# --- from a model file ----------------------------------------------------------------------------
def test_header_layout_and_plan_from_file(pwri_test_model) -> None:
    model = pwri_test_model(n_layer=3, n_embd=64, n_ff=512, n_head=4, n_head_kv=2)
    with read_gguf(model) as f:
        args = ModelArgs.from_gguf(f)
        assert (args.n_layer, args.n_embd, args.n_ff, args.n_embd_gqa) == (3, 64, 512, 32)
        ffn = FfnLayout.from_gguf(f, args)
        assert ffn.has_gate and ffn.up_type is GGMLType.F16 and ffn.n_ff == 512
        assert ffn.neuron_bytes == (384,) * 3 == (exact_neuron_bytes(64, GGMLType.F16, True),) * 3
        plan = Placement.for_model(f, 1 << 30, n_ctx=100, kv_elem_bytes=4).plan
        assert (plan.n_ctx, plan.kv_elem_bytes) == (100, 4)
        assert plan.bytes_by_category[KV_K] == kv_cache_bytes(32, 3, 100, 4)
        per_layer_attn = 64 * 4 + (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64) * 2
        assert plan.bytes_by_category[ATTN] == 3 * per_layer_attn
        assert plan.bytes_by_category[PREDICTOR] == 3 * (16 * 64 + 512 * 16) * 2
        assert "token_embd.weight" in plan.host_only
        assert not any(e.category == FFN for e in plan.entries)


def test_ffn_layout_errors(pwri_test_model) -> None:
    sizes = {"blk.0.ffn_up.weight": 512 * 128, "blk.0.ffn_down_t.weight": 512 * 128}
    ungated = FfnLayout.from_sizes(sizes, 1, 512)
    assert ungated.neuron_bytes == (256,) and not ungated.has_gate and ungated.up_type is None
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' is missing"):
        FfnLayout.from_sizes(sizes, 2, 512)
    with pytest.raises(ValueError, match="not a multiple of n_ff 500"):
        FfnLayout.from_sizes(sizes, 1, 500)
    model = pwri_test_model(n_ff=512)
    with read_gguf(model) as f:
        args = ModelArgs.from_gguf(f)
        with pytest.raises(ValueError, match=r"ffn_gate.weight has shape \(512, 64\), expected"):
            FfnLayout.from_gguf(f, dataclasses.replace(args, n_ff=256))
