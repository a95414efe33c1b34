"""Compare grammar engines for constrained sampling: the cost of one token's mask.

    python tools/bench_grammar.py                  # the default model's 49k vocabulary + 262k
    python tools/bench_grammar.py --engines llguidance xgrammar

For each engine (llguidance, xgrammar, outlines-core) and vocabulary, compiles a JSON schema with
nested objects, arrays, enums and required fields, then walks a valid document token by token:
each step fills the allowed-token mask, then consumes the token. Reported: the schema's compile
time (after the engine's per-vocabulary setup, also reported) and the time of one mask (mean,
median, 90th percentile; the first mask, which builds the engine's caches, apart). The 262k
vocabulary is synthetic and byte-level: the default model's tokens plus random concatenations of
two of them, as a large multilingual vocabulary would have.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string"},
                "geo": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
            },
            "required": ["city", "geo"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
DOC = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "engine", "poetry"],
    "address": {"city": "London", "zip": "W1", "geo": {"lat": 51.5, "lon": -0.12}},
    "active": True,
}


def default_vocab() -> tuple[list[bytes], list[int], int, object]:
    """The default model's token pieces, its special ids, its EOS id and its tokenizer."""
    from powerpy.default_model import smollm2_path
    from powerpy.formats.gguf_reader import read_gguf
    from powerpy.structured.vocab import token_pieces
    from powerpy.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_kv(read_gguf(smollm2_path()).kv)
    pieces, special = token_pieces(tok)
    return pieces, special, tok.eos_id, tok


def synthetic_vocab(base: list[bytes], special: list[int], size: int, seed: int = 0):
    """``base`` grown to ``size`` tokens with random concatenations of two base tokens."""
    rng = random.Random(seed)
    normal = [p for i, p in enumerate(base) if i not in set(special) and p]
    seen = set(base)
    out = list(base)
    while len(out) < size:
        p = rng.choice(normal) + rng.choice(normal)
        if p not in seen and len(p) <= 32:
            seen.add(p)
            out.append(p)
    return out


_INDEX: dict[int, tuple[dict[bytes, int], int]] = {}


def greedy_tokenize(pieces: list[bytes], special: list[int], text: bytes) -> list[int]:
    """Longest-match tokenization (the engines only need a valid token path)."""
    if id(pieces) not in _INDEX:
        skip = set(special)
        index = {p: i for i, p in enumerate(pieces) if i not in skip and p}
        _INDEX[id(pieces)] = index, max(len(p) for p in index)
    index, longest = _INDEX[id(pieces)]
    out, i = [], 0
    while i < len(text):
        for n in range(min(longest, len(text) - i), 0, -1):
            t = index.get(text[i : i + n])
            if t is not None:
                out.append(t)
                i += n
                break
        else:
            raise ValueError(f"no token for byte {text[i]}")
    return out


# ----------------------------------------------------------------------------------- engines
def run_llguidance(pieces, special, eos, tokens, schema):
    import llguidance
    import llguidance.torch as lt

    from powerpy.structured.vocab import ll_tokenizer

    def encode(text: str) -> list[int]:
        return greedy_tokenize(pieces, special, text.encode())

    t0 = time.perf_counter()
    tok = ll_tokenizer(pieces, special, eos, encode)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), defaults={"whitespace_flexible": False}
    )
    m = llguidance.LLMatcher(tok, grammar)
    assert not m.is_error(), m.get_error()
    compile_s = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, len(pieces))
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        lt.fill_next_token_bitmask(m, mask, 0)
        times.append(time.perf_counter() - t0)
        assert m.consume_token(t), m.get_error()
    assert m.is_accepting()
    return setup, compile_s, times


def run_xgrammar(pieces, special, eos, tokens, schema):
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [b"" if i in set(special) else p for i, p in enumerate(pieces)]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(pieces), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":")
    )
    m = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, len(pieces))
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t0)
        assert m.accept_token(t), t
    return setup, compile_s, times


def run_outlines(pieces, special, eos, tokens, schema):
    import outlines_core as oc

    t0 = time.perf_counter()
    by_piece: dict[bytes, list[int]] = {}
    for i, p in enumerate(pieces):
        if i != eos and i not in set(special) and p:
            by_piece.setdefault(p, []).append(i)
    vocab = oc.Vocabulary(eos, by_piece)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
    guide = oc.Guide(oc.Index(regex, vocab))
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((len(pieces) + 31) // 32, dtype=torch.int32)
    times = []
    for t in tokens:
        t0 = time.perf_counter()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
        times.append(time.perf_counter() - t0)
        guide.advance(t)
    return setup, compile_s, times


ENGINES = {"llguidance": run_llguidance, "xgrammar": run_xgrammar, "outlines-core": run_outlines}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--large", type=int, default=262_144, help="synthetic vocabulary size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pieces, special, eos, tok = default_vocab()
    text = json.dumps(DOC, separators=(",", ":")).encode()
    vocabs = {
        f"{len(pieces) // 1000}k (default model)": (
            pieces,
            tok.encode(text.decode(), add_bos=False),
        ),
    }
    big = synthetic_vocab(pieces, special, args.large)
    vocabs[f"{len(big) // 1000}k (synthetic)"] = (big, greedy_tokenize(big, special, text))
    print(
        "| engine | vocabulary | setup s | compile ms | first mask us | mask mean us | p50 us "
        "| p90 us | steps |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.engines:
        for label, (vocab, tokens) in vocabs.items():
            try:
                setup, compile_s, times = ENGINES[name](vocab, special, eos, tokens, SCHEMA)
            except Exception as e:  # an engine that fails is reported, not fatal
                print(f"| {name} | {label} | failed: {type(e).__name__}: {e} ||||")
                continue
            first, us = times[0] * 1e6, np.array(times[1:]) * 1e6
            print(
                f"| {name} | {label} | {setup:.2f} | {compile_s * 1e3:.1f} | {first:.0f} | "
                f"{statistics.fmean(us):.0f} | {np.percentile(us, 50):.0f} | "
                f"{np.percentile(us, 90):.0f} | {len(us)} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
