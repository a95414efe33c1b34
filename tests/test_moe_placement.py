"""Hybrid placement of the DeepSeek-style mixtures (glm4moe, deepseek2): the dense pass places
the attention (DeepSeek-2's latent tensors and their cache of the latent), the routers with
their selection biases, the shared experts and the leading dense layers' FFN whole; the split
places the hottest experts' rows; llama.cpp's ``--cpu-moe``/``--n-cpu-moe`` place whole
experts by layer. Hybrid = CPU-only on the emulated device, and on fake CUDA tensors no host
sync or cross-device op (GPT-OSS's are in ``test_gptoss.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fake_cuda import FakeCuda, run_prefill_and_decode
from moe_files import DEEPSEEK, GLM, write_gguf_py

from powerpy.api import load
from powerpy.cli import main
from powerpy.errors import PlacementError
from powerpy.formats.constants import GGMLType, Names, bias_name
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gpuidx import GpuIndex
from powerpy.formats.stats import save_activation_stats
from powerpy.model.device import Accelerator
from powerpy.model.numerics import Numerics
from powerpy.model.options import RunOptions
from powerpy.placement.budget import PREDICTOR
from powerpy.placement.experts import cpu_moe_index
from powerpy.placement.placement import Placement
from powerpy.placement.runtime import build_hybrid
from powerpy.testing import TinySpec

SPECS = {"glm4moe": GLM, "deepseek2": DEEPSEEK}
TOKENS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111])
N_CTX = 32
EXACT = Numerics(quantized_activations=False)


def _run(model, opts) -> torch.Tensor:
    cache = model.new_cache(N_CTX, dtype=torch.float32)
    out = [model.forward(TOKENS[:6], cache, opts, all_logits=True)]
    out += [model.forward(TOKENS[i : i + 1], cache, opts) for i in range(6, len(TOKENS))]
    return torch.cat(out)


def _index(spec: TinySpec, hot: int = 100) -> GpuIndex:
    n = spec.n_expert * spec.n_ff_exp
    rng = np.random.default_rng(1)
    buckets = [np.sort(rng.choice(n, hot, replace=False)) for _ in range(spec.n_layer)]
    return GpuIndex.from_buckets(buckets, n, vram_capacity=0)


@pytest.fixture(scope="module", params=list(SPECS))
def model_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("place") / f"{request.param}.gguf"
    write_gguf_py(path, SPECS[request.param], GGMLType.Q8_0, seed=2)
    return request.param, path


def test_the_dense_pass_places_what_every_token_runs(model_file):
    arch, path = model_file
    llm = load(path)
    a = llm.model.args
    placement = Placement.for_model(llm.file, 1 << 30, _index(SPECS[arch]), n_ctx=N_CTX)
    placed = set(placement.gpu_tensors)
    dense_ffn = {n.format(l=0) for n in (Names.FFN_GATE, Names.FFN_UP, Names.FFN_DOWN)}
    assert dense_ffn <= placed  # the leading dense layer, whole
    shared = {n.format(l=1) for n in (Names.FFN_GATE_SHEXP, Names.FFN_UP_SHEXP)}
    assert shared | {Names.FFN_GATE_INP.format(l=2)} <= placed
    entries = {e.name: e for e in placement.plan.entries}
    for name in (Names.FFN_UP.format(l=0), Names.FFN_GATE_INP.format(l=1)):
        assert entries[name].category == PREDICTOR
    assert not any(n.startswith("blk.3.") for n in placed)  # glm4moe's NextN layer: not run
    assert placement.layers[0].k == 0 and placement.layers[1].k == 100  # no hot dense rows
    assert any("leading dense layers" in n for n in placement.notes)
    if arch == "deepseek2":  # the latent tensors; the cache holds (r + n_rot) keys a token
        latent = ("q_a", "q_b", "kv_a_mqa", "k_b", "v_b")
        assert {f"blk.1.attn_{t}.weight" for t in latent} <= placed
        assert placement.kv_bytes == a.n_layer * N_CTX * (64 + 16) * 2
    else:
        assert Names.EXP_PROBS_B.format(l=1) in placed
        assert placement.kv_bytes == 2 * a.n_layer * N_CTX * a.n_embd_gqa * 2


def test_hybrid_equals_cpu_only(model_file):
    """Emulated device: the dense layer's FFN and the latent attention on it, 100 hot expert
    neurons a layer; the same logits as CPU-only (f32 activations), and on fake CUDA tensors
    a prefill and decode steps run without a host sync."""
    arch, path = model_file
    llm = load(path)
    opts = RunOptions(numerics=EXACT)
    ref = _run(llm.model, opts)
    placement = Placement.for_model(
        llm.file, 1 << 30, _index(SPECS[arch]), n_ctx=N_CTX, kv_elem_bytes=4
    )
    rt = build_hybrid(llm.model, placement, Accelerator("cpu"), file=llm.file)
    assert not rt.skipped and rt.model.weights.blk[0].moe is None
    torch.testing.assert_close(_run(rt.model, opts), ref, rtol=0, atol=2e-3)
    if arch == "deepseek2":  # the original model's latent is untouched
        assert rt.model.weights.blk[1].mla is not llm.model.weights.blk[1].mla
    fake = build_hybrid(llm.model, placement, FakeCuda(), file=llm.file)
    assert fake.model.weights.blk[0].ffn_up.device.type == "cuda"
    logits = run_prefill_and_decode(fake.model, TOKENS, N_CTX, 6, 3, llm.options)
    assert logits.shape == (1, llm.model.args.n_vocab) and logits.device.type == "cpu"


def test_gen_gpuidx_places_the_hottest_experts_and_no_dense_row(tmp_path):
    path = tmp_path / "glm.gguf"
    write_gguf_py(path, GLM, GGMLType.Q8_0, seed=2)
    n = GLM.n_expert * GLM.n_ff_exp  # 256 expert neurons a layer
    counts = [np.repeat(np.arange(8)[::-1] * 100, 32) for _ in range(GLM.n_layer)]
    counts[0][:] = 1000  # the dense layer's (a profile writes zeros): never placed
    save_activation_stats(tmp_path / "activation", [torch.from_numpy(c) for c in counts])
    with read_gguf(path) as f:
        base = Placement.for_model(f, 1 << 40, n_ctx=64)
        fixed, neuron = base.plan.used, base.layers[1].neuron_bytes
    budget = fixed + 2 * 64 * neuron + 10
    out = tmp_path / "m.gpuidx"
    argv = [
        "gen-gpuidx",
        "-m",
        str(path),
        "--vram-budget",
        repr(budget / 2**30),
        "--ctx",
        "64",
        "--activation",
        str(tmp_path / "activation"),
        "--batch",
        "32",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    idx = GpuIndex.read(out, n_layer=GLM.n_layer, n_ff=n)
    assert len(idx.gpu_bucket[0]) == 0
    hot = np.concatenate(idx.gpu_bucket[1:])
    assert len(hot) == 128 and set(hot.tolist()) <= set(range(64))  # experts 0 and 1 whole


def test_n_cpu_moe_places_whole_experts_by_layer(model_file, tmp_path):
    arch, path = model_file
    llm = load(path)
    a = llm.model.args
    idx = cpu_moe_index(a, 2)
    assert [len(b) for b in idx.gpu_bucket] == [0, 0, a.ffn_neurons]
    assert [len(b) for b in cpu_moe_index(a, 0).gpu_bucket] == [0, 256, 256]  # dense layer 0
    assert not cpu_moe_index(a, a.n_layer).counts.any()  # --cpu-moe
    placed = load(path, vram_budget=1.0, device="cpu", n_ctx=N_CTX, n_cpu_moe=1)
    assert [lp.k for lp in placed.runtime.placement.layers] == [0, 256, 256]
    opts = RunOptions(numerics=EXACT)
    torch.testing.assert_close(_run(placed.model, opts), _run(llm.model, opts), rtol=0, atol=2e-3)
    with pytest.raises(PlacementError, match="--n-cpu-moe -1"):
        cpu_moe_index(a, -1)


def test_the_cli_takes_llama_cpps_moe_flags(tmp_path, capsys):
    path = tmp_path / "glm.gguf"
    write_gguf_py(path, GLM, GGMLType.Q8_0, seed=2)
    base = ["infer", "-m", str(path), "-p", "Hello", "-n", "4", "--temp", "0", "-t", "1"]
    assert main(base) == 0
    want = capsys.readouterr().out
    for flags in (["-cmoe"], ["--n-cpu-moe", "2"]):
        argv = [*base, *flags, "--vram-budget", "1", "--accel-device", "cpu"]
        assert main(argv) == 0
        got = capsys.readouterr()
        assert got.out == want and "hot" in got.err  # the placement summary


def test_the_moe_flags_refuse_a_model_without_experts(tmp_path, capsys):
    from powerpy.testing import write_tiny_model

    path = tmp_path / "dense.gguf"
    write_tiny_model(path, TinySpec(), sparse=True)
    argv = [
        "infer",
        "-m",
        str(path),
        "-p",
        "Hi",
        "-n",
        "1",
        "--n-cpu-moe",
        "1",
        "--vram-budget",
        "1",
        "--accel-device",
        "cpu",
    ]
    assert main(argv) != 0
    assert "has none; place it with --vram-budget alone" in capsys.readouterr().err


def test_the_routing_biases_count_with_the_router(model_file):
    arch, path = model_file
    with read_gguf(path) as f:
        p = Placement.for_model(f, 1 << 30, n_ctx=N_CTX)
        sizes = {t.name: t.nbytes for t in f.tensors.values()}
    routing = [n for n in sizes if ("ffn_gate_inp" in n or "exp_probs_b" in n) and "blk.3" not in n]
    assert routing and all(n in p.gpu_tensors for n in routing)
    if arch == "glm4moe":
        assert bias_name(Names.FFN_GATE_INP.format(l=1)) not in sizes  # none in glm4moe
