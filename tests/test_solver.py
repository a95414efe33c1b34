"""Solver tests (docs/architecture.md#solver): ILP = greedy at t = 0, ILP = brute force,
properties."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import solver
from solver import SolverError, group_masses, solve, solve_hot_counts
from solver.greedy import solve_greedy, solve_threshold_dp
from solver.ilp import solve_ilp

REPO = Path(__file__).resolve().parents[1]


def power_law(n_layer: int, n_ff: int, seed: int) -> list[np.ndarray]:
    """Continuous power-law statistics: group masses are distinct with probability 1."""
    rng = np.random.default_rng(seed)
    return [rng.pareto(1.2, n_ff) * rng.uniform(0.2, 3.0) + 1e-6 for _ in range(n_layer)]


def brute_force(v: np.ndarray, cap: int, t: int) -> float:
    """Best objective over every binary x (y follows: 1 iff the layer holds groups)."""
    n_layer, n_groups = v.shape
    best = 0.0
    for bits in itertools.product((0, 1), repeat=n_layer * n_groups):
        x = np.array(bits).reshape(n_layer, n_groups)
        per_layer = x.sum(axis=1)
        if per_layer.sum() > cap or np.any((per_layer > 0) & (per_layer < t)):
            continue
        best = max(best, float((v * x).sum()))
    return best


def mass(v: np.ndarray, groups: np.ndarray) -> float:
    return float(sum(v[i, :k].sum() for i, k in enumerate(groups)))


# --- packaging ------------------------------------------------------------------------------------
def test_import_solver_does_not_import_torch() -> None:
    code = (
        "import sys, solver, solver.ilp, solver.greedy; "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not [m for m in sys.modules if m.startswith('powerpy')], 'powerpy imported'; "
        "assert 'pulp' not in sys.modules, 'pulp imported eagerly'; "
        "import powerpy.commands.solve_gpuidx; "  # python -m solver's CLI: torch only in main()
        "assert 'torch' not in sys.modules, 'the solver CLI imports torch eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_python_m_solver_is_the_powerpy_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "solver", "--help"], cwd=REPO, check=True, capture_output=True
    ).stdout.decode()
    assert out.startswith("usage: python -m solver") and "--vram-capacity" in out


# --- group masses ---------------------------------------------------------------------------------
def test_group_masses_sort_descending_then_sum() -> None:
    stats = [np.array([1.0, 5.0, 3.0, 2.0]), np.array([0.0, 0.0, 4.0, 4.0])]
    v = group_masses(stats, batch=2)
    np.testing.assert_array_equal(v, [[8.0, 3.0], [8.0, 0.0]])


@pytest.mark.parametrize(
    ("stats", "batch", "match"),
    [
        ([np.ones(300)], 256, "not a multiple of --batch 256"),
        ([np.ones(512), np.ones(256)], 256, "layer 1"),
        ([np.array([1.0, np.nan])], 1, "not finite"),
        ([], 256, "0 layers"),
        ([np.ones((2, 256))], 256, "shape"),
    ],
)
def test_group_masses_errors(stats: list, batch: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        group_masses(stats, batch)


def test_solve_argument_errors() -> None:
    stats = power_law(2, 512, 0)
    with pytest.raises(ValueError, match="capacity"):
        solve(stats, -1)
    with pytest.raises(ValueError, match="threshold"):
        solve(stats, 512, threshold=-256)
    with pytest.raises(ValueError, match="method"):
        solve(stats, 512, method="simplex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_ff = 512 .* --batch 384"):
        solve_hot_counts(stats, 512, batch=384)


# --- ILP = greedy at t = 0 ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n_layer", "n_ff", "batch", "capacity", "seed"),
    [
        (4, 2048, 256, 2048, 0),
        (6, 1024, 128, 1500, 1),
        (8, 4096, 512, 9000, 2),
        (3, 768, 64, 700, 3),
        (5, 2048, 256, 100_000, 4),  # capacity above everything: all groups
        (5, 2048, 256, 200, 5),  # capacity below one group: nothing
    ],
)
def test_ilp_equals_greedy_at_threshold_zero(
    n_layer: int, n_ff: int, batch: int, capacity: int, seed: int
) -> None:
    v = group_masses(power_law(n_layer, n_ff, seed), batch)
    cap = capacity // batch
    greedy = solve_greedy(v, cap)
    ilp = solve_ilp(v, cap, 0, time_limit=20)  # no warm start: CBC on its own
    assert ilp.optimal
    np.testing.assert_array_equal(ilp.groups, greedy)
    np.testing.assert_array_equal(solve_threshold_dp(v, cap, 0), greedy)
    counts = solve_hot_counts(power_law(n_layer, n_ff, seed), capacity, batch=batch, method="ilp")
    np.testing.assert_array_equal(counts, greedy * batch)


# --- ILP = brute force on tiny cases, thresholds included -----------------------------------------
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n_groups", [2, 3, 4])
def test_ilp_equals_brute_force(seed: int, n_groups: int) -> None:
    rng = np.random.default_rng(100 + seed)
    v = -np.sort(-rng.pareto(1.0, (2, n_groups)) - 0.01, axis=1)  # (2, G), rows descending
    for t in range(n_groups + 2):
        for cap in sorted({0, 1, n_groups - 1, n_groups, n_groups + 1, 2 * n_groups}):
            expected = brute_force(v, cap, t)
            ilp = solve_ilp(v, cap, t, time_limit=20)
            dp = solve_threshold_dp(v, cap, t)
            for groups in (ilp.groups, dp):
                assert groups.sum() <= cap
                assert np.all((groups == 0) | (groups >= t))
            assert ilp.optimal
            assert mass(v, ilp.groups) == pytest.approx(expected, rel=1e-9, abs=1e-12)
            assert mass(v, dp) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_ilp_with_threshold_matches_dp_on_larger_problem() -> None:
    stats = power_law(12, 4096, 7)
    for threshold in (512, 1024, 2048):
        ilp = solve(stats, 12 * 4096 // 5, batch=256, threshold=threshold, method="ilp")
        dp = solve(stats, 12 * 4096 // 5, batch=256, threshold=threshold, method="dp")
        assert ilp.method == "ilp" and dp.method == "dp"
        assert ilp.mass == pytest.approx(dp.mass, rel=1e-9)
        assert np.all((ilp.counts == 0) | (ilp.counts >= threshold))


def test_auto_uses_greedy_without_threshold_and_ilp_with_one() -> None:
    stats = power_law(4, 1024, 9)
    assert solve(stats, 1024, batch=256).method == "greedy"
    assert solve(stats, 1024, batch=256, threshold=100).method == "greedy"  # floors to t = 0
    assert solve(stats, 1024, batch=256, threshold=512).method == "ilp"


# --- properties -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n_layer=st.integers(1, 6),
    n_groups=st.integers(1, 8),
    batch=st.sampled_from([1, 2, 4, 32]),
    capacity=st.integers(0, 400),
    t=st.integers(0, 9),
)
def test_counts_are_feasible_and_dp_is_optimal(
    seed: int, n_layer: int, n_groups: int, batch: int, capacity: int, t: int
) -> None:
    rng = np.random.default_rng(seed)
    # integer counts with many ties and zeros, like real activation counts
    stats = [rng.integers(0, 4, n_groups * batch).astype(np.float64) for _ in range(n_layer)]
    threshold = t * batch
    for method in ("greedy", "dp"):
        r = solve(stats, capacity, batch=batch, threshold=threshold, method=method)
        assert r.counts.dtype == np.int64 and r.counts.shape == (n_layer,)
        assert np.all(r.counts % batch == 0)
        assert r.counts.sum() <= capacity
        if method == "dp":
            assert np.all((r.counts == 0) | (r.counts >= threshold))
    # the DP is the exact optimum over per-layer counts (enumerated here)
    v = group_masses(stats, batch)
    cap = capacity // batch
    choices = [0, *range(max(t, 1), n_groups + 1)]
    if n_layer <= 3:
        best = max(
            (
                mass(v, np.array(ks))
                for ks in itertools.product(choices, repeat=n_layer)
                if sum(ks) <= cap
            ),
            default=0.0,
        )
        assert mass(v, solve_threshold_dp(v, cap, t)) == pytest.approx(best, abs=1e-9)
    if t <= 1:
        assert mass(v, solve_greedy(v, cap)) == pytest.approx(
            mass(v, solve_threshold_dp(v, cap, t)), abs=1e-9
        )


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), t=st.integers(1, 4), cap=st.integers(0, 20))
def test_ilp_property_against_dp(seed: int, t: int, cap: int) -> None:
    rng = np.random.default_rng(seed)
    v = -np.sort(-rng.pareto(1.5, (4, 5)), axis=1)
    ilp = solve_ilp(v, cap, t, time_limit=20)
    assert ilp.groups.sum() <= cap
    assert np.all((ilp.groups == 0) | (ilp.groups >= t))
    assert mass(v, ilp.groups) == pytest.approx(mass(v, solve_threshold_dp(v, cap, t)), abs=1e-9)


def test_greedy_skips_zero_mass_groups_and_breaks_ties_by_layer() -> None:
    v = np.array([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    np.testing.assert_array_equal(solve_greedy(v, 3), [2, 1])  # tie at 1.0: layer 0 first
    np.testing.assert_array_equal(solve_greedy(v, 6), [2, 2])  # zero-mass groups left out


def test_threshold_larger_than_layer_gives_empty_placement(caplog) -> None:
    stats = power_law(3, 512, 1)
    with caplog.at_level(logging.WARNING):
        counts = solve_hot_counts(stats, 10_000, batch=256, threshold=1024)
    assert counts.tolist() == [0, 0, 0]
    assert "no layer can be used" in caplog.text


# --- time limit and failures ----------------------------------------------------------------------
class _FakeCbc:
    """Stands in for PULP_CBC_CMD: reports a status without running CBC."""

    def __init__(self, sol_status: int, **_kw: object) -> None:
        self.sol_status = sol_status

    def __call__(self, **kw: object) -> _FakeCbc:
        return self

    def actualSolve(self, lp):  # noqa: N802 - pulp's interface
        import pulp

        for var in lp.variables():
            var.varValue = 0.0  # all zero is always feasible
        status = pulp.LpStatusOptimal if self.sol_status > 0 else pulp.LpStatusNotSolved
        lp.assignStatus(status, self.sol_status)
        return status


def test_ilp_uses_feasible_point_with_warning(monkeypatch, caplog) -> None:
    import pulp

    monkeypatch.setattr(pulp, "PULP_CBC_CMD", _FakeCbc(pulp.LpSolutionIntegerFeasible))
    v = group_masses(power_law(2, 512, 0), 256)
    with caplog.at_level(logging.WARNING):
        sol = solve_ilp(v, 2, 1, time_limit=5)
    assert not sol.optimal
    assert sol.groups.tolist() == [0, 0]
    assert "without proving optimality" in caplog.text


def test_ilp_without_feasible_point_raises_actionable_error(monkeypatch) -> None:
    import pulp

    monkeypatch.setattr(pulp, "PULP_CBC_CMD", _FakeCbc(pulp.LpSolutionNoSolutionFound))
    v = group_masses(power_law(2, 512, 0), 256)
    with pytest.raises(SolverError, match="raise --batch .* drop --threshold") as e:
        solve_ilp(v, 2, 1, time_limit=5)
    assert isinstance(e.value, ValueError)


def test_ilp_time_limit_is_bounded_on_hard_threshold() -> None:
    # A binding threshold on the 70B shape: CBC cannot prove optimality quickly (weak big-M
    # relaxation). The call must return within about the limit, at least as good as the DP.
    stats = power_law(80, 28672 // 8, 3)  # 80 layers x 14 groups of 256
    r = solve(stats, 80 * 28672 // 80, batch=256, threshold=256 * 6, time_limit=2.0, method="ilp")
    dp = solve(stats, 80 * 28672 // 80, batch=256, threshold=256 * 6, method="dp")
    assert r.seconds < 6.0
    assert r.mass >= dp.mass * (1 - 1e-12)


def test_solver_reexports() -> None:
    assert set(solver.__all__) >= {"solve_hot_counts", "SolverError", "solve", "SolveResult"}
