"""torch.compile as an alternative to the native decode kernels: SmolLM2-135M decode speed.

    python tools/bench_torch_compile.py [-m MODEL.gguf] [-n 64] [-t 2] [--rounds 3]

Four ways to decode the same dense GGUF one token at a time (greedy, from BOS):

- ``native``: powerpy as it runs by default (Q4_1 blocks read as stored, one native call per
  token through every block, llama.cpp's numerics);
- ``torch eager``: powerpy's torch code path (native kernels off, f32 activations);
- ``block f32``: one transformer block written as plain torch ops over a static KV cache
  (gpt-fast's layout: the position is a tensor, attention masks the unfilled cells), weights
  dequantized to f32, called eagerly for every layer;
- ``compiled f32`` / ``compiled bf16``: the same block compiled once with ``torch.compile``,
  weights in f32 or bf16;
- ``compiled int8``: the same, weights re-quantized to int8 per row (``_weight_int8pack_mm``,
  torch's weight-only int8 CPU kernel, activations bf16): a quarter of the f32 bytes, with
  rounding of its own.

Each round runs every way once, in this order; the table gives medians of tok/s and of the
ratio to ``native``. The compiled f32 logits are checked against the torch path's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def dense_matrix(w: torch.Tensor, dtype: torch.dtype):
    """An f32 matrix (rows, cols) as the block's ``linear`` takes it: a tensor in ``dtype``, or
    for int8 (int8 rows, per-row bf16 scales)."""
    if dtype != torch.int8:
        return w.to(dtype).contiguous()
    scale = w.abs().amax(1).clamp_min(1e-12) / 127.0  # (rows,)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scale.to(torch.bfloat16)


def linear(h: torch.Tensor, w) -> torch.Tensor:
    """h (1, cols) f32 @ w.T -> (1, rows) f32, for either form of :func:`dense_matrix`."""
    if isinstance(w, tuple):
        return torch.ops.aten._weight_int8pack_mm(h.to(torch.bfloat16), w[0], w[1]).float()
    return F.linear(h.to(w.dtype), w).float()


def block_weights(model, dtype: torch.dtype) -> list[tuple]:
    """Per layer (attn_norm, ffn_norm, (q, k, v, o, gate, up, down)): the norms f32, the
    matrices as :func:`dense_matrix` makes them, ``down`` as (n_embd, n_ff)."""
    out = []
    for b in model.weights.blk:
        ws = [b.attn_q, b.attn_k, b.attn_v, b.attn_output, b.ffn_gate, b.ffn_up]
        mats = [w.dequantize().float() for w in ws] + [b.ffn_down_t.dequantize().t().float()]
        out.append(
            (b.attn_norm.float(), b.ffn_norm.float(), [dense_matrix(m, dtype) for m in mats])
        )
    return out


def make_block(n_head: int, n_kv: int, hd: int, eps: float):
    """One block over a static cache: x (1, n_embd) f32, pos (1,) int64, kc/vc (n_ctx, n_kv,
    hd) f32 updated in place, cos/sin (1, hd / 2) -> x + attention + FFN (1, n_embd)."""

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(t, cos, sin):  # t (1, heads, hd): adjacent pairs (ggml NORM mode)
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def block(x, pos, kc, vc, cos, sin, an, fn, mats):
        wq, wk, wv, wo, wg, wu, wd = mats
        h = norm(x, an)
        q = linear(h, wq).view(1, n_head, hd)
        k = linear(h, wk).view(1, n_kv, hd)
        v = linear(h, wv).view(1, n_kv, hd)
        q, k = rope(q, cos[:, None], sin[:, None]), rope(k, cos[:, None], sin[:, None])
        kc.index_copy_(0, pos, k)
        vc.index_copy_(0, pos, v)
        mask = torch.arange(kc.shape[0]) <= pos  # (n_ctx,) filled cells
        att = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # (1, n_head, 1, hd)
            kc.transpose(0, 1)[None],  # (1, n_kv, n_ctx, hd)
            vc.transpose(0, 1)[None],
            attn_mask=mask[None, None, None],
            enable_gqa=True,
        ).reshape(1, n_head * hd)
        x = x + linear(att, wo)
        h = norm(x, fn)
        return x + linear(F.silu(linear(h, wg)) * linear(h, wu), wd)

    return block


class CompiledDecoder:
    """The model's blocks through one block function, compiled or eager (module docstring)."""

    def __init__(self, model, dtype: torch.dtype, n_ctx: int, compile: bool = True) -> None:
        a = model.args
        self.model, self.a, self.n_ctx = model, a, n_ctx
        self.layers = block_weights(model, dtype)
        fn = make_block(a.n_head, a.n_head_kv, a.head_dim, a.norm_eps)
        self.block = torch.compile(fn, dynamic=False) if compile else fn
        inv = a.rope_base ** (-torch.arange(0, a.n_rot, 2, dtype=torch.float64) / a.n_rot)
        ang = torch.arange(n_ctx, dtype=torch.float64)[:, None] * inv[None]
        self.cos, self.sin = ang.cos().float(), ang.sin().float()  # (n_ctx, n_rot / 2)
        self.out_norm = model.weights.output_norm.float()
        self.output = dense_matrix(model.weights.output.dequantize().float(), dtype)

    def new_cache(self):
        shape = (self.a.n_layer, self.n_ctx, self.a.n_head_kv, self.a.head_dim)
        return torch.zeros(shape), torch.zeros(shape), [0]

    @torch.inference_mode()
    def step(self, token: int, cache) -> torch.Tensor:
        kc, vc, posbox = cache
        p = posbox[0]
        pos = torch.tensor([p])
        x = self.model.weights.token_embd.take_rows(torch.tensor([token])).dequantize().float()
        cos, sin = self.cos[p : p + 1], self.sin[p : p + 1]
        for l, w in enumerate(self.layers):
            x = self.block(x, pos, kc[l], vc[l], cos, sin, *w)
        posbox[0] = p + 1
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.a.norm_eps) * self.out_norm
        return linear(x, self.output)[0]


