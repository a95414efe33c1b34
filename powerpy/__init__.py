"""powerpy: hybrid CPU-GPU sparse LLM inference, compatible with PowerInfer files.

    import powerpy
    llm = powerpy.load()                  # or powerpy.load("model.powerinfer.gguf")
    print(llm.generate("Once upon a time", max_tokens=32, temperature=0))
    for r in llm.stream("The Lord is", 16):
        print(r.text, end="")

Importing powerpy is cheap and changes no global state; torch is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load": "powerpy.api",
    "LLM": "powerpy.api",
    "bench": "powerpy.benchmark",
    "ChatSession": "powerpy.chat",
    "generate": "powerpy.generate",
    "stream_generate": "powerpy.generate",
    "generate_step": "powerpy.generate",
    "Response": "powerpy.generate",
    "SamplingParams": "powerpy.sampling",
    "read_gguf": "powerpy.formats.gguf_reader",
    "Placement": "powerpy.placement.placement",
    "build_hybrid": "powerpy.placement.runtime",
    "place": "powerpy.placement.runtime",
    "RunOptions": "powerpy.model.options",
    "KVCache": "powerpy.model.cache",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'powerpy' has no attribute {name!r}")
