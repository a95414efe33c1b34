"""Model builders for tests, tools and notebooks: tiny random models (``tiny``) and synthetic
PWRI models with calibrated predictors and power-law hot neurons (``synthetic``). The load-path
fuzzer is the subpackage ``fuzz``, which this package does not import."""

from powerpy.testing.tiny import (
    BYTE_VOCAB,
    TinySpec,
    spec_args,
    tiny_kv,
    tiny_tensors,
    vocab_kv,
    write_tiny_model,
    write_zero_model,
)

__all__ = [
    "BYTE_VOCAB",
    "TinySpec",
    "spec_args",
    "tiny_kv",
    "tiny_tensors",
    "vocab_kv",
    "write_tiny_model",
    "write_zero_model",
]