def tg_compiled(dec: CompiledDecoder, first: int, n: int) -> float:
    cache = dec.new_cache()
    tok = int(dec.step(first, cache).argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(dec.step(tok, cache).argmax())
    return n / (time.perf_counter() - t0)


def tg_powerpy(model, first: int, n: int, opts) -> float:
    cache = model.new_cache(n + 2)
    tok = model.forward(torch.tensor([first]), cache, opts).argmax(-1)
    t0 = time.perf_counter()
    for _ in range(n):
        tok = model.forward(tok, cache, opts).argmax(-1)
    return n / (time.perf_counter() - t0)


def main() -> None:
    import powerpy
    from powerpy.default_model import smollm2_path
    from powerpy.model.numerics import Numerics
    from powerpy.model.options import DENSE

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, default=None, help="dense GGUF (default SmolLM2)")
    ap.add_argument("-n", type=int, default=64, help="decoded tokens per run")
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or smollm2_path()
    llm = powerpy.load(path)
    model, first = llm.model, llm.tokenizer.bos_id or 0
    n_ctx = args.n + 8

    print("compiling (the first call of each compiled block)...", file=sys.stderr)
    t0 = time.perf_counter()
    decs = {"block f32": CompiledDecoder(model, torch.float32, n_ctx, compile=False)}
    for k, d in (("f32", torch.float32), ("bf16", torch.bfloat16), ("int8", torch.int8)):
        decs[f"compiled {k}"] = CompiledDecoder(model, d, n_ctx)
    for d in decs.values():
        tg_compiled(d, first, 2)
    print(f"compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    # Check: the compiled f32 block against powerpy's torch path with f32 activations.
    torch_f32 = dataclasses.replace(
        DENSE, numerics=Numerics(native=False, quantized_activations=False)
    )
    ref_cache = model.new_cache(8, dtype=torch.float32)
    cache = decs["compiled f32"].new_cache()
    worst = 0.0
    for tok in (first, 504, 2718, 13):
        want = model.forward(torch.tensor([tok]), ref_cache, torch_f32)[0]
        got = decs["compiled f32"].step(tok, cache)
        worst = max(worst, float((got - want).abs().max()))
    print(f"compiled f32 vs powerpy's torch path: max |logit difference| {worst:.2e}")

    names = ["native", "torch eager", *decs]
    speed: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        speed["native"].append(tg_powerpy(model, first, args.n, DENSE))
        speed["torch eager"].append(tg_powerpy(model, first, args.n, torch_f32))
        for k, d in decs.items():
            speed[k].append(tg_compiled(d, first, args.n))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in speed.items()))
    print(f"\n{path.name}: tg{args.n}, {args.threads} threads, {args.rounds} rounds, medians")
    print(f"| {'way':<14} | {'tok/s':>7} | {'vs native':>9} |")
    print(f"|{'-' * 16}|{'-' * 9}|{'-' * 11}|")
    for k in names:
        ratio = statistics.median(a / b for a, b in zip(speed[k], speed["native"], strict=True))
        print(f"| {k:<14} | {statistics.median(speed[k]):>7.1f} | {ratio:>8.3f}x |")


if __name__ == "__main__":
    main()
