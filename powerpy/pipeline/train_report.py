"""What predictor training measured: per-layer held-out metrics, saved in ``config.json``."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from powerpy._fs import read_json
from powerpy.pipeline.predictors import CONFIG_ACTIVATION, CONFIG_THRESHOLD, PREDICTOR_CONFIG
from powerpy.pipeline.profile import KIND_RELU


@dataclass
class LayerReport:
    """Held-out metrics of one layer's exported predictor at the runtime threshold."""

    layer: int
    hidden: int
    recall: float
    precision: float
    pred_active: float  # fraction of neurons predicted active per token
    true_active: float  # fraction of neurons labelled active per token
    epochs: int
    n_train: int
    n_val: int


@dataclass
class TrainReport:
    """Per-layer held-out metrics of a predictor set (``train_predictors`` or ``load``).

    Attributes:
        kind: "relu" or "silu" (the labels' rule).
        layers: one report per trained layer.
        magnitude_thresholds: SiLU label thresholds per layer.
        model: the model's name (for titles).
        threshold: the runtime predictor threshold the metrics were taken at.
        directory: the predictor directory, where known.
    """

    kind: str
    layers: list[LayerReport] = field(default_factory=list)
    magnitude_thresholds: list[float] | None = None
    model: str = ""
    threshold: float | None = None
    directory: str | None = None

    @classmethod
    def load(cls, pred_dir: str | os.PathLike[str], model: str = "") -> TrainReport:
        """The report saved in a predictor directory's ``config.json`` by training.

        Raises:
            FileNotFoundError: no config.json. ValueError: a config without training metrics
                (predictors not trained by powerpy).
        """
        path = Path(pred_dir) / PREDICTOR_CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: is {pred_dir} a predictor directory?")
        cfg = read_json(path)
        run = cfg.get("powerpy")
        if not isinstance(run, dict) or not isinstance(run.get("layers"), list):
            raise ValueError(
                f'{path} has no training metrics (a "powerpy" section with "layers"): '
                "these predictors were not trained by powerpy train-predictors"
            )
        try:
            layers = [LayerReport(**r) for r in run["layers"]]
        except TypeError as e:
            raise ValueError(f"{path}: malformed layer metrics ({e})") from None
        kind = cfg.get(CONFIG_ACTIVATION) or KIND_RELU
        thr = cfg.get(CONFIG_THRESHOLD)
        return cls(kind, layers, cfg.get("magnitude_thresholds"), model, thr, str(pred_dir))

    def __repr__(self) -> str:
        s = self.summary()
        recall = f", mean recall {s['recall_mean']:.4f}" if s else ""
        return f"<TrainReport {self.model or 'model'}: {len(self.layers)} layers{recall}>"

    def _repr_html_(self) -> str:
        from powerpy import _html

        rows = [
            (
                r.layer,
                r.hidden,
                f"{r.recall:.4f}",
                f"{r.precision:.4f}",
                _html.pct(r.pred_active),
                _html.pct(r.true_active),
                r.epochs,
            )
            for r in self.layers
        ]
        s = self.summary()
        notes = []
        if s:
            notes.append(
                f"mean recall {s['recall_mean']:.4f} (min {s['recall_min']:.4f}), precision "
                f"{s['precision_mean']:.4f}; predicted active {_html.pct(s['pred_active_mean'])} "
                f"vs true {_html.pct(s['true_active_mean'])}"
            )
        return _html.table(
            f"{self.model or 'model'}: predictors ({self.kind} labels)",
            ("layer", "H", "recall", "precision", "predicted active", "true active", "epochs"),
            rows,
            notes=notes,
        )

    def summary(self) -> dict[str, float]:
        """Mean recall/precision/active fractions over layers, and the min recall."""
        if not self.layers:
            return {}
        rec = [r.recall for r in self.layers]
        return {
            "recall_mean": float(np.mean(rec)),
            "recall_min": float(np.min(rec)),
            "precision_mean": float(np.mean([r.precision for r in self.layers])),
            "pred_active_mean": float(np.mean([r.pred_active for r in self.layers])),
            "true_active_mean": float(np.mean([r.true_active for r in self.layers])),
        }
