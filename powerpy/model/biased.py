"""Matrices made of a stored one: with a bias per output row (``BiasedWeight``), and row views of
a fused matrix (``row_slices``)."""

from __future__ import annotations

import torch
from torch import Tensor

from powerpy.model.matrices import DenseWeight, QuantWeight, Weight, _as_idx


class BiasedWeight:
    """A matrix with a bias per output row: ``linear`` is ``x @ W.T + b`` (OPT's q/k/v/output
    and ``ffn_up``, Falcon's where its config has biases). The bias follows every row selection
    (``gather_linear``, ``take_rows``) and device copy (``with_storage``), so code that computes
    with rows of W needs no separate bias. The native block kernels read no bias: ``kernel()``
    is None, and products go through the inner matrix's kernels plus one add."""

    def __init__(self, inner: DenseWeight | QuantWeight, bias: Tensor) -> None:
        assert bias.shape == (inner.shape[0],), (bias.shape, inner.shape)
        self.inner = inner  # (rows, cols)
        self.bias = bias  # (rows,) f32, on the inner matrix's device

    @property
    def shape(self) -> tuple[int, int]:
        return self.inner.shape

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.bias.numel() * self.bias.element_size()

    @property
    def device(self) -> torch.device:
        return self.inner.device

    def kernel(self) -> None:
        return None  # the block kernels read no bias

    def linear(self, x: Tensor, need: Tensor | None = None) -> Tensor:
        """``x @ W.T + b``: x (T, cols) -> (T, rows) f32 (``need``: as the inner matrix's)."""
        return self.inner.linear(x, need).add_(self.bias)

    def gather_linear(self, x: Tensor, idx: Tensor) -> Tensor:
        """Rows ``idx`` of ``W @ x + b``: x (cols,), idx (k,) -> (k,) f32."""
        return self.inner.gather_linear(x, idx).add_(self.bias[_as_idx(idx)])

    def gather_axpy(self, h: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
        raise TypeError("a row bias belongs to linear(), not to a row sum")

    def rows_sum(self, h: Tensor) -> Tensor:
        raise TypeError("a row bias belongs to linear(), not to a row sum")

    def take_rows(self, idx: Tensor) -> BiasedWeight:
        """Rows ``idx`` with their biases."""
        idx = _as_idx(idx)
        return BiasedWeight(self.inner.take_rows(idx), self.bias.index_select(0, idx))

    def dequantize(self) -> Tensor:
        """W alone as f32 (rows, cols)."""
        return self.inner.dequantize()

    @property
    def storage(self) -> Tensor:
        """The tensor holding W (the bias is small and travels with it)."""
        return self.inner.storage

    def with_storage(self, t: Tensor) -> BiasedWeight:
        """The same matrix over another copy of W, its bias copied to the same device."""
        return BiasedWeight(self.inner.with_storage(t), self.bias.to(t.device))


def row_slices(
    w: DenseWeight | QuantWeight, sizes: tuple[int, ...], repack: bool = True
) -> list[Weight]:
    """Consecutive row blocks of ``w`` (a fused q/k/v matrix) as views, not copies: ``sizes``
    rows each, in order; they must add up to ``w``'s rows. ``repack`` False: quantized blocks
    keep their rows in whole-matrix products (``QuantWeight``'s, a 3-D tensor's matrices)."""
    assert sum(sizes) == w.shape[0], (sizes, w.shape)
    out, s = [], 0
    for n in sizes:
        if isinstance(w, QuantWeight):
            out.append(
                QuantWeight(w.raw[s : s + n], w.ggml_type, w.cols, repack=repack, pages=w.pages)
            )
        else:
            out.append(DenseWeight(w.w[s : s + n]))
        s += n
    return out
