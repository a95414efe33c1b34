"""`powerpy infer`: stream a continuation of a prompt, llama.cpp style."""

from __future__ import annotations

import argparse
import sys

from powerpy.commands.common import add_model_args, load_model, setup_hybrid, wants_hybrid


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("infer", help="generate text from a GGUF or PowerInfer (PWRI) model")
    add_model_args(p, generate=True)
    p.add_argument("-p", "--prompt", default=None, help="prompt text (default 'Once upon a time')")
    p.add_argument("-f", "--file", help="read the prompt from this file")
    p.add_argument(
        "-n", "--n-predict", type=int, default=128, help="tokens to generate (-1: until full)"
    )
    p.add_argument("-c", "--ctx-size", type=int, default=0, help="context size (0: prompt + n)")
    p.add_argument("--temp", type=float, default=0.8, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("-s", "--seed", type=int, default=-1, help="RNG seed (-1: random)")
    p.add_argument("--no-display-prompt", action="store_true", help="print only generated text")
    p.add_argument(
        "-cnv",
        "--conversation",
        action="store_true",
        help="chat with the model's chat template: -p is the first user turn, then one turn per "
        "line of stdin (a '> ' prompt on a terminal); -n limits each reply",
    )
    p.add_argument("-sys", "--system-prompt", default=None, help="system message (with -cnv)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from powerpy.sampling import SamplingParams

    llm = load_model(args)
    a = llm.model.args
    print(
        f"model: {llm.path.name} ({a.arch}, {a.n_layer} layers, {llm.mode}), "
        f"load {llm.load_seconds:.2f} s",
        file=sys.stderr,
    )
    prompt = args.prompt if args.prompt is not None else "Once upon a time"
    if args.file:
        with open(args.file, encoding="utf-8") as fh:
            prompt = fh.read()
    params = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        seed=None if args.seed < 0 else args.seed,
    )
    if wants_hybrid(args):
        # KV reserved for -c, else for 2048 positions (gen-gpuidx's default, so its index is
        # reused) or what this prompt needs if more
        n_prompt = len(llm.tokenize(prompt))
        need = n_prompt + args.n_predict if args.n_predict > 0 else a.n_ctx_train
        setup_hybrid(llm, args, args.ctx_size or max(a.default_n_ctx, need))
    from powerpy.errors import NonFiniteError

    try:
        if args.conversation:
            first = prompt if args.prompt is not None or args.file else None
            last = converse(llm, args, params, first)
        else:
            from powerpy.generate import stream_generate

            if not args.no_display_prompt:
                sys.stdout.write(prompt)
            last = None
            for last in stream_generate(
                llm.model,
                llm.tokenizer,
                prompt,
                args.n_predict,
                params,
                n_ctx=args.ctx_size or None,
                opts=llm.options,
            ):
                sys.stdout.write(last.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
    except NonFiniteError as e:  # the model does not know its file: name it here
        raise NonFiniteError(f"{llm.path}: {e}") from None
    if last is not None:
        print(
            f"load: {llm.load_seconds:.2f} s | prompt: {last.prompt_tokens} tokens, "
            f"{last.prompt_tps:.2f} tok/s | decode: {last.generation_tokens} tokens, "
            f"{last.generation_tps:.2f} tok/s",
            file=sys.stderr,
        )
    if llm.sparsity is not None and llm.sparse_run:
        import numpy as np

        frac = llm.sparsity.active_fraction()
        print(
            f"active FFN neurons: {100 * float(np.nanmean(frac)):.1f}% (mean over layers; "
            "predicted and not cut)",
            file=sys.stderr,
        )
    return 0


def _user_turns(first: str | None):
    """-p, then one turn per stdin line (prompted with '> ' on a terminal); stops at EOF."""
    if first is not None:
        yield first
    tty = sys.stdin.isatty()
    while True:
        if tty:
            try:
                line = input("> ")
            except EOFError:
                return
        else:
            line = sys.stdin.readline()
            if not line:
                return
        line = line.rstrip("\n")
        if line.strip():
            yield line


def converse(llm, args: argparse.Namespace, params, first: str | None):
    """-cnv: the chat loop (``first``: the -p/-f turn); each reply is streamed and kept in the
    history (and the KV cache). Returns the last ``Response`` (for the speed line) or None."""
    import dataclasses

    chat = llm.chat_session(system=args.system_prompt, n_ctx=args.ctx_size or None)
    last = None
    for turn in _user_turns(first):
        for last in chat.send(turn, args.n_predict, **dataclasses.asdict(params)):
            sys.stdout.write(last.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return last
