"""`powerpy convert` and the default-model builder, on tiny checkpoints built here.

The logits check compares the converted file (ggml interleaved RoPE after the q/k permute)
against an independent float64 numpy forward written in the HF convention (rotate-half RoPE on
the unpermuted HF weights), which is the converter oracle of docs/architecture.md#tests.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from powerpy import default_model as models
from powerpy.cli import main
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, TokenType
from powerpy.formats.gguf_reader import read_gguf
from powerpy.pipeline.convert import convert, permute_qk, unpermute_qk
from powerpy.testing import TinySpec, write_tiny_model

D, FF, L, NH, NKV, H = 64, 128, 2, 4, 2, 16
N_VOCAB = 259  # the tiny byte vocabulary of powerpy.testing
HD = D // NH


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------- fixtures
def hf_tensors(seed: int = 0, n_vocab: int = N_VOCAB) -> dict[str, np.ndarray]:
    """Random HF-named LLaMA weights (HF shapes, rotate-half q/k order)."""
    rng = np.random.default_rng(seed)

    def mat(r: int, c: int) -> np.ndarray:
        return (rng.standard_normal((r, c)) / math.sqrt(c)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)

    t = {"model.embed_tokens.weight": mat(n_vocab, D), "model.norm.weight": norm()}
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
    t["lm_head.weight"] = mat(n_vocab, D)
    return t


def write_hf(
    d: Path,
    t: dict[str, np.ndarray],
    *,
    act: str = "relu",
    shards: int = 1,
    dtype=torch.float32,
    n_vocab: int = N_VOCAB,
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
        "vocab_size": n_vocab,
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

    llm = load(path, weight_format="f32", dense=True)
    out = llm.logits(tokens, cache_dtype=torch.float32).numpy()  # exact, as the references
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
    from powerpy.formats.stats import save_activation_stats

    save_activation_stats(pred / "activation", [np.arange(FF)] * L)
    monkeypatch.setattr(models, "smollm2_path", lambda: src)
    monkeypatch.setattr(models, "SPARSE_DATA_DIR", pred)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    import powerpy.pipeline.convert as conv

    real = conv.convert
    monkeypatch.setattr(conv, "convert", lambda *a, **k: calls.append(a) or real(*a, **k))

    with caplog.at_level("INFO", logger="powerpy.default_model"):
        first = models.default_model_path()
    assert "building the sparse default model" in caplog.text
    assert first.is_file() and first.parent.parent == tmp_path / "cache" / "powerpy"
    assert (first.parent / "activation" / "activation_1.pt").is_file()
    assert models.default_model_path() == first and len(calls) == 1  # reused
    (pred / "README.md").write_text("docs do not change the build")
    assert models.default_model_path() == first and len(calls) == 1
    assert not [p for p in first.parent.parent.iterdir() if p.name.endswith(".tmp")]
    assert not [p for p in first.parent.parent.iterdir() if p.is_dir() and p.name.startswith(".")]

    from powerpy.api import load

    llm = load()  # the default model is the sparse one
    assert llm.model.can_gate and llm.options.sparse and llm.model.args.ffn_variant == "swiglu"
    llm.file.close()

    write_predictors(pred, config={"sparse_threshold": 0.0, "sparse_activation": "silu"}, seed=5)
    second = models.default_model_path()  # changed predictors: a new build
    assert second != first and second.is_file() and len(calls) == 2

    # a packed (int8) predictor set builds too, and gates almost like the fp16 one
    from powerpy.pipeline.predictors import PACK_FILE, pack_predictors

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


# ---------------------------------------------------------------- vocabulary from the HF checkpoint
KJV_DIR = Path(__file__).resolve().parent.parent / "models" / "kjv-relu"
TOKENIZER_KEYS = (Keys.TOKENIZER_MODEL, Keys.TOKENS, Keys.TOKEN_TYPE, Keys.BOS_ID, Keys.EOS_ID)
NEW_BPE_KEYS = (Keys.UNK_ID, Keys.PAD_ID, Keys.CHAT_TEMPLATE)  # from tokenizer_config.json
BPE_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "1234567890 3.14159 2024-01-01 +42 -7",
    "   leading and   multiple   spaces  ",
    "line1\nline2\n\n\n\ttabbed\r\nend\n",
    "café naïve résumé Ångström Øre ß",
    "日本語のテキストと中文，한국어",
    "emoji 🙂👍🏽 🇫🇷 ❤️",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|endoftext|>",
    "don't can't I'm we'll THEY'RE",
    "def f(x):\n    return x**2  # code\n",
    "",
]


def hf_bpe_json(
    gguf_path: Path, *, merges_as_pairs: bool, specials_in_vocab: bool
) -> tuple[dict, dict]:
    """An HF ``tokenizer.json`` and ``tokenizer_config.json`` equivalent to a GGUF BPE vocabulary.

    The vocab object is written in a shuffled order (ids, not positions, must count); control
    tokens are listed as special ``added_tokens`` and, if ``specials_in_vocab`` (SmolLM2's
    layout; Llama-3's has them only in ``added_tokens``), in the model's vocab too. The
    tokenizer_config.json names unk/pad by text (both forms) and holds the GGUF's chat template.
    """
    with read_gguf(gguf_path) as gf:
        kv = gf.kv
        tokens, merges = list(kv[Keys.TOKENS]), list(kv[Keys.MERGES])
        types = [int(t) for t in kv[Keys.TOKEN_TYPE]]
        bos, eos, add_bos = int(kv[Keys.BOS_ID]), int(kv[Keys.EOS_ID]), bool(kv[Keys.ADD_BOS])
        unk, pad, template = int(kv[Keys.UNK_ID]), int(kv[Keys.PAD_ID]), kv[Keys.CHAT_TEMPLATE]
    order = np.random.default_rng(0).permutation(len(tokens))
    vocab = {tokens[i]: int(i) for i in order if specials_in_vocab or types[i] != TokenType.CONTROL}
    added = [
        {"id": i, "content": tok, "special": True, "normalized": False}
        for i, (tok, ty) in enumerate(zip(tokens, types, strict=True))
        if ty == TokenType.CONTROL
    ]
    tj = {
        "version": "1.0",
        "added_tokens": added,
        "model": {
            "type": "BPE",
            "vocab": vocab,
            "merges": [m.split(" ") for m in merges] if merges_as_pairs else merges,
        },
    }
    tc = {
        "bos_token": tokens[bos],
        "eos_token": {"__type": "AddedToken", "content": tokens[eos], "special": True},
        "unk_token": tokens[unk],
        "pad_token": {"content": tokens[pad], "special": True},
        "add_bos_token": add_bos,
        "chat_template": template,
    }
    return tj, tc


def test_bpe_tokenizer_json_tokenizes_like_the_original_gguf(tmp_path, smollm2_path) -> None:
    """tokenizer.json (BPE) + tokenizer_config.json -> the same tokenizer as SmolLM2's GGUF."""
    from powerpy.api import load
    from powerpy.pipeline.hf import vocab_kv_from_hf
    from powerpy.tokenizer import Tokenizer

    tj, tc = hf_bpe_json(smollm2_path, merges_as_pairs=True, specials_in_vocab=True)
    n_vocab = len(tj["model"]["vocab"])
    src = write_hf(tmp_path / "hf", hf_tensors(n_vocab=n_vocab), n_vocab=n_vocab)
    (src / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    write_predictors(tmp_path / "pred")
    out = convert(src, tmp_path / "pred", tmp_path / "bpe.powerinfer.gguf", vocab_pre="smollm")

    with read_gguf(smollm2_path) as want, read_gguf(out) as got:
        assert (want.kv[Keys.UNK_ID], want.kv[Keys.PAD_ID]) == (0, 2)
        assert want.kv[Keys.CHAT_TEMPLATE].startswith("{% for message in messages %}")
        for key in (*TOKENIZER_KEYS, Keys.MERGES, Keys.TOKENIZER_PRE, Keys.ADD_BOS, *NEW_BPE_KEYS):
            assert got.kv_types[key] is want.kv_types[key], key
            np.testing.assert_array_equal(np.asarray(got.kv[key]), np.asarray(want.kv[key]), key)
        assert got.kv[Keys.TOKENIZER_PRE] == "smollm"
        types = np.asarray(got.kv[Keys.TOKEN_TYPE])
        assert set(types.tolist()) == {TokenType.NORMAL, TokenType.CONTROL}

    # old merges form ("a b" strings), control tokens only in added_tokens: the same key/values
    tj2, _ = hf_bpe_json(smollm2_path, merges_as_pairs=False, specials_in_vocab=False)
    assert len(tj2["model"]["vocab"]) < n_vocab
    (src / "tokenizer.json").write_text(json.dumps(tj2, ensure_ascii=False), encoding="utf-8")
    kv2 = vocab_kv_from_hf(src, json.loads((src / "config.json").read_text()), "smollm")
    with read_gguf(out) as got:
        assert set(kv2) == {k for k in got.kv if k.startswith("tokenizer.")}
        for key, spec in kv2.items():
            assert spec[1] is got.kv_types[key], key
            np.testing.assert_array_equal(np.asarray(spec[0]), np.asarray(got.kv[key]), key)

    # no pad_token: config.json's pad_token_id (if in the vocabulary); a non-string template: none
    tc3 = {k: v for k, v in tc.items() if k != "pad_token"} | {"chat_template": [{"name": "x"}]}
    (src / "tokenizer_config.json").write_text(json.dumps(tc3))
    cfg = json.loads((src / "config.json").read_text())
    kv3 = vocab_kv_from_hf(src, cfg | {"pad_token_id": 5, "unk_token_id": 9}, "smollm")
    assert (kv3[Keys.PAD_ID], kv3[Keys.UNK_ID][0]) == ((5, GGUFValueType.UINT32), 0)
    assert Keys.CHAT_TEMPLATE not in kv3
    assert Keys.PAD_ID not in vocab_kv_from_hf(src, cfg | {"pad_token_id": n_vocab}, "smollm")

    ref = Tokenizer.from_gguf(smollm2_path)
    llm = load(out)
    try:
        tok = llm.tokenizer
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref.bos_id, ref.eos_id, ref.add_bos)
        assert tok.eog_ids == ref.eog_ids
        for text in BPE_TEXTS:
            ids = tok.encode(text)
            assert ids == ref.encode(text), text
            assert tok.decode(ids) == text
            assert tok.encode(text, parse_special=False) == ref.encode(text, parse_special=False)
        assert tok.encode("<|im_start|>")[0] == tok.bos_id  # control text parses to the token
    finally:
        llm.file.close()


def test_sentencepiece_tokenizer_model_matches_kjv_gguf_and_sentencepiece(tmp_path) -> None:
    """tokenizer.model -> the vocabulary models/kjv-relu's GGUF was built with."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from powerpy.tokenizer import Tokenizer

    spm_file, ref_gguf = KJV_DIR / "tokenizer.model", KJV_DIR / "kjv-relu.powerinfer.gguf"
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_file))
    n_vocab = sp.get_piece_size()
    assert n_vocab == 2048
    src = write_hf(tmp_path / "hf", hf_tensors(n_vocab=n_vocab), n_vocab=n_vocab)
    (src / "tokenizer.model").write_bytes(spm_file.read_bytes())
    write_predictors(tmp_path / "pred")
    out = convert(src, tmp_path / "pred", tmp_path / "spm.powerinfer.gguf", outtype="f32")

    with read_gguf(ref_gguf) as want, read_gguf(out) as got:
        assert got.kv[Keys.TOKENIZER_MODEL] == "llama"
        # no tokenizer_config.json: no add_bos/add_eos (the reference's come from its dense GGUF),
        # no pad (sentencepiece has none), every other key as in the reference
        keys = {k for k in got.kv if k.startswith("tokenizer.")}
        assert keys == {k for k in want.kv if k.startswith("tokenizer.")} - {
            Keys.ADD_BOS,
            Keys.ADD_EOS,
        }
        assert {*TOKENIZER_KEYS, Keys.SCORES, Keys.UNK_ID} <= keys and Keys.PAD_ID not in keys
        for key in keys:
            assert got.kv_types[key] is want.kv_types[key], key
            np.testing.assert_array_equal(np.asarray(got.kv[key]), np.asarray(want.kv[key]), key)
        # independent of sentencepiece_kv (which built the reference file): types by token text
        toks, types = got.kv[Keys.TOKENS], np.asarray(got.kv[Keys.TOKEN_TYPE])
        is_byte = [re.fullmatch(r"<0x[0-9A-F]{2}>", t) is not None for t in toks]
        np.testing.assert_array_equal(types == TokenType.BYTE, is_byte)
        assert [toks[i] for i in np.flatnonzero(types == TokenType.CONTROL)] == ["<s>", "</s>"]
        assert [toks[i] for i in np.flatnonzero(types == TokenType.UNKNOWN)] == ["<unk>"]
        assert toks[got.kv[Keys.BOS_ID]] == "<s>" and toks[got.kv[Keys.EOS_ID]] == "</s>"

    tok, ref = Tokenizer.from_gguf(out), Tokenizer.from_gguf(ref_gguf)
    assert (tok.add_bos, tok.add_eos, tok.add_space_prefix) == (
        ref.add_bos,
        ref.add_eos,
        ref.add_space_prefix,
    )
    for text in [
        "In the beginning God created the heaven and the earth.",
        "  two  spaces\nand a newline",
        "café ünïcode 日本 🙂",
        "12345 67, verse 3:16",
        " leading space and trailing ",
        "\n\nAnd it was so.\tEnd",
        "",
    ]:
        ids = tok.encode(text, add_bos=False)
        assert ids == sp.encode(text), text
        assert tok.encode(text) == [sp.bos_id(), *ids]
        assert tok.decode(ids) == sp.decode(ids) == text


def test_sentencepiece_added_tokens_flags_and_padded_vocab(tmp_path, caplog) -> None:
    """tokenizer_config.json flags, template and added tokens; vocab_size past the pieces pads."""
    pytest.importorskip("sentencepiece")
    from powerpy.tokenizer import Tokenizer

    n_pieces, n_vocab = 2048, 2056  # padded embeddings
    src = write_hf(tmp_path / "hf", hf_tensors(n_vocab=n_vocab), n_vocab=n_vocab)
    (src / "tokenizer.model").write_bytes((KJV_DIR / "tokenizer.model").read_bytes())
    (src / "added_tokens.json").write_text(json.dumps({"<tool>": 2049, "\u2581verily": 2050}))
    template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    tc = {
        "add_bos_token": False,
        "add_eos_token": True,
        "chat_template": template,
        "added_tokens_decoder": {  # 2047 replaces a piece; 2049 overrides added_tokens.json
            "2047": {"content": "<|im_start|>", "special": True},
            "2049": {"content": "<tool>", "special": False},
            "2051": {"content": "<|im_end|>", "special": True},
        },
    }
    (src / "tokenizer_config.json").write_text(json.dumps(tc))
    write_predictors(tmp_path / "pred")
    with caplog.at_level("INFO", logger="powerpy.pipeline.hf"):
        out = convert(src, tmp_path / "pred", tmp_path / "spm.powerinfer.gguf", outtype="f32")
    assert [r.getMessage() for r in caplog.records if "[PAD" in r.getMessage()] == [
        f"{src / 'tokenizer.model'}: {n_pieces} pieces; 5 UNUSED [PAD{{id}}] tokens pad it to 2056"
    ]

    pads = [2048, *range(2052, n_vocab)]
    with read_gguf(KJV_DIR / "kjv-relu.powerinfer.gguf") as want, read_gguf(out) as got:
        toks, scores = got.kv[Keys.TOKENS], np.asarray(got.kv[Keys.SCORES])
        types = np.asarray(got.kv[Keys.TOKEN_TYPE])
        assert len(toks) == len(scores) == len(types) == n_vocab
        assert toks[:2047] == want.kv[Keys.TOKENS][:2047]
        np.testing.assert_array_equal(scores[:2047], np.asarray(want.kv[Keys.SCORES])[:2047])
        assert [toks[i] for i in (2047, 2049, 2050, 2051)] == [
            "<|im_start|>",
            "<tool>",
            " verily",
            "<|im_end|>",
        ]
        assert [toks[i] for i in pads] == [f"[PAD{i}]" for i in pads]
        C, U = TokenType.CONTROL, TokenType.USER_DEFINED
        assert types[2047:].tolist() == [C, TokenType.UNUSED, U, U, C] + [TokenType.UNUSED] * 4
        assert (scores[2047:] == -1000).all()
        assert (got.kv[Keys.ADD_BOS], got.kv[Keys.ADD_EOS]) == (False, True)
        assert got.kv[Keys.CHAT_TEMPLATE] == template
        assert (got.kv_types[Keys.ADD_EOS], got.kv_types[Keys.CHAT_TEMPLATE]) == (
            GGUFValueType.BOOL,
            GGUFValueType.STRING,
        )

    tok = Tokenizer.from_gguf(out)
    assert (tok.add_bos, tok.add_eos, tok.eos_id) == (False, True, 2)
    ids = tok.encode("<|im_start|>And verily<tool><|im_end|>", add_eos=True)
    assert ids[0] == 2047 and ids[-4:] == [2050, 2049, 2051, 2]
    assert tok.decode(ids[1:-2]) == "And verily<tool>"

    small = write_hf(tmp_path / "small", hf_tensors(n_vocab=2000), n_vocab=2000)
    (small / "tokenizer.model").write_bytes((KJV_DIR / "tokenizer.model").read_bytes())
    with pytest.raises(ValueError, match=rf"2048 tokens .*{re.escape(str(small))}.* 2000"):
        convert(small, tmp_path / "pred", tmp_path / "small.gguf")


def test_non_bpe_tokenizer_json_is_refused(tmp_path) -> None:
    src = write_hf(tmp_path / "hf", hf_tensors())
    tj = src / "tokenizer.json"
    tj.write_text(json.dumps({"model": {"type": "Unigram", "vocab": [["<unk>", 0.0]]}}))
    write_predictors(tmp_path / "pred")
    with pytest.raises(ValueError, match=re.escape(str(tj)) + r".*'Unigram'.*--vocab-gguf"):
        convert(src, tmp_path / "pred", tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("text", ['{"bos_token": "<s>"', "[1, 2]", "\xff\xfe"])
def test_malformed_tokenizer_config_names_the_file(tmp_path, text) -> None:
    src = write_hf(tmp_path / "hf", hf_tensors())
    (src / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}}}))
    bad = src / "tokenizer_config.json"
    bad.write_bytes(text.encode("latin-1"))
    write_predictors(tmp_path / "pred")
    with pytest.raises(
        ValueError, match=re.escape(str(bad)) + r": (not valid JSON|expected a JSON)"
    ):
        convert(src, tmp_path / "pred", tmp_path / "o.gguf")
    assert not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize("act", ["relu", "silu"])
def test_hf_without_predictors_becomes_a_dense_gguf(tmp_path, vocab_gguf, act) -> None:
    from powerpy.api import load

    t = hf_tensors()
    src = write_hf(tmp_path / "hf", t, act=act)
    out = convert(src, None, tmp_path / "m.gguf", outtype="f32", vocab_gguf=vocab_gguf)
    with read_gguf(out) as gf:
        assert not gf.sparse and "blk.0.ffn_down.weight" in gf.tensors
        assert not any(".fc1." in n or "ffn_down_t" in n for n in gf.tensors)
    llm = load(out, weight_format="f32", ffn_act="relu" if act == "relu" else None)
    got = llm.logits(TOKENS, cache_dtype=torch.float32).numpy()
    np.testing.assert_allclose(got, hf_reference_logits(t, TOKENS, act), rtol=1e-4, atol=1e-4)
    llm.file.close()
    with pytest.raises(ValueError, match="predictor directory"):
        convert(out, None, tmp_path / "again.gguf")
