"""How one forward pass runs: options passed per call (or kept by a session), never set on the
model. Two callers sharing one model each pass their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
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

    @classmethod
    def empty(cls, n_layer: int, n_ff: int) -> SparsityStats:
        return cls(n_ff, np.zeros(n_layer, np.int64), np.zeros(n_layer, np.int64))

    def record(self, layer: int, act: Tensor) -> None:
        """Count one layer's mask: act (T, n_ff) bool, on the host."""
        self.record_counts(layer, act.sum(dim=1))

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
    """

    sparse: bool = True
    threshold: float | None = None
    observer: Observer | None = None
    timer: PhaseTimer | None = None
    stats: SparsityStats | None = None
    oracle: Oracle | None = None
    cut_scale: float = 1.0
    numerics: Numerics = DEFAULT_NUMERICS

    def __post_init__(self) -> None:
        if not (self.cut_scale >= 0 and self.cut_scale < float("inf")):
            raise ValueError(f"cut_scale {self.cut_scale} must be finite and >= 0")


SPARSE = RunOptions()  # the default: gate where the model has predictors
DENSE = RunOptions(sparse=False)
