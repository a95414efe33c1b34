"""The attention projections in either layout llama.cpp loads (``create_tensor_qkv``): three
matrices ``attn_q``/``attn_k``/``attn_v`` or one fused ``attn_qkv`` (q rows, then k, then v),
with the fused bias or the three parts' biases. The same random Q8_0 weights are rewritten from
one layout into the other (byte-exact row blocks); llama.cpp runs each file, and powerpy's logits
are bit-identical to its logits in every layout, so to each other too. Bad combinations (both
layouts, a part missing, some of the parts' biases) get one error naming the tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from oracle_fixtures import PROMPT, check, compare, our_greedy
from test_gemma_phi3_oracle import write_phi3
from test_qwen_oracle import write_model

from powerpy.api import load
from powerpy.errors import FileFormatError, ModelConfigError
from powerpy.formats.gguf_reader import read_gguf
from powerpy.formats.gguf_writer import write_gguf

PARTS = ("attn_q", "attn_k", "attn_v")


def relayout(
    src: Path,
    dst: Path,
    *,
    fuse: bool,
    part_biases: bool = False,
    keep: tuple[str, ...] = (),
    drop: tuple[str, ...] = (),
) -> Path:
    """``src`` with each layer's q/k/v fused into attn_qkv (``fuse``) or split out of it, row
    bytes unchanged. A fused matrix takes one fused bias, or (``part_biases``) keeps the parts'
    three; ``keep`` names tensors to copy as they are besides, ``drop`` tensors to leave out."""
    with read_gguf(src) as gf:
        specs = {n: (data, t, shape) for n, data, t, shape in gf.tensor_specs() if n not in drop}
        kv = gf.typed_kv()
        arch = kv["general.architecture"][0]
        n_head, n_kv = (kv[f"{arch}.attention.{k}"][0] for k in ("head_count", "head_count_kv"))
        n_q = kv[f"{arch}.embedding_length"][0]
        out: list[tuple] = []
        for name, (data, t, shape) in specs.items():
            parts = name.split(".")  # blk.{l}.{base}.{kind}
            blk, base, kind = ".".join(parts[:2]), parts[2] if parts[0] == "blk" else "", parts[-1]
            if fuse and base in PARTS and name not in keep:
                if kind == "bias" and part_biases:
                    out.append((name, data, t, shape))
                elif base == "attn_q":  # the fused one, in the place of q
                    own = [specs[n] for p in PARTS if (n := f"{blk}.{p}.{kind}") in specs]
                    fused = np.concatenate([p[0].reshape(p[2][0], -1) for p in own])
                    rows = sum(p[2][0] for p in own)
                    out.append((f"{blk}.attn_qkv.{kind}", fused, t, (rows, *shape[1:])))
            elif not fuse and base == "attn_qkv":
                rows = np.asarray(data).reshape(shape[0], -1)
                hd = n_q // n_head
                cut = (0, n_q, n_q + n_kv * hd, shape[0])
                for p, a, b in zip(PARTS, cut, cut[1:], strict=False):
                    out.append((f"{blk}.{p}.{kind}", rows[a:b], t, (b - a, *shape[1:])))
            else:
                out.append((name, data, t, shape))
        return write_gguf(dst, kv, out, alignment=gf.alignment)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qkv")
    qwen2 = write_model(
        tmp / "qwen2.gguf", arch="qwen2", n_layer=2, tied=False, dtype="q8_0", seed=0
    )
    phi3 = write_phi3(tmp / "phi3.gguf", "q8_0", 0)
    return {
        "qwen2": qwen2,
        "qwen2-fused": relayout(qwen2, tmp / "qwen2-fused.gguf", fuse=True),
        "qwen2-fused-part-biases": relayout(
            qwen2, tmp / "qwen2-fpb.gguf", fuse=True, part_biases=True
        ),
        "phi3": phi3,
        "phi3-split": relayout(phi3, tmp / "phi3-split.gguf", fuse=False),
    }


@pytest.mark.llama_cpp
@pytest.mark.parametrize("name", ["qwen2-fused", "qwen2-fused-part-biases", "phi3-split"])
def test_each_layout_matches_llama_cpp_and_the_other(name, files, llama_cpp):
    path = files[name]
    ref = llama_cpp.Llama(
        model_path=str(path), n_ctx=256, logits_all=True, n_threads=2, verbose=False
    )
    try:
        ours = load(path)
        blk = ours.model.weights.blk[0]
        assert [getattr(blk, p).shape[0] for p in PARTS] == [
            getattr(load(files[name.split("-")[0]]).model.weights.blk[0], p).shape[0] for p in PARTS
        ]
        check(name, compare(name, ref, ours, n_ctx=256), exact=True)
    finally:
        ref.close()
    # the other layout of the same bytes: the same logits, bit for bit
    other = load(files[name.split("-")[0]])
    ids = ours.tokenize(PROMPT)
    a, b = our_greedy(ours, ids, 4)[1], our_greedy(other, ids, 4)[1]
    assert np.array_equal(a, b)


def test_fused_views_carry_the_biases(files):
    for name in ("qwen2", "qwen2-fused", "qwen2-fused-part-biases"):
        blk = load(files[name]).model.weights.blk[1]
        biases = [getattr(blk, p).bias for p in PARTS]
        assert all(b is not None for b in biases), name
        if name != "qwen2":
            ref = [getattr(load(files["qwen2"]).model.weights.blk[1], p).bias for p in PARTS]
            assert all(
                np.array_equal(x.numpy(), y.numpy()) for x, y in zip(biases, ref, strict=True)
            )


@pytest.mark.parametrize(
    "case, error, words",
    [
        ("both", ModelConfigError, ("holds both", "blk.0.attn_qkv.weight", "blk.0.attn_k.weight")),
        (
            "part-missing",
            FileFormatError,
            ("blk.1.attn_v.weight' is missing", "so is the fused 'blk.1.attn_qkv.weight'"),
        ),
        (
            "phi3-part-missing",
            FileFormatError,
            ("blk.1.attn_v.weight' is missing", "so is the fused 'blk.1.attn_qkv.weight'"),
        ),
        (
            "some-part-biases",
            ModelConfigError,
            ("blk.0.attn_qkv.weight", "blk.0.attn_q.bias", "all three"),
        ),
        ("fused-and-part-biases", ModelConfigError, ("its own 'blk.0.attn_qkv.bias'",)),
    ],
)
def test_bad_layouts_name_the_tensors(case, error, words, files, tmp_path):
    src, out = files["qwen2"], tmp_path / f"{case}.gguf"
    if case == "both":
        relayout(src, out, fuse=True, keep=("blk.0.attn_k.weight",))
    elif case == "part-missing":
        relayout(src, out, fuse=False, drop=("blk.1.attn_v.weight",))
    elif case == "phi3-part-missing":  # phi3's parts are its optional layout
        src = files["phi3-split"]
        relayout(src, out, fuse=False, drop=("blk.1.attn_v.weight",))
    elif case == "some-part-biases":
        relayout(src, out, fuse=True, part_biases=True, drop=("blk.0.attn_v.bias",))
    else:
        relayout(src, out, fuse=True, keep=("blk.0.attn_k.bias",))
    with pytest.raises(error) as e:
        load(out)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
