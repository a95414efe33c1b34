"""`powerpy convert` and the default-model builder, on tiny checkpoints built here.

The logits check compares the converted file (ggml interleaved RoPE after the q/k permute)
against an independent float64 numpy forward written in the HF convention (rotate-half RoPE on
the unpermuted HF weights), which is the oracle of spec §13(i).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from powerpy import models
from powerpy.cli import main
from powerpy.constants import GGMLType, GGUFValueType, Keys, Names
from powerpy.convert import convert, permute_qk, unpermute_qk
from powerpy.gguf_io import read_gguf
from powerpy.tiny import TinySpec, write_tiny_model

D, FF, L, NH, NKV, H = 64, 128, 2, 4, 2, 16
N_VOCAB = 259  # the tiny byte vocabulary of powerpy.tiny
HD = D // NH


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: OpenMP synchronisation costs more than it saves on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---------------------------------------------------------------- fixtures
def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named LLaMA weights (HF shapes, rotate-half q/k order)."""
    rng = np.random.default_rng(seed)

    def mat(r: int, c: int) -> np.ndarray:
        return (rng.standard_normal((r, c)) / math.sqrt(c)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(N_VOCAB, D), "model.norm.weight": norm()}
    for l in range(L):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = mat(D, D)
        t[p + "self_attn.k_proj.weight"] = mat(HD * NKV, D)
        t[p + "self_attn.v_proj.weight"] = mat(HD * NKV, D)
        t[p + "self_attn.o_proj.weight"] = mat(D, D)
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "mlp.gate_proj.weight"] = mat(FF, D)
        t[p + "mlp.up_proj.weight"] = mat(FF, D)
        t[p + "mlp.down_proj.weight"] = mat(D, FF)
    t["lm_head.weight"] = mat(N_VOCAB, D)
    return t


