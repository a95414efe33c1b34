"""Command-line entry point: a thin dispatcher over the subcommand modules in powerpy.commands."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module; each module has register(subparsers) and run(args) -> int, and imports
# heavy dependencies (torch, pulp) only inside run(), so `powerpy --help` stays fast.
COMMANDS = {
    "infer": "powerpy.commands.infer",
    "gen-gpuidx": "powerpy.commands.gen_gpuidx",
    "dump": "powerpy.commands.dump",
    "bench": "powerpy.commands.bench",
    "convert": "powerpy.commands.convert",
    "profile": "powerpy.commands.profile",
    "train-predictors": "powerpy.commands.train_predictors",
    "perplexity": "powerpy.commands.perplexity",
    "serve": "powerpy.commands.serve",
}


class UserError(Exception):
    """An error to report as one line, without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="powerpy", description="Hybrid CPU-GPU sparse LLM inference (PowerInfer-compatible)."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
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
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (UserError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as e:
        print(f"powerpy {args.command}: error: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:
        print(f"powerpy {args.command}: error: out of memory ({e})", file=sys.stderr)
        return 1
