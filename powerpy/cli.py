"""Command-line entry point: a thin dispatcher over the subcommand modules in powerpy.commands."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

# subcommand -> module; each module has register(subparsers) and run(args) -> int, and imports
# heavy dependencies (torch, pulp) only inside run(), so `powerpy --help` stays fast.
COMMANDS = {
    "infer": "powerpy.commands.infer",
    "gen-gpuidx": "powerpy.commands.gen_gpuidx",
    "dump": "powerpy.commands.dump",
    "bench": "powerpy.commands.bench",
    "convert": "powerpy.commands.convert",
    "cut": "powerpy.commands.cut",
    "profile": "powerpy.commands.profile",
    "train-predictors": "powerpy.commands.train_predictors",
    "perplexity": "powerpy.commands.perplexity",
    "serve": "powerpy.commands.serve",
    "plan": "powerpy.commands.plan",
}


# Errors that a user's input causes (bad files, flags, values, paths): one line, exit 1. Every
# powerpy input error is a PowerpyError, which is a ValueError.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)
DEBUG_ENV = "POWERPY_DEBUG"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # bad flags: usage and one line, exit 1 (llama.cpp's code)
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="powerpy", description="Hybrid CPU-GPU sparse LLM inference (PowerInfer-compatible)."
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help=f"debug logging and tracebacks (or {DEBUG_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the powerpy CLI and return the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    debug = args.verbose or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        print(f"powerpy {args.command}: error: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:
        print(f"powerpy {args.command}: error: out of memory ({e})", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: say so briefly, the traceback on request
        if debug:
            traceback.print_exc()
        print(
            f"powerpy {args.command}: internal error: {type(e).__name__}: {e}\n"
            f"This is a bug in powerpy; please report it with the traceback "
            f"(rerun with --verbose or {DEBUG_ENV}=1 to print it).",
            file=sys.stderr,
        )
        return 1
