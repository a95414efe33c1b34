"""Exceptions powerpy raises for bad inputs; all are ``ValueError`` subclasses."""

from __future__ import annotations

from typing import Any

__all__ = [
    "FileFormatError",
    "ModelConfigError",
    "NonFiniteError",
    "PlacementError",
    "PowerpyError",
    "StatsError",
    "TokenizerError",
    "shown",
]


def shown(v: Any) -> str:
    """``v`` as an error message shows it: its repr, cut to 40 characters."""
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


class PowerpyError(ValueError):
    """Base class of powerpy's input errors."""


class FileFormatError(PowerpyError):
    """A model, gpuidx or stats file is malformed or of an unsupported kind."""


class ModelConfigError(PowerpyError):
    """Model hyperparameters (GGUF keys or HF config) are missing or inconsistent."""


class TokenizerError(PowerpyError):
    """The ``tokenizer.*`` metadata is missing, malformed or unsupported."""


class PlacementError(PowerpyError):
    """A GPU placement (budget, gpuidx) cannot be made or does not fit the model."""


class StatsError(PowerpyError):
    """Activation statistics are missing, malformed or do not match the model."""


class NonFiniteError(PowerpyError):
    """A forward pass produced NaN or infinite values (corrupt or out-of-range weights)."""
