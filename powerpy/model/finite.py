"""The finiteness check of a forward's diagnosis pass (``Model._checked``): which step made the
residual stream NaN or infinite."""

from __future__ import annotations

import torch
from torch import Tensor

from powerpy.errors import NonFiniteError


def check_finite(x: Tensor, where: str, what: str) -> None:
    """Raise ``NonFiniteError`` when ``x`` holds a NaN or an infinity (diagnosis only)."""
    bad = ~torch.isfinite(x)
    if bool(bad.any()):
        kind = "NaN" if bool(torch.isnan(x).any()) else "infinite"
        raise NonFiniteError(
            f"the residual stream became {kind} at {where}, in {what}: the model's weights "
            f"there are corrupt or out of range (NaN or huge values, data of another type, a "
            f"wrong alignment); check the file (`powerpy dump`) or re-convert the model"
        )
