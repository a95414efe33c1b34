"""``ModelArgs``: GGUF key/values -> args -> GGUF key/values, and HF ``config.json`` -> args."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from powerpy.config import FFNVariant, ModelArgs
from powerpy.errors import ModelConfigError
from powerpy.formats.constants import PWRI_MAGIC, GGMLType, GGUFValueType, Keys, Names
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import write_gguf
from powerpy.pipeline.hf_families import args_from_hf_config
from powerpy.testing import TinySpec, spec_args, tiny_kv

BASE = ModelArgs(
    arch="llama",
    n_vocab=40,
    n_embd=64,
    n_layer=3,
    n_ff=160,
    n_head=4,
    n_head_kv=4,
    n_rot=16,
    rope_base=10000.0,
    norm_eps=2.0**-17,  # float32-exact, so that the file round trip is exact too
    n_ctx_train=512,
    sparse=False,
    ffn_variant=FFNVariant.SWIGLU,
    sparse_threshold=0.0,
)
# Every kind of args from_gguf_kv returns: dense SwiGLU, PWRI ReGLU (threshold absent, negative,
# -inf), PWRI SiLU (magnitude-trained predictors), bamboo dReLU dense and sparse, GQA with a
# partial rotary dimension.
ARGS = {
    "dense-swiglu": BASE,
    "pwri-reglu": dataclasses.replace(BASE, sparse=True, ffn_variant=FFNVariant.REGLU),
    "pwri-reglu-thr": dataclasses.replace(
        BASE, sparse=True, ffn_variant=FFNVariant.REGLU, sparse_threshold=-0.5
    ),
    "pwri-reglu-ungated": dataclasses.replace(
        BASE, sparse=True, ffn_variant=FFNVariant.REGLU, sparse_threshold=-math.inf
    ),
    "pwri-silu": dataclasses.replace(
        BASE, sparse=True, ffn_variant=FFNVariant.SWIGLU, sparse_threshold=0.25
    ),
    "bamboo-dense": dataclasses.replace(BASE, arch="bamboo", ffn_variant=FFNVariant.DRELU),
    "bamboo-pwri": dataclasses.replace(
        BASE, arch="bamboo", sparse=True, ffn_variant=FFNVariant.DRELU, sparse_threshold=1.5
    ),
    "pwri-dense-layers": dataclasses.replace(
        BASE, sparse=True, ffn_variant=FFNVariant.SWIGLU, sparse_threshold=-1.0, dense_layers=(0, 2)
    ),
    "gqa-partial-rope": dataclasses.replace(
        BASE, n_head=8, n_head_kv=2, n_rot=4, rope_base=500000.0, n_ctx_train=4096
    ),
}


def _plain(kv: dict) -> tuple[dict, dict]:
    """(values, types) of ``{key: (value, type)}``, as a reader returns them."""
    return {k: v[0] for k, v in kv.items()}, {k: v[1] for k, v in kv.items()}  # (v, t[, item])


@pytest.mark.parametrize("name", list(ARGS))
def test_gguf_kv_round_trip(name):
    a = ARGS[name]
    values, types = _plain(a.to_gguf_kv())
    assert ModelArgs.from_gguf_kv(values, sparse=a.sparse, n_vocab=a.n_vocab, kv_types=types) == a
    # with the vocabulary size written, no hint is needed
    values, types = _plain(a.to_gguf_kv(name="m", vocab_size=True))
    assert values[Keys.NAME] == "m"
    assert ModelArgs.from_gguf_kv(values, sparse=a.sparse, kv_types=types) == a


@pytest.mark.parametrize("name", list(ARGS))
def test_file_round_trip(tmp_path, name):
    """Through a real file: the magic carries ``sparse``, token_embd rows the vocabulary size."""
    a = ARGS[name]
    path = tmp_path / "m.gguf"
    embd = np.zeros((a.n_vocab, a.n_embd), np.float32)
    magic = PWRI_MAGIC if a.sparse else b"GGUF"
    write_gguf(path, a.to_gguf_kv(), [(Names.TOKEN_EMBD, embd, GGMLType.F32)], magic=magic)
    with read_gguf(path) as gf:
        assert gf.sparse == a.sparse
        assert ModelArgs.from_gguf(gf) == a


def test_to_gguf_kv_keys():
    """Keys and types of a sparse SiLU model; a zero threshold and ReLU write no sparse keys."""
    kv = ARGS["pwri-silu"].to_gguf_kv()
    assert kv[Keys.ARCHITECTURE] == ("llama", GGUFValueType.STRING)
    assert kv["llama.feed_forward_length"] == (160, GGUFValueType.UINT32)
    assert kv["llama.attention.layer_norm_rms_epsilon"] == (2.0**-17, GGUFValueType.FLOAT32)
    assert kv[Keys.SPARSE_THRESHOLD] == (0.25, GGUFValueType.FLOAT32)
    assert kv[Keys.SPARSE_ACTIVATION] == ("silu", GGUFValueType.STRING)
    assert Keys.NAME not in kv and "llama.vocab_size" not in kv
    for name in ("dense-swiglu", "pwri-reglu", "bamboo-dense"):
        kv = ARGS[name].to_gguf_kv()
        assert Keys.SPARSE_THRESHOLD not in kv and Keys.SPARSE_ACTIVATION not in kv, name
    # the tiny-model writer adds the threshold only when asked
    assert Keys.SPARSE_THRESHOLD not in tiny_kv(TinySpec())
    assert tiny_kv(TinySpec(), threshold=0.0)[Keys.SPARSE_THRESHOLD] == (0.0, GGUFValueType.FLOAT32)
    values, _ = _plain(tiny_kv(TinySpec(arch="bamboo")))
    assert ModelArgs.from_gguf_kv(values, sparse=True) == spec_args(TinySpec(arch="bamboo"))


def _hf(**over) -> dict:
    cfg = {
        "model_type": "llama",
        "vocab_size": 40,
        "hidden_size": 64,
        "num_hidden_layers": 3,
        "intermediate_size": 160,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def test_from_hf_config():
    a = args_from_hf_config(_hf())
    assert a == dataclasses.replace(
        BASE,
        n_head_kv=2,
        rope_base=500000.0,
        norm_eps=1e-6,
        n_ctx_train=4096,
    )
    assert args_from_hf_config(_hf(hidden_act="swish")).ffn_variant is FFNVariant.SWIGLU
    relu = args_from_hf_config(_hf(hidden_act="relu", model_type="mistral"))
    assert relu.ffn_variant is FFNVariant.REGLU and relu.ffn_variant.activation == "relu"
    # defaults: no GQA, rope base 10000, eps 1e-5, context 2048, SiLU; head_dim may be given
    d = args_from_hf_config(
        _hf(
            num_key_value_heads=None,
            rope_theta=None,
            rms_norm_eps=None,
            max_position_embeddings=None,
            hidden_act=None,
            head_dim=16,
        )
    )
    assert (d.n_head_kv, d.rope_base, d.norm_eps, d.n_ctx_train) == (4, 10000.0, 1e-5, 2048)
    assert d.ffn_variant is FFNVariant.SWIGLU and d.n_rot == 16
    # a dense SwiGLU HF model is a dense GGUF model
    values, types = _plain(a.to_gguf_kv())
    assert ModelArgs.from_gguf_kv(values, sparse=False, n_vocab=40, kv_types=types) == a


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"attention_bias": True}, "biases are not supported"),
        ({"mlp_bias": True}, "biases are not supported"),
        ({"head_dim": 8}, "not a supported LLaMA layout"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not one of"),
        ({"intermediate_size": None}, "needs int 'intermediate_size'"),
        ({"hidden_size": "64"}, "'hidden_size' must be one integer"),
        ({"num_key_value_heads": 3}, "inconsistent"),
    ],
)
def test_from_hf_config_errors(over, match):
    with pytest.raises(ModelConfigError, match=match) as e:
        args_from_hf_config(_hf(**over), source="m/config.json")
    assert str(e.value).startswith("m/config.json: ")


@pytest.mark.parametrize(
    "value",
    [[3], [1, 1], [-1], ["0"], [0.5], "01", 7],
    ids=["beyond", "twice", "neg", "str", "float", "string", "scalar"],
)
def test_dense_layers_key_is_checked(value) -> None:
    """powerpy.dense_layers names layers of the model, once each; anything else is one error."""
    kv, types = _plain(ARGS["pwri-dense-layers"].to_gguf_kv())
    kv[Keys.DENSE_LAYERS] = value
    with pytest.raises(ModelConfigError, match="dense_layers"):
        ModelArgs.from_gguf_kv(kv, sparse=True, n_vocab=40, kv_types=types, source="m.gguf")


def test_dense_layers_only_for_sparse_files() -> None:
    """A dense GGUF ignores the key (it has no predictors to skip)."""
    kv, types = _plain(ARGS["pwri-dense-layers"].to_gguf_kv())
    args = ModelArgs.from_gguf_kv(kv, sparse=False, n_vocab=40, kv_types=types)
    assert args.dense_layers == ()


@pytest.mark.parametrize(
    "arch, layers",
    [
        ("llama", ()),
        ("qwen2", ()),
        ("qwen3", ()),
        ("phi3", ()),
        ("falcon", ()),
        ("gemma2", (0, 2)),
        ("gemma3", (0, 1, 2)),
    ],
)
def test_the_sliding_window_applies_where_llama_cpp_applies_it(arch, layers) -> None:
    """llama.cpp reads ``{arch}.attention.sliding_window`` in gemma's graphs only (a pattern of
    windowed layers); llama (Mistral-style files), qwen2, qwen3, phi3 and falcon files attend
    over the whole context whatever the key says."""
    a = dataclasses.replace(BASE, arch=arch, sliding_window=8)
    kv, types = _plain(a.to_gguf_kv())
    kv.pop(f"{arch}.attention.sliding_window_pattern", None)  # a file with the window key only
    got = ModelArgs.from_gguf_kv(kv, sparse=False, n_vocab=a.n_vocab, kv_types=types)
    assert got.sliding_window == 8
    assert got.swa_layers == layers


@pytest.mark.parametrize(
    "arch, keys, want",
    [
        # gemma2 without the optional keys: llama.cpp's window 4096 and soft-caps 50 and 30
        ("gemma2", {}, dict(sliding_window=4096, attn_softcap=50.0, final_softcap=30.0)),
        # a family never reads the keys llama.cpp's loader for it does not: gemma3's final
        # soft-cap and local base, gemma2's caps and local base, none for the others
        (
            "gemma3",
            {
                "attn_logit_softcapping": 5.0,
                "attention.scale": 0.5,
                "final_logit_softcapping": 7.0,
                "rope.freq_base_swa": 500.0,
            },
            dict(attn_softcap=0.0, attn_scale=0.0, final_softcap=7.0, rope_base_swa=500.0),
        ),
        (
            "gemma2",
            {"attention.scale": 0.5, "attn_logit_softcapping": 5.0, "rope.freq_base_swa": 500.0},
            dict(attn_scale=0.0, attn_softcap=5.0, rope_base_swa=500.0),
        ),
        *(
            (
                arch,
                {
                    "final_logit_softcapping": 5.0,
                    "attn_logit_softcapping": 5.0,
                    "attention.scale": 0.5,
                    "rope.freq_base_swa": 500.0,
                },
                dict(final_softcap=0.0, attn_softcap=0.0, attn_scale=0.0, rope_base_swa=0.0),
            )
            for arch in ("llama", "qwen2", "qwen3", "phi3", "falcon", "opt", "bamboo")
        ),
        # a scaling factor without a type is linear scaling; a factor of 0 is none
        ("llama", {"rope.scaling.factor": 4.0}, dict(rope_scale=4.0)),
        ("llama", {"rope.scaling.factor": 0.0}, dict(rope_scale=1.0)),
        # the window pattern: a period, or flags (past them: global)
        (
            "gemma2",
            {"attention.sliding_window": 8, "attention.sliding_window_pattern": 3},
            dict(swa_layers=(0, 1)),
        ),
        (
            "gemma3",
            {"attention.sliding_window": 8, "attention.sliding_window_pattern": [0, 1]},
            dict(swa_layers=(1,)),
        ),
    ],
)
def test_family_keys_as_llama_cpp_reads_them(arch, keys, want) -> None:
    a = dataclasses.replace(BASE, arch=arch)
    kv, _ = _plain(a.to_gguf_kv())
    kv.update({f"{arch}.{k}": v for k, v in keys.items()})
    got = ModelArgs.from_gguf_kv(kv, sparse=False, n_vocab=a.n_vocab)
    assert {k: getattr(got, k) for k in want} == want
