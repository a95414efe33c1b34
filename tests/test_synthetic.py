"""Synthetic PWRI models of Falcon and OPT (``powerpy.testing.synthetic``; llama's are tested in
test_kernels.py): the files hold their family's keys and tensors, a predictor that is the
exact sign of the ungated ReLU neuron (LayerNorm included), and about 10% active neurons when
powerpy runs them."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from powerpy.config import FFNVariant, ModelArgs
from powerpy.formats.constants import GGMLType, Keys, Names, bias_name
from powerpy.formats.gguf_reader import read_gguf
from powerpy.testing import synthetic as syn

ROOT = Path(__file__).resolve().parents[1]
FALCON_40B = syn.Shape(256, 1024, 2, 4, 2, 512, 512, 64)  # tiny, with 2 kv heads: attn_norm_2
CASES = [("falcon", "tiny"), ("falcon", FALCON_40B), ("opt", "tiny")]
IDS = ["falcon-mqa", "falcon-40b", "opt"]


@pytest.fixture(autouse=True)
def _quiet():
    logging.disable(logging.INFO)
    yield
    logging.disable(logging.NOTSET)


def _write(tmp_path: Path, arch: str, shape, dtype: str, **kw) -> Path:
    name = shape if isinstance(shape, str) else f"{shape.n_head_kv}kv"
    out = tmp_path / f"{arch}-{name}-{dtype}" / "model.powerinfer.gguf"
    return syn.write_synthetic_model(out, shape, dtype, arch=arch, powerlaw=True, **kw)


@pytest.mark.parametrize("dtype", ["f32", "q4_0"])
@pytest.mark.parametrize(("arch", "shape"), CASES, ids=IDS)
def test_family_file(tmp_path, arch, shape, dtype):
    out = _write(tmp_path, arch, shape, dtype, predictor_noise=0)
    s = shape if isinstance(shape, syn.Shape) else syn.ARCH_SHAPES[arch][shape]
    with read_gguf(out) as gf:
        args = ModelArgs.from_gguf(gf)
        assert gf.sparse and args.arch == arch and args.ffn_variant is FFNVariant.RELU
        assert (args.n_embd, args.n_ff, args.n_head_kv) == (s.n_embd, s.n_ff, s.n_head_kv)
        assert args.n_ctx_train == s.n_ctx and args.norm_eps == pytest.approx(1e-5)
        assert Keys.LAYERNORM_EPS.format(arch=arch) in gf.kv
        names = set(gf.tensors)
        assert not any(".ffn_gate." in n for n in names)
        assert {bias_name(Names.OUTPUT_NORM), Names.FC1.format(l=1)} <= names
        expect = GGMLType.Q4_0 if dtype == "q4_0" else GGMLType.F32
        assert gf.tensors[Names.FFN_UP.format(l=1)].ggml_type == expect
        assert gf.tensors[Names.ATTN_NORM.format(l=1)].ggml_type == GGMLType.F32
        if arch == "falcon":
            n_qkv = s.n_embd + 2 * s.n_embd // s.n_head * s.n_head_kv
            assert gf.tensors[Names.ATTN_QKV.format(l=0)].shape == (n_qkv, s.n_embd)
            assert (Names.ATTN_NORM_2.format(l=0) in names) == (s.n_head_kv > 1)
            assert Names.OUTPUT in names and Names.ATTN_Q.format(l=0) not in names
            norm = Names.ATTN_NORM  # the MLP's norm
        else:
            assert gf.tensors[Names.POS_EMBD].shape == (s.n_ctx + 2, s.n_embd)
            assert Names.OUTPUT not in names  # tied to token_embd
            assert gf.tensors[bias_name(Names.FFN_DOWN_T.format(l=0))].shape == (s.n_embd,)
            assert Keys.ROPE_FREQ_BASE.format(arch=arch) not in gf.kv
            norm = Names.FFN_NORM

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.array(gf.dequantize(name.format(l=1))))

        up, fc1, fc2 = t(Names.FFN_UP), t(Names.FC1), t(Names.FC2)
        w, b = t(norm), t(bias_name(norm))
    stats = [torch.load(out.parent / "activation" / f"activation_{i}.pt") for i in range(2)]
    assert all(st.shape == (s.n_ff,) and abs(float(st.mean()) - 0.1) < 1e-3 for st in stats)
    # With --predictor-noise 0 the predictor is the neuron's sign: logit_j >= 0 iff
    # up_j·LayerNorm(x) > 0, for any state whose dimension 0 is C and dimension 1 (the sink) 0,
    # whatever its mean.
    x = torch.randn(256, s.n_embd) + 3.0 * torch.randn(256, 1)
    x[:, 0], x[:, 1] = syn.C, 0.0
    logits = torch.relu(x @ fc1.T) @ fc2.T
    g = torch.nn.functional.layer_norm(x, (s.n_embd,), w, b, 1e-5) @ up.T
    agree = ((logits >= 0) == (g > 0)).float().mean()
    # Q4_0 rounds fc1, fc2 and up independently: ~3% of near-zero signs flip (0.969..0.98
    # across seeds and thread counts, which change the generator's bytes)
    assert agree > (0.999 if dtype == "f32" else 0.95), agree


@pytest.mark.parametrize(("arch", "shape"), CASES, ids=IDS)
def test_family_sparsity_in_powerpy(tmp_path, arch, shape, one_thread):
    """powerpy's own forward over a multi-token prompt: about 10% of the neurons fire, the
    predictor (on the input the family gives it) finds most of them, and a sparse run decodes."""
    import powerpy
    from powerpy.model.options import RunOptions

    out = _write(tmp_path, arch, shape, "f16")
    llm = powerpy.load(out)
    ids = llm.tokenize("In the beginning God created the heaven and the earth. And the earth")
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def observe(layer: int, x: torch.Tensor, h: torch.Tensor) -> None:
        seen[layer] = (x.float().clone(), h.float().clone())

    cache = llm.model.new_cache(len(ids))
    llm.model.forward(torch.tensor(ids), cache, RunOptions(observer=observe), all_logits=True)
    assert sorted(seen) == [0, 1]
    with read_gguf(out) as gf:
        for layer, (x, h) in seen.items():
            fc1, fc2 = (
                torch.from_numpy(np.array(gf.dequantize(f"blk.{layer}.{n}.weight")))
                for n in ("fc1", "fc2")
            )
            pred, true = (torch.relu(x @ fc1.T) @ fc2.T) >= 0, h > 0
            assert 0.06 < float(true.float().mean()) < 0.15, (layer, float(true.float().mean()))
            recall = float((pred & true).sum() / true.sum())
            assert recall > 0.85, (layer, recall)
    got = [r.token for r in llm.stream(ids, 8, temperature=0)]
    assert len(got) >= 1
    frac = llm.sparsity.active_fraction()  # the predictor's choices in the sparse run
    assert np.all((frac > 0.05) & (frac < 0.2)), frac


def test_command_line(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import make_synthetic_model as tool
    finally:
        sys.path.remove(str(ROOT / "tools"))
    with pytest.raises(SystemExit) as e:
        tool.main(["--arch", "opt", "--shape", "7b", "-o", str(tmp_path / "m.gguf")])
    assert e.value.code == 2
    out = tmp_path / "f" / "m.powerinfer.gguf"
    assert tool.main(["--arch", "falcon", "--dtype", "q4_0", "--layers", "1", "-o", str(out)]) == 0
    with read_gguf(out) as gf:
        assert gf.kv[Keys.ARCHITECTURE] == "falcon" and gf.kv["falcon.block_count"] == 1
    with pytest.raises(ValueError, match="opt has no shape '7b'"):
        syn.write_synthetic_model(tmp_path / "x.gguf", "7b", arch="opt")
