"""Decode speed of powerpy and llama.cpp (llama-cpp-python) side by side on one model.

    python tools/compare_llama_cpp.py [-m MODEL.gguf] [-n 64] [-t THREADS] [--rounds 3]

Both engines decode the same greedy continuation in alternating rounds; the best round of each
is reported with their ratio. Timings on a shared machine are noisy: compare ratios only.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

PROMPT = "In the beginning God created the heaven and the earth. And the earth was"


def llama_cpp_decode(ref, ids: list[int], n: int) -> float:
    ref.reset()
    ref.eval(ids)
    t0 = time.perf_counter()
    for _ in range(n):
        ref.eval([int(np.argmax(ref.scores[ref.n_tokens - 1]))])
    return n / (time.perf_counter() - t0)


def powerpy_decode(llm, ids: list[int], n: int) -> float:
    m = llm.model
    cache = m.new_cache(len(ids) + n + 1)
    logits = m.forward(torch.tensor(ids), cache)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = m.forward(logits.argmax(-1), cache)
    return n / (time.perf_counter() - t0)


def main() -> None:
    import llama_cpp

    import powerpy
    from powerpy.default_model import smollm2_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    path = args.model or str(smollm2_path())
    torch.set_num_threads(args.threads)
    llm = powerpy.load(path)
    ref = llama_cpp.Llama(
        model_path=path, n_ctx=512, n_threads=args.threads, logits_all=True, verbose=False
    )
    ids = llm.tokenize(PROMPT)
    ours, theirs = [], []
    for _ in range(args.rounds):
        theirs.append(llama_cpp_decode(ref, ids, args.n))
        ours.append(powerpy_decode(llm, ids, args.n))
    print(f"model {path}, {args.threads} threads, {args.n} tokens, best of {args.rounds}")
    for name, speeds in (("llama.cpp", theirs), ("powerpy", ours)):
        rounds = ", ".join(f"{x:.1f}" for x in speeds)
        print(f"{name:9} decode: {max(speeds):8.2f} tok/s   (rounds: {rounds})")
    print(f"powerpy / llama.cpp: {max(ours) / max(theirs):.3f}")


if __name__ == "__main__":
    main()
