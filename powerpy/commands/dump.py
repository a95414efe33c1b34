"""`powerpy dump FILE`: print the header, key/values and tensor table of a GGUF or PWRI file.

Understands PowerInfer files (magic PWRI, I32 = type id 18) including ``.generated.gpuidx``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

MAX_ITEMS = 8  # array items shown before "..."
MAX_STRING = 80  # characters of a string value shown


def register(subparsers: Any) -> None:
    """Add the ``dump`` subcommand to the powerpy CLI."""
    parser = subparsers.add_parser(
        "dump", help="print the key/values and tensor table of a GGUF/PWRI file"
    )
    parser.add_argument("file", help="a .gguf, .powerinfer.gguf or .gpuidx file")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--kv-only", action="store_true", help="print the header and key/values")
    only.add_argument("--tensors-only", action="store_true", help="print the tensor table only")
    parser.add_argument(
        "--max-items", type=int, default=MAX_ITEMS, metavar="N", help="array items to show"
    )
    parser.set_defaults(func=run)


def _short(value: Any, max_items: int) -> str:
    import numpy as np

    if isinstance(value, str):
        text = value if len(value) <= MAX_STRING else value[:MAX_STRING] + "..."
        return repr(text)
    if isinstance(value, (list, np.ndarray)):
        items = [
            _short(v.item() if isinstance(v, np.generic) else v, max_items)
            for v in value[:max_items]
        ]
        more = ", ..." if len(value) > max_items else ""
        return f"[{', '.join(items)}{more}]"
    return repr(value)


def dump(
    path: str,
    *,
    kv: bool = True,
    tensors: bool = True,
    max_items: int = MAX_ITEMS,
    out: TextIO | None = None,
) -> None:
    """Print a file's header, key/values and/or tensor table.

    Args:
        path: GGUF or PWRI file.
        kv: print the header and key/values.
        tensors: print the tensor table.
        max_items: array items shown per key.
        out: stream (default stdout).

    Raises:
        GGUFFormatError, FileNotFoundError: from ``read_gguf``.
    """
    from powerpy.formats.constants import GGUFValueType
    from powerpy.formats.gguf_reader import read_gguf

    out = out or sys.stdout
    with read_gguf(path) as f:
        if kv:
            size = f.path.stat().st_size
            mode = "sparse, PowerInfer" if f.sparse else "dense"
            print(f"file:        {f.path} ({size} bytes)", file=out)
            print(f"magic:       {f.magic.decode()} ({mode})", file=out)
            print(f"version:     {f.version}", file=out)
            print(f"sparse:      {f.sparse}", file=out)
            print(f"alignment:   {f.alignment}", file=out)
            print(f"data offset: {f.data_offset}", file=out)
            print(f"key/values:  {len(f.kv)}", file=out)
            types = {}
            for key, value in f.kv.items():
                vtype = f.kv_types[key]
                if vtype is GGUFValueType.ARRAY:
                    types[key] = f"ARRAY[{f.kv_array_types[key].name}] ({len(value)})"
                else:
                    types[key] = vtype.name
            kw = max((len(k) for k in f.kv), default=0)
            tw = max((len(t) for t in types.values()), default=0)
            for key, value in f.kv.items():
                print(f"  {key:<{kw}}  {types[key]:<{tw}} = {_short(value, max_items)}", file=out)
        if tensors:
            if kv:
                print(file=out)
            rows = [("name", "ne (ggml)", "shape (numpy)", "type (id)", "offset", "bytes")]
            for t in f.tensors.values():
                rows.append(
                    (
                        t.name,
                        str(list(t.ne)),
                        str(t.shape),
                        f"{t.ggml_type.name} ({t.file_type_id})",
                        str(t.offset),
                        str(t.nbytes),
                    )
                )
            total = sum(t.nbytes for t in f.tensors.values())
            print(f"tensors:     {len(f.tensors)} ({total} bytes of data)", file=out)
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            for r in rows:
                left = [f"{c:<{w}}" for c, w in zip(r[:4], widths[:4], strict=True)]
                right = [f"{c:>{w}}" for c, w in zip(r[4:], widths[4:], strict=True)]
                print("  " + "  ".join(left + right).rstrip(), file=out)


def run(args: argparse.Namespace) -> int:
    """Run ``powerpy dump`` with parsed arguments; returns the exit code."""
    dump(
        args.file,
        kv=not args.tensors_only,
        tensors=not args.kv_only,
        max_items=args.max_items,
    )
    return 0
