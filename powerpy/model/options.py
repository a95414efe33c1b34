"""How one forward pass runs: options passed per call (or kept by a session), never set on the
model. Two callers sharing one model each pass their own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from torch import Tensor

from powerpy.model.timing import PhaseTimer

# FFN observer: (layer, ffn_inp (T, n_embd) pre-norm, h (T, n_ff) true activation) -> None
Observer = Callable[[int, Tensor, Tensor], None]
# FFN oracle: (layer, h (T, n_ff) true activation) -> (T, n_ff) bool, the neurons to keep
Oracle = Callable[[int, Tensor], Tensor]


@dataclass
class SparsityStats:
    """Predicted-active neuron counts per layer, accumulated over the tokens run."""

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
        counts = act.sum(dim=1)  # (T,)
        self.active[layer] += int(counts.sum())
        self.tokens[layer] += act.shape[0]
        self.last[layer] = float(counts[-1]) / self.n_ff

    def record_count(self, layer: int, active: int) -> None:
        """Count one token of one layer from its number of active neurons."""
        self.active[layer] += active
        self.tokens[layer] += 1
        self.last[layer] = active / self.n_ff

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
    """

    sparse: bool = True
    threshold: float | None = None
    observer: Observer | None = None
    timer: PhaseTimer | None = None
    stats: SparsityStats | None = None
    oracle: Oracle | None = None


SPARSE = RunOptions()  # the default: gate where the model has predictors
DENSE = RunOptions(sparse=False)
