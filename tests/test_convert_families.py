"""`powerpy convert` for the Falcon and OPT families, on tiny random HF checkpoints built here
with transformers (Falcon-7B-style multi-query, Falcon-40B-style grouped with two norms, OPT).

The files are checked for llama.cpp's and PowerInfer's names, shapes, types and keys; the
Falcon ``attn_qkv`` reordering against the q/k/v the HF attention module computes; OPT's
position table against HF's module; ``pytorch_model*.bin`` shards against safetensors; and
each refused config by its message.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from powerpy.cli import main
from powerpy.config import FFNVariant, ModelArgs
from powerpy.errors import ModelConfigError
from powerpy.formats.constants import GGMLType, GGUFValueType, Keys, Names, bias_name
from powerpy.formats.gguf_reader import read_gguf
from powerpy.pipeline.convert import convert
from powerpy.pipeline.hf_families import args_from_hf_config

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

N_VOCAB, L, H = 300, 2, 16  # vocabulary (padded past the tokenizer's), layers, predictor width
TOKENS = [1, 72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33, 7, 200, 45]

# name -> (HF config class, its arguments): the three layouts the tests cover
CONFIGS = {
    "falcon7b": (  # multi-query, one norm feeding attention and MLP, no biases
        "FalconConfig",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            multi_query=True,
            parallel_attn=True,
            activation="relu",  # ReluFalcon: PWRI files run ReLU
        ),
    ),
    "falcon40b": (  # grouped (2 kv heads), ln_attn + ln_mlp, biases, its own FFN width
        "FalconConfig",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            new_decoder_architecture=True,
            num_kv_heads=2,
            bias=True,
            ffn_hidden_size=128,
            activation="relu",
        ),
    ),
    "opt": (
        "OPTConfig",
        dict(hidden_size=64, num_attention_heads=4, ffn_dim=128, max_position_embeddings=40),
    ),
}


# ---------------------------------------------------------------- fixtures
def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable character of each byte, in byte order."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def tiny_tokenizer_json() -> dict:
    """A byte-level BPE ``tokenizer.json``: the 256 byte tokens, a few merges and two specials
    (ids 0..262, fewer than the model's N_VOCAB rows)."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    merges = [["Ġ", "t"], ["h", "e"], ["Ġt", "he"], ["l", "l"], ["Ġ", "w"]]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    specials = ["<|endoftext|>", "</s>"]
    added = [
        {"id": len(vocab) + i, "content": t, "special": True, "normalized": False}
        | {"single_word": False, "lstrip": False, "rstrip": False}
        for i, t in enumerate(specials)
    ]
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges, "dropout": None},
    }


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights of a trained model's scale (HF's init is 0.02: near-constant logits)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if p.ndim == 2:
                p.copy_(r / math.sqrt(p.shape[1]))
            elif name.endswith("weight"):  # a norm's scale
                p.copy_(1 + 0.1 * r)
            else:
                p.copy_(0.1 * r)


