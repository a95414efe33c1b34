"""powerpy.plot and the research API behind it: profile, coverage curve, predictor report,
sparsity and oracle sweeps, bench phases; HTML reprs; ``--plot`` on the CLI commands."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import powerpy
from powerpy.cli import main
from powerpy.pipeline import research
from powerpy.pipeline.corpus import kjv_text

pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402

from powerpy import plot  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KJV = ROOT / "models" / "kjv-relu" / "kjv-relu.powerinfer.gguf"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def llm():
    return powerpy.load(KJV)


@pytest.fixture(scope="module")
def prof(llm):
    return research.profile(llm, kjv_text("train"), tokens=2048, progress=False)


@pytest.fixture(scope="module")
def sweeps(llm):
    held = llm.tokenize(kjv_text("heldout")[:60_000], add_bos=False)
    pred = research.sparsity_sweep(llm, held, [-1.0, 0.0, 1.0], chunks=2, progress=False)
    orc = research.sparsity_sweep(llm, held, oracle=[0.5, 0.99], chunks=2, progress=False)
    return pred, orc


def _lines(fig: Figure):
    return fig.axes[0].get_lines()


def test_import_powerpy_does_not_import_matplotlib() -> None:
    code = "import powerpy, sys; from powerpy import plot; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_power_law_plots_the_sorted_counts(prof) -> None:
    fig = plot.power_law(prof)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    assert "rank" in ax.get_xlabel() and "share of tokens" in ax.get_ylabel()
    assert prof.model in ax.get_title()
    curves = [ln for ln in _lines(fig) if ln.get_label().startswith("layer")]
    assert len(curves) == len(prof.counts)
    for line, counts in zip(curves, prof.counts, strict=True):
        want = np.sort(counts)[::-1] / prof.n_tokens
        np.testing.assert_array_equal(line.get_ydata(), want)
    cov = prof.top_coverage(0.1)
    k = round(0.1 * len(prof.counts[0]))
    for c, counts in zip(cov, prof.counts, strict=True):
        assert c == pytest.approx(np.sort(counts)[::-1][:k].sum() / counts.sum())
    text = " ".join(t.get_text() for t in fig.axes[0].texts)
    assert f"{100 * cov.mean():.1f}%" in text


def test_power_law_draws_into_a_given_axes_and_many_layers_get_a_colour_bar(prof) -> None:
    fig = Figure()
    ax = fig.add_subplot()
    assert plot.power_law(prof, ax=ax) is fig and len(ax.get_lines()) >= len(prof.counts)
    many = type(prof)(prof.kind, prof.n_embd, prof.counts * 4, prof.n_tokens, None, None)
    fig2 = plot.power_law(many)
    assert len(fig2.axes) == 2 and fig2.axes[1].get_ylabel() == "layer"  # the colour bar


def test_coverage_curve_matches_the_solver_at_each_budget(llm, prof) -> None:
    from powerpy.placement.coverage import coverage_curve
    from powerpy.placement.placement import Placement
    from powerpy.placement.solve import solve_placement

    curve = coverage_curve(llm.file, prof.counts, n_ctx=256, points=6)
    assert curve.coverage[0] == 0.0 and curve.coverage[-1] == pytest.approx(1.0)
    assert np.all(np.diff(curve.coverage) >= -1e-12)  # more budget never covers less
    b = int(curve.budgets[3])
    p = solve_placement(Placement.for_model(llm.file, b, n_ctx=256), prof.counts, batch=16)
    assert curve.coverage[3] == pytest.approx(p.total_coverage)
    at = curve.budget_for(0.8)
    assert at is not None and curve.budgets[0] < at <= curve.budgets[-1]
    assert curve.budget_for(1.01) is None
    fig = plot.coverage_vs_budget(curve, mark=b)
    (line,) = [ln for ln in _lines(fig) if len(ln.get_xdata()) == len(curve.budgets)]
    np.testing.assert_allclose(line.get_ydata(), 100 * curve.coverage)
    assert "VRAM budget (MiB)" == fig.axes[0].get_xlabel()
    assert "%" in fig.axes[0].get_ylabel()
    fig2 = plot.coverage_vs_budget(llm, prof)  # from the LLM and the profile directly
    assert fig2.axes[0].get_title().startswith("kjv-relu")
    with pytest.raises(plot.PlotError, match="profile"):
        plot.coverage_vs_budget(llm)


def test_predictor_quality_plots_the_report(tmp_path) -> None:
    from powerpy.pipeline.train_report import LayerReport, TrainReport

    layers = [LayerReport(l, 64, 0.9 - l / 100, 0.3, 0.1, 0.03, 5, 100, 10) for l in range(4)]
    rep = TrainReport("relu", layers, model="m", threshold=0.0)
    fig = plot.predictor_quality(rep)
    by_label = {ln.get_label(): ln for ln in _lines(fig)}
    np.testing.assert_allclose(by_label["recall"].get_ydata(), [90, 89, 88, 87])
    np.testing.assert_allclose(by_label["true active"].get_ydata(), [3] * 4)
    assert fig.axes[0].get_xlabel() == "layer" and "threshold 0" in fig.axes[0].get_title()
    assert "<table" in rep._repr_html_() and "0.8700" in rep._repr_html_()
    with pytest.raises(plot.PlotError):
        plot.predictor_quality(TrainReport("relu"))


def test_train_report_round_trips_through_the_predictor_directory(tmp_path) -> None:
    from powerpy.pipeline.train_report import TrainReport

    shipped = TrainReport.load(ROOT / "models" / "kjv-relu" / "predictor", model="kjv")
    assert len(shipped.layers) == 4 and all(0 < r.recall <= 1 for r in shipped.layers)
    with pytest.raises(FileNotFoundError, match="config.json"):
        TrainReport.load(tmp_path)
    (tmp_path / "config.json").write_text('{"sparse_threshold": 0}')
    with pytest.raises(ValueError, match="no training metrics"):
        TrainReport.load(tmp_path)


def test_sweeps_measure_the_tradeoff(sweeps) -> None:
    pred, orc = sweeps
    assert [p.setting for p in pred.points] == [-1.0, 0.0, 1.0]
    skipped = pred.skipped
    assert np.all(np.diff(skipped) > 0)  # a higher threshold skips more
    assert pred.points[0].increase == pytest.approx(0.0, abs=1e-3)  # ReLU: lossless there
    assert pred.points[-1].increase > 0.05
    assert orc.kind == "oracle" and orc.points[1].skipped > 0.98
    # the +3% reading interpolates between the points around the crossing
    lo, hi = pred.points[1], pred.points[2]
    want = lo.skipped + (hi.skipped - lo.skipped) * (0.03 - lo.increase) / (
        hi.increase - lo.increase
    )
    assert pred.skipped_at(0.03) == pytest.approx(want)
    assert "skipped at +3% perplexity" in pred.table()
    fig = plot.tradeoff(pred, orc)
    curves = [ln for ln in _lines(fig) if len(ln.get_xdata()) > 1]
    np.testing.assert_allclose(curves[0].get_ydata()[1:], 100 * pred.increase)
    np.testing.assert_allclose(curves[0].get_xdata()[1:], 100 * (1 - pred.skipped))
    assert "perplexity" in fig.axes[0].get_ylabel()
    assert "<table" in pred._repr_html_()


def test_skipped_at_reads_the_first_crossing() -> None:
    from powerpy.pipeline.sweep import SweepPoint, SweepResult

    pts = [SweepPoint(0, 1, 0.2, 0.01), SweepPoint(1, 1, 0.6, 0.05), SweepPoint(2, 1, 0.9, 0.5)]
    s = SweepResult("m", "predictors", 1.0, pts)
    assert s.skipped_at(0.03) == pytest.approx(0.4)
    assert s.skipped_at(1.0) == pytest.approx(0.9)  # never crossed: the curve's end
    assert s.skipped_at(0.005) == pytest.approx(0.1)  # before the first point: from dense


def test_oracle_keeps_the_top_scores_and_is_lossless_at_zero_skip(llm) -> None:
    import torch

    from powerpy.model.options import DENSE, RunOptions
    from powerpy.pipeline.sweep import topk_oracle

    ids = torch.tensor(llm.tokenize("And God said, Let there be light")[:16])
    dense = llm.model.forward(ids, llm.model.new_cache(16), DENSE, all_logits=True)
    zero = RunOptions(sparse=False, oracle=topk_oracle(llm.model, 0.0))
    got = llm.model.forward(ids, llm.model.new_cache(16), zero, all_logits=True)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    oracle = topk_oracle(llm.model, 0.75)
    h = torch.randn(3, llm.model.args.n_ff)
    mask = oracle(0, h)
    assert mask.sum(1).tolist() == [128, 128, 128]  # 25% of 512
    with pytest.raises(ValueError):
        topk_oracle(llm.model, 1.0)


def test_phases_stack_the_bench_timings(llm) -> None:
    res = powerpy.bench(llm, n_prompt=8, n_gen=4)
    assert [r.mode for r in res.rows] == ["sparse", "sparse", "dense", "dense"]
    fig = plot.phases(res)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "ms per token"
    bars = ax.patches
    assert len(bars) == 2 * len(plot.PHASES)
    for y, row in enumerate([res.tg("sparse"), res.tg("dense")]):
        widths = [b.get_width() for b in bars[y * len(plot.PHASES) : (y + 1) * len(plot.PHASES)]]
        assert widths == pytest.approx(list(plot.phase_ms(row.phases_ms).values()))
    assert "<table" in res._repr_html_() and "tok/s" in res._repr_html_()


def test_html_reprs_of_llm_profile_and_placement(llm, prof) -> None:
    from powerpy.placement.placement import Placement
    from powerpy.placement.solve import solve_placement

    html = llm._repr_html_()
    assert "kjv-relu" in html and "<table" in html and "sparse, threshold 0" in html
    assert repr(llm) == "<LLM kjv-relu: llama, 4 layers, sparse, threshold 0>"
    assert "top-10% coverage" in prof._repr_html_()
    p = solve_placement(Placement.for_model(llm.file, 2_200_000, n_ctx=256), prof.counts, batch=16)
    html = p._repr_html_()
    assert "hot neurons per layer" in html and "hot_ffn" in html


def test_save_is_atomic_and_checks_the_name(tmp_path, prof) -> None:
    fig = plot.power_law(prof)
    out = plot.save(fig, tmp_path / "a.png")
    assert out.read_bytes().startswith(PNG)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]  # no temporary left
    with pytest.raises(plot.PlotError, match=r"\.png"):
        plot.save(fig, tmp_path / "a.jpg")
    with pytest.raises(FileNotFoundError):
        plot.save(fig, tmp_path / "missing" / "a.png")

    class Boom(Exception):
        pass

    def fail(*a, **k):
        raise Boom

    out.write_bytes(b"old")
    fig.savefig = fail
    with pytest.raises(Boom):
        plot.save(fig, out)
    assert out.read_bytes() == b"old"  # the old file survives a failed write
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"]


@pytest.mark.parametrize(
    "cmd",
    [
        ["profile", "-m", str(KJV), "--kjv", "--tokens", "512", "-o", "{tmp}/prof"],
        ["perplexity", "-m", str(KJV), "--kjv", "--ctx", "128", "--chunks", "2"],
        [
            "perplexity",
            "-m",
            str(KJV),
            "--kjv",
            "-c",
            "128",
            "--chunks",
            "2",
            "--sweep",
            "-1",
            "0",
            "--oracle",
            "0.5",
        ],
        ["bench", "-m", str(KJV), "-p", "8", "-n", "4"],
        [
            "gen-gpuidx",
            "-m",
            str(KJV),
            "--vram-budget",
            "0.002",
            "--ctx",
            "256",
            "--batch",
            "16",
            "-o",
            "{tmp}/x.gpuidx",
        ],
        [
            "train-predictors",
            "-m",
            str(KJV),
            "--kjv",
            "--tokens",
            "1024",
            "--epochs",
            "1",
            "--hidden",
            "32",
            "-o",
            "{tmp}/pred",
        ],
    ],
    ids=["profile", "perplexity", "perplexity-sweep", "bench", "gen-gpuidx", "train-predictors"],
)
def test_cli_plot_writes_a_png(cmd, tmp_path, capsys) -> None:
    out = tmp_path / "fig.png"
    argv = [c.format(tmp=tmp_path) for c in cmd] + ["--plot", str(out)]
    assert main(argv) == 0
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 10_000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fig.png")]
    assert f"wrote plot {out}" in capsys.readouterr().err


def test_cli_plot_fails_before_the_work(tmp_path, capsys) -> None:
    argv = ["profile", "-m", str(KJV), "--kjv", "-o", str(tmp_path / "p")]
    assert main([*argv, "--plot", str(tmp_path / "no" / "f.png")]) == 1
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()  # nothing was profiled
    assert main(["perplexity", "-m", str(KJV), "--kjv", "--oracle", "1.5"]) == 1
    assert "[0, 1)" in capsys.readouterr().err


def test_sweep_settings_are_checked(llm) -> None:
    from powerpy.pipeline.sweep import oracle_sweep, sparsity_sweep

    ids = llm.tokenize(kjv_text("heldout")[:20_000], add_bos=False)
    with pytest.raises(ValueError, match="NaN"):
        sparsity_sweep(llm.model, ids, [math.nan], ctx=128, chunks=1)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        oracle_sweep(llm.model, ids, [1.0], ctx=128, chunks=1)


def test_interrupted_training_leaves_no_partial_file(llm, tmp_path) -> None:
    """Ctrl-C in the middle of train_predictors: every file there is whole, no scratch left."""
    from powerpy.pipeline.predictors import load_predictor_file
    from powerpy.pipeline.train import TrainOptions, train_predictors

    def stop(report) -> None:
        if report.layer == 1:
            raise KeyboardInterrupt

    ids = llm.tokenize(kjv_text("train")[:40_000], add_bos=False)
    out = tmp_path / "pred"
    with pytest.raises(KeyboardInterrupt):
        train_predictors(
            llm.model, ids, out, TrainOptions(hidden=32, epochs=1), tokens=1024, log_layer=stop
        )
    assert [p.name for p in tmp_path.iterdir()] == ["pred"]  # the sample dump is gone
    names = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert names == sorted(
        ["model_0.pt", "model_1.pt", "profile.json"] + [f"activation_{i}.pt" for i in range(4)]
    )
    for l in (0, 1):
        assert set(load_predictor_file(out / f"model_{l}.pt")) == {"fc1.weight", "fc2.weight"}
