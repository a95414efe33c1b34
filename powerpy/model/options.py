"""How one forward pass runs: options passed per call (or kept by a session), never set on the
model. Two callers sharing one model each pass their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from powerpy.model.numerics import DEFAULT as DEFAULT_NUMERICS
from powerpy.model.numerics import Numerics
from powerpy.model.timing import PhaseTimer

# FFN observer: (layer, ffn_inp (T, n_embd) pre-norm, h (T, n_ff) true activation) -> None
Observer = Callable[[int, Tensor, Tensor], None]
# FFN oracle: (layer, h (T, n_ff) true activation) -> (T, n_ff) bool, the neurons to keep
Oracle = Callable[[int, Tensor], Tensor]


@dataclass
class SparsityStats:
    """Active neuron counts per layer (predicted active and not cut), accumulated over the
    tokens run."""

    n_ff: int
    active: np.ndarray  # (n_layer,) int64: sum of active neurons over tokens
    tokens: np.ndarray  # (n_layer,) int64: tokens gated by the predictor
    last: np.ndarray = field(init=False)  # (n_layer,) active fraction of the last token

    def __post_init__(self) -> None:
        self.last = np.zeros(len(self.active))
        self._pending: list[tuple[int, Tensor]] = []  # (layer, (T,) counts on a device)

    @classmethod
    def empty(cls, n_layer: int, n_ff: int) -> SparsityStats:
        return cls(n_ff, np.zeros(n_layer, np.int64), np.zeros(n_layer, np.int64))

    def record(self, layer: int, act: Tensor) -> None:
        """Count one layer's mask: act (T, n_ff) bool. A mask on a device is counted there and
        read at the end of the forward (:meth:`settle`), so counting adds no wait to a layer."""
        if act.device.type != "cpu":
            self._pending.append((layer, act.sum(dim=1)))
            return
        self.record_counts(layer, act.sum(dim=1))

    def settle(self, to_host: Callable[[Tensor], Tensor] = Tensor.cpu) -> None:
        """Take in the counts made on a device, copied by ``to_host`` (``Model.forward`` calls
        it once its logits are on the host, so the copy finds the device done)."""
        if self._pending:
            pending, self._pending = self._pending, []
            counts = to_host(torch.stack([c for _, c in pending]))  # one copy
            for (layer, _), c in zip(pending, counts, strict=True):
                self.record_counts(layer, c)

    def record_count(self, layer: int, active: int) -> None:
        """Count one token of one layer from its number of active neurons."""
        self.active[layer] += active
        self.tokens[layer] += 1
        self.last[layer] = active / self.n_ff

    def record_counts(self, layer: int, counts: Tensor) -> None:
        """Count tokens of one layer from their numbers of active neurons: counts (T,) int."""
        self.active[layer] += int(counts.sum())
        self.tokens[layer] += counts.numel()
        self.last[layer] = float(counts[-1]) / self.n_ff

    def record_step(self, layers: np.ndarray, counts: np.ndarray) -> None:
        """Count one token of several layers: layers (k,) ids, counts (k,) active neurons."""
        self.active[layers] += counts
        self.tokens[layers] += 1
        self.last[layers] = counts / self.n_ff

    def record_dense(self, layer: int, tokens: int) -> None:
        """Count tokens of a layer that ran ungated (every neuron active)."""
        self.active[layer] += tokens * self.n_ff
        self.tokens[layer] += tokens
        self.last[layer] = 1.0

    def active_fraction(self) -> np.ndarray:
        """Mean predicted-active fraction per layer (NaN where no token was gated)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.active / (self.tokens * self.n_ff)

    def reset(self) -> None:
        self._pending.clear()
        self.active[:] = 0
        self.tokens[:] = 0
        self.last[:] = 0


@dataclass(frozen=True)
class RunOptions:
    """Options of a forward pass.

    Attributes:
        sparse: gate the FFN by the predictors where the model has them (False: dense).
        threshold: predictor cut ``fc2·relu(fc1·x) >= threshold``; None uses the file's.
        observer: called per layer with the FFN input and the true activation (the FFN then
            runs on the host matrices); for profiling.
        timer: per-phase wall-clock accounting (benchmarks).
        stats: where predicted-active counts are recorded (None: not recorded).
        oracle: research: chooses the kept neurons from the true activation instead of the
            predictors (an ideal predictor; the FFN runs on the host matrices, like the
            observer). ``stats`` then record the oracle's masks.
        cut_scale: research: scales the file's per-layer cuts (``powerpy.ffn_down_threshold``)
            in sparse runs; 0 turns them off, larger values skip more neurons.
        numerics: native kernels or torch, llama.cpp's activation rounding or exact f32
            (``--exact-activations``); see :class:`powerpy.model.numerics.Numerics`. The call
            computes with them whatever other calls on the same model use.
        graphs: a fully placed model's decode step is replayed as a captured graph where the
            device can capture one (``powerpy.model.plan``); False (``--no-cuda-graphs``) runs
            the same step eagerly.
        defer_cold: a hybrid decode step adds each layer's cold rows (the host's share of its
            FFN or experts) to the residual stream one layer later, after the next layer's
            FFN, so that the CPU's task runs while the device computes the next layer's
            attention and hot rows ("expert deferral"). It changes what the model
            computes (the next layer reads the stream without them); a step that cannot defer
            (a layer normalizes its FFN's output) runs undeferred, with a warning. Only the
            device step of a decode plan defers (``powerpy.model.plan``).
    """

    sparse: bool = True
    threshold: float | None = None
    observer: Observer | None = None
    timer: PhaseTimer | None = None
    stats: SparsityStats | None = None
    oracle: Oracle | None = None
    cut_scale: float = 1.0
    numerics: Numerics = DEFAULT_NUMERICS
    graphs: bool = True
    defer_cold: bool = False

    def __post_init__(self) -> None:
        if not (self.cut_scale >= 0 and self.cut_scale < float("inf")):
            raise ValueError(f"cut_scale {self.cut_scale} must be finite and >= 0")


SPARSE = RunOptions()  # the default: gate where the model has predictors
DENSE = RunOptions(sparse=False)