def hf_model(kind: str, seed: int = 0, **over) -> torch.nn.Module:
    """A tiny random HF model of ``CONFIGS[kind]`` (float32, eval mode)."""
    cls_name, kw = CONFIGS[kind]
    cfg = getattr(transformers, cls_name)(vocab_size=N_VOCAB, num_hidden_layers=L, **{**kw, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model_cls = (
        transformers.FalconForCausalLM
        if kind.startswith("falcon")
        else (transformers.OPTForCausalLM)
    )
    model = model_cls(cfg).eval()
    _randomize(model, seed)
    return model


def save_hf(model: torch.nn.Module, d: Path, *, tokenizer: bool = True) -> Path:
    model.save_pretrained(d)
    if tokenizer:
        (d / "tokenizer.json").write_text(json.dumps(tiny_tokenizer_json()), encoding="utf-8")
    return d


def write_predictors(d: Path, n_embd: int, n_ff: int, config: dict | None = None) -> dict:
    """Random ``model_{l}.pt`` predictors (fc1 (H, n_embd), fc2 (n_ff, H), F16)."""
    g = torch.Generator().manual_seed(7)
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for l in range(L):
        sd = {
            "fc1.weight": torch.randn(H, n_embd, generator=g).half(),
            "fc2.weight": torch.randn(n_ff, H, generator=g).half(),
        }
        torch.save(sd, d / f"model_{l}.pt")
        out[l] = sd
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, torch.nn.Module, Path]:
    """(kind, model, its HF directory) of each layout."""
    kind = request.param
    model = hf_model(kind)
    return kind, model, save_hf(model, tmp_path_factory.mktemp(kind) / "hf")


def state(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def expected_names(kind: str, sparse: bool) -> set[str]:
    """The GGUF tensor names of a converted tiny checkpoint of ``kind``."""
    down = Names.FFN_DOWN_T if sparse else Names.FFN_DOWN
    if kind == "opt":
        block = [Names.ATTN_NORM, Names.ATTN_Q, Names.ATTN_K, Names.ATTN_V, Names.ATTN_OUTPUT]
        block += [Names.FFN_NORM, Names.FFN_UP, down]
        biased = block
        top = [Names.TOKEN_EMBD, Names.POS_EMBD, Names.OUTPUT_NORM, bias_name(Names.OUTPUT_NORM)]
    else:
        norms = [Names.ATTN_NORM] + ([Names.ATTN_NORM_2] if kind == "falcon40b" else [])
        mats = [Names.ATTN_QKV, Names.ATTN_OUTPUT, Names.FFN_UP, down]
        block, biased = norms + mats, norms + (mats if kind == "falcon40b" else [])
        top = [Names.TOKEN_EMBD, Names.OUTPUT_NORM, bias_name(Names.OUTPUT_NORM)]
    per_layer = block + [bias_name(n) for n in biased]
    if sparse:
        per_layer += [Names.FC1, Names.FC2]
    return set(top) | {n.format(l=l) for l in range(L) for n in per_layer}


def _same_args(got: ModelArgs, want: ModelArgs) -> None:
    """Equal but for the epsilon's float32 rounding in the file."""
    assert got.norm_eps == pytest.approx(want.norm_eps, rel=1e-6)
    assert dataclasses.replace(got, norm_eps=want.norm_eps) == want


# ---------------------------------------------------------------- layout
def test_dense_and_pwri_files(checkpoint, tmp_path) -> None:
    """Names, shapes, types, keys and the header's ModelArgs of both files; ffn_down_t is
    down.T, its bias renamed; the predictors follow the model tensors."""
    kind, model, src = checkpoint
    cfg = model.config
    arch = "opt" if kind == "opt" else "falcon"
    sd = state(model)
    want = args_from_hf_config(json.loads((src / "config.json").read_text()))
    d, ff = want.n_embd, want.n_ff
    preds = write_predictors(tmp_path / "pred", d, ff, config={"sparse_threshold": 0.25})
    dense = convert(src, None, tmp_path / "m.gguf")  # f16
    sparse = convert(src, tmp_path / "pred", tmp_path / "m.powerinfer.gguf", outtype="f32")

    for path, is_sparse in ((dense, False), (sparse, True)):
        with read_gguf(path) as gf:
            assert gf.sparse is is_sparse
            assert set(gf.tensors) == expected_names(kind, is_sparse)
            for name, info in gf.tensors.items():
                if is_sparse:
                    assert info.ggml_type is GGMLType.F32, name
                else:
                    two_d = GGMLType.F16 if len(info.shape) == 2 else GGMLType.F32
                    assert info.ggml_type is two_d, name
            kv = gf.kv
            assert kv[Keys.ARCHITECTURE] == arch
            assert kv[f"{arch}.context_length"] == cfg.max_position_embeddings
            assert kv[f"{arch}.embedding_length"] == cfg.hidden_size
            assert kv[f"{arch}.feed_forward_length"] == ff
            assert kv[f"{arch}.block_count"] == L
            assert kv[f"{arch}.attention.head_count"] == cfg.num_attention_heads
            assert kv[f"{arch}.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
            assert kv[Keys.TOKENIZER_PRE] == ("gpt-2" if kind == "opt" else "falcon")
            if kind == "opt":
                assert kv["opt.attention.head_count_kv"] == cfg.num_attention_heads
                assert not any(".rope." in k for k in kv)
            else:
                n_kv = 2 if kind == "falcon40b" else 1
                assert kv["falcon.attention.head_count_kv"] == n_kv
                assert kv["falcon.tensor_data_layout"] == "jploski"
                assert kv["falcon.rope.freq_base"] == pytest.approx(10000.0)
            assert (Keys.SPARSE_THRESHOLD in kv) is is_sparse
            got = ModelArgs.from_gguf(gf)  # a dense falcon file runs GELU unless told ReLU
            dense_act = FFNVariant.GELU if arch == "falcon" else FFNVariant.RELU
            assert got.ffn_variant is (FFNVariant.RELU if is_sparse else dense_act)
            got = got.with_ffn_act(want.ffn_variant.activation)
            thr = 0.25 if is_sparse else 0.0
            _same_args(got, dataclasses.replace(want, sparse=is_sparse, sparse_threshold=thr))
            assert Names.OUTPUT not in gf.tensors  # tied to token_embd
            for name, info in gf.tensors.items():
                assert tuple(info.shape) == gf.array(name).shape

    with read_gguf(sparse) as gf:
        assert gf.kv[Keys.SPARSE_THRESHOLD] == pytest.approx(0.25)
        assert gf.kv_types[Keys.SPARSE_THRESHOLD] is GGUFValueType.FLOAT32
        names = list(gf.tensors)
        assert names[-2:] == [Names.FC1.format(l=L - 1), Names.FC2.format(l=L - 1)]
        assert all(".fc" not in n for n in names[: -2 * L])
        for l in range(L):
            p = f"model.decoder.layers.{l}.fc2" if kind == "opt" else f"transformer.h.{l}.mlp."
            p = p if kind == "opt" else p + "dense_4h_to_h"
            down_t = gf.array(Names.FFN_DOWN_T.format(l=l))
            assert down_t.shape == (ff, d) and down_t.flags.c_contiguous
            np.testing.assert_array_equal(down_t, sd[p + ".weight"].T)
            if kind != "falcon7b":
                b = gf.array(bias_name(Names.FFN_DOWN_T.format(l=l)))
                np.testing.assert_array_equal(b, sd[p + ".bias"])
            np.testing.assert_array_equal(
                gf.array(Names.FC2.format(l=l)), preds[l]["fc2.weight"].float().numpy()
            )


def _qkv_from_file(path: Path, l: int, h: np.ndarray, a: ModelArgs) -> tuple[np.ndarray, ...]:
    """q (n, n_head, hd), k and v (n, n_head_kv, hd) from the file's jploski attn_qkv."""
    with read_gguf(path) as gf:
        w = gf.array(Names.ATTN_QKV.format(l=l))
        b_name = bias_name(Names.ATTN_QKV.format(l=l))
        b = gf.array(b_name) if b_name in gf.tensors else 0.0
    out = h @ w.T + b  # (n, n_embd_qkv)
    q, k, v = np.split(out, [a.n_embd, a.n_embd + a.n_embd_gqa], axis=1)
    hd = a.head_dim
    return (
        q.reshape(-1, a.n_head, hd),
        k.reshape(-1, a.n_head_kv, hd),
        v.reshape(-1, a.n_head_kv, hd),
    )


@pytest.mark.parametrize("kind", ["falcon7b", "falcon40b"])
def test_falcon_qkv_split_equals_hf_attention(kind, tmp_path) -> None:
    """Split as the core reads it (q rows, then k, then v), the file's attn_qkv gives the q, k
    and v heads HF's attention module computes from the fused projection."""
    model = hf_model(kind, seed=3)
    src = save_hf(model, tmp_path / "hf")
    out = convert(src, None, tmp_path / "m.gguf", outtype="f32")
    a = args_from_hf_config(model.config.to_dict())
    h = np.random.default_rng(0).standard_normal((5, a.n_embd)).astype(np.float32)
    g = a.n_head // a.n_head_kv
    for l in range(L):
        attn = model.transformer.h[l].self_attention
        with torch.no_grad():
            hq, hk, hv = attn._split_heads(attn.query_key_value(torch.from_numpy(h)[None]))
        q, k, v = _qkv_from_file(out, l, h, a)
        np.testing.assert_allclose(q, hq[0].numpy(), rtol=1e-5, atol=1e-5)
        # HF broadcasts each kv head over its group of q heads (40B); 7B keeps the one head
        step = g if hk.shape[2] == a.n_head else 1
        np.testing.assert_allclose(k, hk[0, :, ::step].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(v, hv[0, :, ::step].numpy(), rtol=1e-5, atol=1e-5)
    with read_gguf(out) as gf:  # the norms: 40B's ln_mlp feeds the MLP, ln_attn attention
        blk = model.transformer.h[0]
        if kind == "falcon40b":
            pairs = [(Names.ATTN_NORM, blk.ln_mlp), (Names.ATTN_NORM_2, blk.ln_attn)]
        else:
            pairs = [(Names.ATTN_NORM, blk.input_layernorm)]
        for name, ln in pairs:
            w = name.format(l=0)
            np.testing.assert_array_equal(gf.array(w), ln.weight.detach().numpy())
            np.testing.assert_array_equal(gf.array(bias_name(w)), ln.bias.detach().numpy())


def test_opt_position_table_is_hf_embed_positions(tmp_path) -> None:
    """position_embd is HF's whole table (max_position_embeddings + 2 rows): position p is row
    p + 2, as HF's module reads it; the header's context is max_position_embeddings."""
    model = hf_model("opt", seed=4)
    src = save_hf(model, tmp_path / "hf")
    out = convert(src, None, tmp_path / "m.gguf", outtype="f32")
    n = model.config.max_position_embeddings
    pos = model.model.decoder.embed_positions
    with read_gguf(out) as gf:
        table = gf.array(Names.POS_EMBD)
        assert table.shape == (n + 2, 64)
        np.testing.assert_array_equal(table, pos.weight.detach().numpy())
        ids = torch.arange(n)[None]
        with torch.no_grad():
            hf_rows = pos(torch.ones(1, n, dtype=torch.long), 0, position_ids=ids)[0].numpy()
        np.testing.assert_array_equal(table[2:], hf_rows)
        assert ModelArgs.from_gguf(gf).n_ctx_train == n


# ---------------------------------------------------------------- sources
def _write_bin(sd: dict[str, torch.Tensor], d: Path, shards: int) -> None:
    """``pytorch_model.bin``, or ``shards`` files with ``pytorch_model.bin.index.json``."""
    if shards == 1:
        torch.save(sd, d / "pytorch_model.bin")
        return
    names, weight_map = list(sd), {}
    for s in range(shards):
        fname = f"pytorch_model-{s + 1:05d}-of-{shards:05d}.bin"
        torch.save({k: sd[k].clone() for k in names[s::shards]}, d / fname)
        weight_map.update(dict.fromkeys(names[s::shards], fname))
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize(("kind", "shards"), [("falcon40b", 1), ("opt", 3)])
def test_bin_shards_convert_like_safetensors(kind, shards, tmp_path) -> None:
    """pytorch_model*.bin (with the tied lm_head copy a torch.save of the model keeps; OPT's
    names as OPTModel saves them, without "model.") -> the same file as safetensors."""
    model = hf_model(kind, seed=5)
    st = save_hf(model, tmp_path / "st")
    pt = tmp_path / "pt"
    pt.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (pt / f).write_bytes((st / f).read_bytes())
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert "lm_head.weight" in sd
    if kind == "opt":
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
    _write_bin(sd, pt, shards)
    st_bf = save_hf(hf_model(kind, seed=5).to(torch.bfloat16), tmp_path / "st_bf")
    a = convert(st_bf, None, tmp_path / "a.gguf", outtype="f32")
    b = convert(pt, None, tmp_path / "b.gguf", outtype="f32")
    with read_gguf(a) as ga, read_gguf(b) as gb:
        assert list(ga.tensors) == list(gb.tensors)
        for name in ga.tensors:
            np.testing.assert_array_equal(ga.array(name), gb.array(name), name)


def test_opt_gpt2_vocab_files_and_tokenizer_json_tokenize_like_hf(tmp_path) -> None:
    """OPT's default pre-tokenizer is gpt-2: the file tokenizes as HF's byte-level BPE does,
    from tokenizer.json or from vocab.json + merges.txt (facebook/opt-*'s files)."""
    tokenizers = pytest.importorskip("tokenizers")
    from powerpy.tokenizer import Tokenizer

    model = hf_model("opt", seed=6)
    tj = tiny_tokenizer_json()
    ref = tokenizers.Tokenizer.from_str(json.dumps(tj))
    src = save_hf(model, tmp_path / "hf")
    files = save_hf(model, tmp_path / "files", tokenizer=False)
    model_tj = tj["model"]
    (files / "vocab.json").write_text(json.dumps(model_tj["vocab"]))
    merges = "\n".join(" ".join(m) for m in model_tj["merges"])
    (files / "merges.txt").write_text("#version: 0.2\n" + merges + "\n")
    (files / "tokenizer_config.json").write_text(json.dumps({"eos_token": "Ġthe"}))
    texts = ["Hello the world, the wheel!", "  tell  them\n12345 ok", "ünïcode 🙂 the"]
    for d in (src, files):
        out = convert(d, None, tmp_path / f"{d.name}.gguf")
        tok = Tokenizer.from_gguf(out)
        for text in texts:
            assert tok.encode(text, add_bos=False) == ref.encode(text).ids, (d.name, text)
    with read_gguf(tmp_path / "files.gguf") as gf:  # eos named by tokenizer_config: CONTROL
        eos = gf.kv[Keys.EOS_ID]
        assert gf.kv[Keys.TOKENS][eos] == "Ġthe" and gf.kv[Keys.TOKEN_TYPE][eos] == 3


def test_untied_falcon_writes_output_and_gelu_predictors_need_a_marker(tmp_path) -> None:
    model = hf_model("falcon7b", seed=8, tie_word_embeddings=False, activation="gelu")
    src = save_hf(model, tmp_path / "hf")
    write_predictors(tmp_path / "pred", 64, 256)
    with pytest.raises(ValueError, match=r"'gelu'.*sparse_activation.*--activation gelu"):
        convert(src, tmp_path / "pred", tmp_path / "x.gguf")
    out = convert(src, tmp_path / "pred", tmp_path / "m.gguf", activation="gelu", outtype="q8_0")
    with read_gguf(out) as gf:
        np.testing.assert_allclose(
            gf.dequantize(Names.OUTPUT), model.lm_head.weight.detach().numpy(), atol=0.02
        )
        assert gf.kv[Keys.SPARSE_ACTIVATION] == "gelu"
        assert ModelArgs.from_gguf(gf).ffn_variant is FFNVariant.GELU
        types = {n: i.ggml_type for n, i in gf.tensors.items()}
    assert types[Names.ATTN_QKV.format(l=0)] is GGMLType.Q8_0
    assert types[Names.FFN_DOWN_T.format(l=1)] is GGMLType.Q8_0
    assert types[Names.FC2.format(l=0)] is GGMLType.F16  # rows of 16: not Q8_0 blocks
    assert types[Names.ATTN_NORM.format(l=0)] is GGMLType.F32


@pytest.mark.parametrize("outtype", ["q4_0", "f16"])
def test_relu_falcon_pwri_types(outtype, tmp_path) -> None:
    model = hf_model("falcon40b", seed=9)
    src = save_hf(model, tmp_path / "hf")
    write_predictors(tmp_path / "pred", 64, 128)
    out = tmp_path / "m.powerinfer.gguf"
    argv = ["convert", str(src), str(tmp_path / "pred"), "-o", str(out), "--outtype", outtype]
    assert main(argv) == 0
    want = GGMLType.Q4_0 if outtype == "q4_0" else GGMLType.F16
    with read_gguf(out) as gf:
        assert Keys.SPARSE_ACTIVATION not in gf.kv
        assert ModelArgs.from_gguf(gf).ffn_variant is FFNVariant.RELU
        for name, info in gf.tensors.items():
            if len(info.shape) == 1:
                assert info.ggml_type is GGMLType.F32, name
            elif ".fc2." not in name:
                assert info.ggml_type is want, name


def test_dense_gguf_source_becomes_the_same_pwri_file(tmp_path) -> None:
    """HF -> dense GGUF -> PWRI equals HF -> PWRI: ffn_down and its bias become ffn_down_t."""
    model = hf_model("falcon40b", seed=12)
    src = save_hf(model, tmp_path / "hf")
    write_predictors(tmp_path / "pred", 64, 128)
    dense = convert(src, None, tmp_path / "d.gguf", outtype="f32")
    a = convert(dense, tmp_path / "pred", tmp_path / "a.powerinfer.gguf", outtype="f32")
    b = convert(src, tmp_path / "pred", tmp_path / "b.powerinfer.gguf", outtype="f32")
    with read_gguf(a) as ga, read_gguf(b) as gb:
        assert list(ga.tensors) == list(gb.tensors)
        for name in ga.tensors:
            np.testing.assert_array_equal(ga.array(name), gb.array(name), name)
        assert ModelArgs.from_gguf(ga) == ModelArgs.from_gguf(gb)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("kind", "over", "match"),
    [
        ("falcon7b", {"alibi": True}, r"alibi True is not supported: .*RoPE"),
        ("falcon7b", {"parallel_attn": False}, r"parallel_attn False is not supported"),
        ("falcon7b", {"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling"),
        (
            "falcon7b",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_parameters rope_type 'linear' is not supported",
        ),
        ("falcon7b", {"activation": "gelu_new"}, r"activation 'gelu_new' is not supported"),
        ("falcon7b", {"num_ln_in_parallel_attn": 2}, r"num_ln_in_parallel_attn 2 is not"),
        ("opt", {"word_embed_proj_dim": 32}, r"word_embed_proj_dim 32 .*project_in/project_out"),
        ("opt", {"do_layer_norm_before": False}, r"do_layer_norm_before False is not supported"),
        ("opt", {"activation_function": "gelu"}, r"activation_function 'gelu' is not supported"),
        ("opt", {"enable_bias": False}, r"enable_bias False is not supported"),
        ("opt", {"model_type": "gpt2"}, r"model_type 'gpt2' is not supported .*'falcon', 'opt'"),
    ],
)
def test_refused_configs_name_the_key(kind, over, match, tmp_path) -> None:
    cfg = hf_model(kind).config.to_dict() | over
    with pytest.raises(ModelConfigError, match=match) as e:
        args_from_hf_config(cfg, source="m/config.json")
    assert str(e.value).startswith("m/config.json: ")
    if kind == "opt" and "word_embed_proj_dim" in over:  # the same message from the command
        src = tmp_path / "hf"
        src.mkdir()
        (src / "config.json").write_text(json.dumps(cfg))
        save_hf(hf_model(kind), tmp_path / "ok")
        (src / "model.safetensors").write_bytes(
            (tmp_path / "ok" / "model.safetensors").read_bytes()
        )
        with pytest.raises(ModelConfigError, match=match):
            convert(src, None, tmp_path / "o.gguf")
        assert not (tmp_path / "o.gguf").exists()


def test_opt_lm_head_that_is_not_the_embeddings_is_refused(tmp_path) -> None:
    model = hf_model("opt", seed=10)
    d = save_hf(model, tmp_path / "hf")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["lm_head.weight"] += 1.0
    (d / "model.safetensors").unlink()
    _write_bin(sd, d, 1)
    with pytest.raises(ValueError, match=r"lm_head.weight differs from .*embed_tokens.*tied"):
        convert(d, None, tmp_path / "o.gguf")
    sd["extra.weight"] = torch.zeros(3)
    del sd["lm_head.weight"]
    _write_bin(sd, d, 1)
    with pytest.raises(ValueError, match=r"1 tensors are not part of the opt layout.*extra.weight"):
        convert(d, None, tmp_path / "o.gguf")


# ---------------------------------------------------------------- logits oracle
def _greedy(llm, prompt: list[int], steps: int) -> list[int]:
    """powerpy's greedy tokens: the prompt in one pass, then one token at a time (KV cache)."""
    cache = llm.model.new_cache(len(prompt) + steps, dtype=torch.float32)
    logits = llm.model.forward(torch.tensor(prompt), cache, llm.options)
    out = []
    for _ in range(steps):
        out.append(int(logits[-1].argmax()))
        logits = llm.model.forward(torch.tensor(out[-1:]), cache, llm.options)
    return out


@pytest.mark.parametrize(
    ("kind", "act"),
    [("falcon7b", "relu"), ("falcon7b", "gelu"), ("falcon40b", "relu"), ("falcon40b", "gelu")]
    + [("opt", "relu")],
)
def test_logits_and_greedy_tokens_match_transformers(kind, act, tmp_path) -> None:
    """The converted f32 file in powerpy against the HF model in f32: max |Δlogit| within 1e-4
    of the logits' spread and the same 16 greedy tokens; a ReLU model's PWRI file, sparse at
    threshold -inf, computes what its dense run does."""
    from powerpy.api import load

    over = {"activation": act} if kind.startswith("falcon") else {}
    model = hf_model(kind, seed=11, **over)
    src = save_hf(model, tmp_path / "hf")
    prompt, steps = torch.tensor([TOKENS]), 16
    with torch.no_grad():
        want = model(prompt).logits[0].numpy()
        ones = torch.ones_like(prompt)  # token 1 is OPT's pad id: no mask guessed from it
        gen = model.generate(prompt, attention_mask=ones, max_new_tokens=steps, do_sample=False)
    want_tokens = gen[0, len(TOKENS) :].tolist()
    assert len(want_tokens) == steps

    dense = convert(src, None, tmp_path / "m.gguf", outtype="f32")
    llm = load(dense, weight_format="f32", ffn_act=act, exact_activations=True)
    try:
        got = llm.logits(TOKENS, cache_dtype=torch.float32).numpy()
        spread = float(want.max() - want.min())
        assert np.abs(got - want).max() <= 1e-4 * spread
        assert _greedy(llm, TOKENS, steps) == want_tokens
    finally:
        llm.file.close()
    if act != "relu":
        return
    write_predictors(tmp_path / "pred", model.config.hidden_size, llm.model.args.n_ff)
    pwri = convert(src, tmp_path / "pred", tmp_path / "m.powerinfer.gguf", outtype="f32")
    sparse = load(pwri, weight_format="f32", threshold=-math.inf)
    dense_run = load(pwri, weight_format="f32", dense=True)
    try:
        assert sparse.model.args.sparse and sparse.options.sparse
        a = sparse.logits(TOKENS, cache_dtype=torch.float32).numpy()
        b = dense_run.logits(TOKENS, cache_dtype=torch.float32).numpy()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * spread)
        assert np.abs(a - want).max() <= 1e-4 * spread
        assert _greedy(sparse, TOKENS, steps) == want_tokens
    finally:
        sparse.file.close()
        dense_run.file.close()
