"""Weight matrices as the runtime computes with them: ``(rows, cols)``, rows = output features.

FFN matrices are neuron-major ``(n_ff, n_embd)`` (gate, up and down_t), so the sparse FFN is a
row gather: ``gather_linear`` computes selected rows of ``W @ x`` and ``gather_axpy`` sums
selected rows scaled by ``h``. Quantized weights keep their raw ggml blocks.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from powerpy.constants import TYPE_TRAITS, GGMLType


class DenseWeight:
    """A float matrix (f32, f16 or bf16) of shape ``(rows, cols)``."""

    def __init__(self, w: Tensor) -> None:
        assert w.dim() == 2, w.shape
        self.w = w  # (rows, cols)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.w.shape)  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.w.numel() * self.w.element_size()

    @property
    def device(self) -> torch.device:
        return self.w.device

    def linear(self, x: Tensor) -> Tensor:
        """``x @ W.T``: x (T, cols) f32 -> (T, rows) f32."""
        if self.w.dtype == torch.float32:
            return F.linear(x, self.w)
        return F.linear(x.to(self.w.dtype), self.w).float()

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` of ``W @ x``: x (cols,), idx (k,) int64 -> (k,) f32."""
        rows = torch.index_select(self.w, 0, idx)  # (k, cols)
        return F.linear(x.to(rows.dtype)[None], rows)[0].float()

    def gather_axpy(self, h: Tensor, idx: Tensor) -> Tensor:
        """``sum_j h[j] * W[idx[j]]``: h (k,) f32, idx (k,) -> (cols,) f32."""
        out = F.embedding_bag(
            idx[None], self.w, per_sample_weights=h.to(self.w.dtype)[None], mode="sum"
        )
        return out[0].float()

    def take_rows(self, idx: Tensor) -> DenseWeight:
        return DenseWeight(torch.index_select(self.w, 0, idx).contiguous())

    def dequantize(self) -> Tensor:
        return self.w.float()

    def to(self, device: torch.device | str) -> DenseWeight:
        return DenseWeight(self.w.to(device))


class QuantWeight:
    """Raw ggml blocks ``(rows, row_bytes)`` uint8 of a quantized ``(rows, cols)`` matrix.

    This is the portable fallback: it dequantizes only the rows it touches.
    """

    def __init__(self, raw: Tensor, ggml_type: GGMLType, cols: int) -> None:
        tr = TYPE_TRAITS[ggml_type]
        assert raw.dtype == torch.uint8 and raw.dim() == 2
        assert raw.shape[1] == cols // tr.block_size * tr.type_size, (raw.shape, cols)
        self.raw = raw  # (rows, row_bytes)
        self.ggml_type = ggml_type
        self.cols = cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.raw.shape[0], self.cols)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def _rows_f32(self, raw: Tensor) -> Tensor:
        from powerpy.quants import dequantize

        arr = dequantize(raw.cpu().numpy(), self.ggml_type, (raw.shape[0], self.cols))
        return torch.from_numpy(np.ascontiguousarray(arr)).to(raw.device)

    def linear(self, x: Tensor, chunk: int = 4096) -> Tensor:
        out = x.new_empty(x.shape[0], self.shape[0])
        for s in range(0, self.shape[0], chunk):
            out[:, s : s + chunk] = F.linear(x, self._rows_f32(self.raw[s : s + chunk]))
        return out

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        return F.linear(x[None], self._rows_f32(torch.index_select(self.raw, 0, idx)))[0]

    def gather_axpy(self, h: Tensor, idx: Tensor) -> Tensor:
        return h @ self._rows_f32(torch.index_select(self.raw, 0, idx))

    def take_rows(self, idx: Tensor) -> QuantWeight:
        return QuantWeight(
            torch.index_select(self.raw, 0, idx).contiguous(), self.ggml_type, self.cols
        )

    def dequantize(self) -> Tensor:
        return self._rows_f32(self.raw)

    def to(self, device: torch.device | str) -> QuantWeight:
        return QuantWeight(self.raw.to(device), self.ggml_type, self.cols)


Weight = DenseWeight | QuantWeight


def glu_rows(x: Tensor, gate: Weight, up: Weight, idx: Tensor, variant: str) -> Tensor:
    """h over rows ``idx``: x (cols,), idx (k,) -> (k,) f32 (torch fallback)."""
    from powerpy.sparse_ffn import glu

    return glu(gate.gather_linear(x, idx), up.gather_linear(x, idx), variant)