def write_hf(
    d: Path, t: dict[str, np.ndarray], *, act: str = "relu", shards: int = 1, dtype=torch.float32
) -> Path:
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "model_type": "llama",
        "hidden_size": D,
        "intermediate_size": FF,
        "num_hidden_layers": L,
        "num_attention_heads": NH,
        "num_key_value_heads": NKV,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": N_VOCAB,
        "hidden_act": act,
        "tie_word_embeddings": False,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    names = list(t)
    if shards == 1:
        save_file({k: torch.from_numpy(v).to(dtype) for k, v in t.items()}, d / "model.safetensors")
        return d
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: torch.from_numpy(t[k]).to(dtype) for k in part}, d / fname)
        weight_map.update(dict.fromkeys(part, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d


def write_predictors(
    d: Path, *, n_layer: int = L, hidden: int = H, config: dict | None = None, seed: int = 1
) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for l in range(n_layer):
        sd = {
            "fc1.weight": torch.randn(hidden, D, generator=g).half(),
            "fc2.weight": torch.randn(FF, hidden, generator=g).half(),
        }
        torch.save(sd, d / f"model_{l}.pt")
        out[l] = sd
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def vocab_gguf(tmp_path_factory) -> Path:
    """A tiny dense GGUF whose byte vocabulary the HF conversions copy."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    write_tiny_model(
        path, TinySpec(n_embd=D, n_ff=FF, n_layer=L, n_head=NH, n_head_kv=NKV), sparse=False
    )
    return path


# ---------------------------------------------------------------- independent reference
def hf_reference_logits(t: dict[str, np.ndarray], tokens: list[int], act: str) -> np.ndarray:
    """Float64 forward in the HF convention: rotate-half RoPE on unpermuted q/k."""
    n = len(tokens)
    g = {k: v.astype(np.float64) for k, v in t.items()}

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w

    inv = 10000.0 ** (-np.arange(0, HD, 2) / HD)
    ang = np.arange(n)[:, None] * inv[None]  # (n, HD/2)
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]  # (n, 1, HD)
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]

    def rope(x):  # (n, heads, HD), rotate_half
        rot = np.concatenate([-x[..., HD // 2 :], x[..., : HD // 2]], -1)
        return x * cos + rot * sin

    x = g["model.embed_tokens.weight"][tokens]
    for l in range(L):
        p = f"model.layers.{l}."
        h = rms(x, g[p + "input_layernorm.weight"])
        q = rope((h @ g[p + "self_attn.q_proj.weight"].T).reshape(n, NH, HD))
        k = rope((h @ g[p + "self_attn.k_proj.weight"].T).reshape(n, NKV, HD))
        v = (h @ g[p + "self_attn.v_proj.weight"].T).reshape(n, NKV, HD)
        att = np.zeros((n, NH, HD))
        for head in range(NH):
            kv = head // (NH // NKV)
            s = q[:, head] @ k[:, kv].T / math.sqrt(HD)
            s[np.triu_indices(n, 1)] = -np.inf
            pr = np.exp(s - s.max(-1, keepdims=True))
            att[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + att.reshape(n, D) @ g[p + "self_attn.o_proj.weight"].T
        h = rms(x, g[p + "post_attention_layernorm.weight"])
        gate, up = h @ g[p + "mlp.gate_proj.weight"].T, h @ g[p + "mlp.up_proj.weight"].T
        a = np.maximum(gate, 0) if act == "relu" else gate / (1 + np.exp(-gate))
        x = x + (a * up) @ g[p + "mlp.down_proj.weight"].T
    return rms(x, g["model.norm.weight"]) @ g["lm_head.weight"].T


def dense_logits(path: Path, tokens: list[int]) -> np.ndarray:
    from powerpy.api import load

    llm = load(path, weight_format="f32")
    llm.model.sparse_enabled = False
    out = llm.logits(tokens).numpy()
    llm.file.close()
    return out


TOKENS = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 7, 200, 45]


# ---------------------------------------------------------------- tests
def test_permute_is_interleave_of_halves() -> None:
    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of 8 rows
    p = permute_qk(w, 2)
    for head in range(2):
        for m in range(4):
            np.testing.assert_array_equal(p[head * 8 + 2 * m], w[head * 8 + m])
            np.testing.assert_array_equal(p[head * 8 + 2 * m + 1], w[head * 8 + m + 4])
    np.testing.assert_array_equal(unpermute_qk(p, 2), w)


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_hf_logits_match_rotate_half_reference(tmp_path, vocab_gguf, act) -> None:
    t = hf_tensors()
    src = write_hf(tmp_path / "hf", t, act=act)
    cfg = {"sparse_activation": "silu"} if act == "silu" else None
    write_predictors(tmp_path / "pred", config=cfg)
    out = convert(
        src, tmp_path / "pred", tmp_path / "m.powerinfer.gguf", outtype="f32", vocab_gguf=vocab_gguf
    )
    got = dense_logits(out, TOKENS)
    want = hf_reference_logits(t, TOKENS, act)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with read_gguf(out) as gf:
        assert gf.sparse
        assert (gf.kv.get(Keys.SPARSE_ACTIVATION) == "silu") == (act == "silu")


def test_layout_down_t_predictors_and_threshold_key(tmp_path, vocab_gguf) -> None:
    t = hf_tensors()
    src = write_hf(tmp_path / "hf", t, shards=3, dtype=torch.bfloat16)  # sharded BF16
    preds = write_predictors(tmp_path / "p1")
    out = convert(src, tmp_path / "p1", tmp_path / "a.gguf", outtype="f32", vocab_gguf=vocab_gguf)
    bf = {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in t.items()}
    with read_gguf(out) as gf:
        assert Keys.SPARSE_THRESHOLD not in gf.kv
        for l in range(L):
            down_t = gf.array(Names.FFN_DOWN_T.format(l=l))
            np.testing.assert_array_equal(down_t, bf[f"model.layers.{l}.mlp.down_proj.weight"].T)
            assert Names.FFN_DOWN.format(l=l) not in gf.tensors
            fc1, fc2 = gf.array(Names.FC1.format(l=l)), gf.array(Names.FC2.format(l=l))
            np.testing.assert_array_equal(fc1, preds[l]["fc1.weight"].float().numpy())
            np.testing.assert_array_equal(fc2, preds[l]["fc2.weight"].float().numpy())
            q = gf.array(Names.ATTN_Q.format(l=l))
            np.testing.assert_array_equal(
                unpermute_qk(q, NH), bf[f"model.layers.{l}.self_attn.q_proj.weight"]
            )
        names = list(gf.tensors)
        assert names[-1] == Names.FC2.format(l=L - 1)  # model tensors first, then predictors

    write_predictors(tmp_path / "p2", config={"sparse_threshold": -0.5})
    out2 = convert(src, tmp_path / "p2", tmp_path / "b.gguf", vocab_gguf=vocab_gguf)  # f16
    with read_gguf(out2) as gf:
        assert gf.kv[Keys.SPARSE_THRESHOLD] == pytest.approx(-0.5)
        assert gf.kv_types[Keys.SPARSE_THRESHOLD] is GGUFValueType.FLOAT32
        types = {n: i.ggml_type for n, i in gf.tensors.items()}
    assert types[Names.FC1.format(l=0)] is GGMLType.F16
    assert types[Names.FFN_DOWN_T.format(l=1)] is GGMLType.F16
    assert types[Names.ATTN_NORM.format(l=0)] is GGMLType.F32


def test_gguf_source_transposes_down_and_keeps_logits(tmp_path) -> None:
    spec = TinySpec(n_embd=D, n_ff=FF, n_layer=L, n_head=NH, n_head_kv=NKV)
    src = tmp_path / "dense.gguf"
    tensors = write_tiny_model(src, spec, sparse=False)
    write_predictors(
        tmp_path / "pred", config={"sparse_threshold": 0.0, "sparse_activation": "silu"}
    )
    out = tmp_path / "sparse.powerinfer.gguf"
    assert (
        main(["convert", str(src), str(tmp_path / "pred"), "-o", str(out), "--outtype", "f32"]) == 0
    )
    with read_gguf(out) as gf:
        np.testing.assert_array_equal(
            gf.array(Names.FFN_DOWN_T.format(l=1)), tensors[Names.FFN_DOWN.format(l=1)].T
        )
        assert gf.kv[Keys.TOKENS] == read_gguf(src).kv[Keys.TOKENS]
    np.testing.assert_allclose(dense_logits(out, TOKENS), dense_logits(src, TOKENS), atol=1e-5)


def test_quantized_outtype_loads(tmp_path) -> None:
    spec = TinySpec(n_embd=D, n_ff=FF, n_layer=L, n_head=NH, n_head_kv=NKV)
    src = tmp_path / "dense.gguf"
    write_tiny_model(src, spec, sparse=False)
    write_predictors(tmp_path / "pred", hidden=20)  # fc2 rows of 20: not Q8_0 blocks -> F16
    out = convert(src, tmp_path / "pred", tmp_path / "q.gguf", outtype="q8_0")
    with read_gguf(out) as gf:
        assert gf.tensors[Names.FFN_GATE.format(l=0)].ggml_type is GGMLType.Q8_0
        assert gf.tensors[Names.FC2.format(l=0)].ggml_type is GGMLType.F16
        assert gf.kv[Keys.FILE_TYPE] == 7
    assert np.isfinite(dense_logits(out, TOKENS)).all()


def test_unsafe_pickle_is_refused(tmp_path, vocab_gguf) -> None:
    src = write_hf(tmp_path / "hf", hf_tensors())
    write_predictors(tmp_path / "pred")
    bad = tmp_path / "pred" / "model_1.pt"
    torch.save({"fc1.weight": torch.zeros(H, D), "fc2.weight": os.getcwd}, bad)  # a callable
    with pytest.raises(ValueError, match=r"model_1\.pt: refused to load"):
        convert(src, tmp_path / "pred", tmp_path / "o.gguf", vocab_gguf=vocab_gguf)
    assert not (tmp_path / "o.gguf").exists()


def test_predictor_mismatch_errors_name_file_and_numbers(tmp_path, vocab_gguf) -> None:
    src = write_hf(tmp_path / "hf", hf_tensors())
    write_predictors(tmp_path / "few", n_layer=1)
    with pytest.raises(ValueError, match=r"found 1 predictors .* model has 2 layers"):
        convert(src, tmp_path / "few", tmp_path / "o.gguf", vocab_gguf=vocab_gguf)
    write_predictors(tmp_path / "shape")
    torch.save(
        {"fc1.weight": torch.zeros(H, D), "fc2.weight": torch.zeros(FF + 1, H)},
        tmp_path / "shape" / "model_1.pt",
    )
    with pytest.raises(ValueError, match=rf"model_1\.pt: fc2.weight has shape \({FF + 1}, {H}\)"):
        convert(src, tmp_path / "shape", tmp_path / "o.gguf", vocab_gguf=vocab_gguf)
    torch.save(
        {"fc1.weight": torch.zeros(H, D), "fc2.weight": torch.zeros(FF, H), "b": torch.ones(1)},
        tmp_path / "shape" / "model_1.pt",
    )
    with pytest.raises(ValueError, match=r"exactly fc1.weight and fc2.weight"):
        convert(src, tmp_path / "shape", tmp_path / "o.gguf", vocab_gguf=vocab_gguf)


def test_silu_model_needs_marker_and_input_is_never_overwritten(tmp_path, vocab_gguf) -> None:
    src = write_hf(tmp_path / "hf", hf_tensors(), act="silu")
    write_predictors(tmp_path / "pred")
    with pytest.raises(ValueError, match="sparse_activation"):
        convert(src, tmp_path / "pred", tmp_path / "o.gguf", vocab_gguf=vocab_gguf)
    with pytest.raises(ValueError, match="overwrite the input"):
        convert(vocab_gguf, tmp_path / "pred", vocab_gguf)
    with pytest.raises(ValueError, match="overwrite the input"):
        convert(src, tmp_path / "pred", src / "model.safetensors", vocab_gguf=vocab_gguf)
    with pytest.raises(FileNotFoundError, match="tokenizer"):  # no vocab anywhere
        convert(src, tmp_path / "pred", tmp_path / "o.gguf", activation="silu")


# ---------------------------------------------------------------- default-model builder
def test_default_model_builds_once_and_reuses_cache(tmp_path, monkeypatch, caplog) -> None:
    spec = TinySpec(n_embd=D, n_ff=FF, n_layer=L, n_head=NH, n_head_kv=NKV)
    src = tmp_path / "dense.gguf"
    write_tiny_model(src, spec, sparse=False)
    pred = tmp_path / "data"
    write_predictors(pred, config={"sparse_threshold": 0.0, "sparse_activation": "silu"})
    from powerpy.stats import save_activation_stats

    save_activation_stats(pred / "activation", [np.arange(FF)] * L)
    monkeypatch.setattr(models, "smollm2_path", lambda: src)
    monkeypatch.setattr(models, "SPARSE_DATA_DIR", pred)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    import powerpy.convert as conv

    real = conv.convert
    monkeypatch.setattr(conv, "convert", lambda *a, **k: calls.append(a) or real(*a, **k))

    with caplog.at_level("INFO", logger="powerpy.models"):
        first = models.default_model_path()
    assert "building the sparse default model" in caplog.text
    assert first.is_file() and first.parent.parent == tmp_path / "cache" / "powerpy"
    assert (first.parent / "activation" / "activation_1.pt").is_file()
    assert models.default_model_path() == first and len(calls) == 1  # reused
    assert not [p for p in first.parent.parent.iterdir() if p.name.endswith(".tmp")]
    assert not [p for p in first.parent.parent.iterdir() if p.is_dir() and p.name.startswith(".")]

    from powerpy.api import load

    llm = load()  # the default model is the sparse one
    assert llm.model.sparse_enabled and llm.model.args.ffn_variant == "swiglu"
    llm.file.close()

    write_predictors(pred, config={"sparse_threshold": 0.0, "sparse_activation": "silu"}, seed=5)
    second = models.default_model_path()  # changed predictors: a new build
    assert second != first and second.is_file() and len(calls) == 2

    # a packed (int8) predictor set builds too, and gates almost like the fp16 one
    from powerpy.train import PACK_FILE, pack_predictors

    packed = tmp_path / "packed"
    packed.mkdir()
    pack_predictors(pred, packed / PACK_FILE)
    (packed / "config.json").write_text((pred / "config.json").read_text())
    monkeypatch.setattr(models, "SPARSE_DATA_DIR", packed)
    third = models.default_model_path()
    assert third.is_file() and len(calls) == 3
    with read_gguf(second) as a, read_gguf(third) as b:
        fc2a, fc2b = a.array(Names.FC2.format(l=1)), b.array(Names.FC2.format(l=1))
        np.testing.assert_allclose(fc2b, fc2a, atol=np.abs(fc2a).max() / 127)
        assert b.kv[Keys.SPARSE_ACTIVATION] == "silu"

    monkeypatch.setattr(models, "SPARSE_DATA_DIR", tmp_path / "missing")
    assert models.default_model_path() == models.smollm2_path()  # nothing shipped: dense
    broken = tmp_path / "broken"
    broken.mkdir()
    monkeypatch.setattr(models, "SPARSE_DATA_DIR", broken)
    with pytest.raises(ValueError, match="could not build the sparse default model"):
        models.default_model_path()
