"""The knapsack solver against brute force; candidates; settings validation."""

import itertools
import math

import numpy as np
import pytest

from cgx.policy.levels import Candidate, Family, candidates_for, solve
from cgx.compression import Compression
from cgx.quant.codec import QuantSpec


def _brute(costs, errors, budget):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        e = sum(errors[l][j] for l, j in enumerate(choice))
        c = sum(costs[l][j] for l, j in enumerate(choice))
        if e <= budget + 1e-9 and (best is None or c < best[0] - 1e-9):
            best = (c, e)
    return best


def _native_built():
    from cgx.policy.levels.solver import _native_knapsack
    return _native_knapsack() is not None


# Both dynamic programs: the C one (when built, as `make test` does) and numpy's.
IMPLS = [pytest.param(True, id="c", marks=pytest.mark.skipif(
    not _native_built(), reason="cgx._cquant is not built (make ext)")),
    pytest.param(False, id="numpy")]


@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize("seed", range(60))
def test_same_optimum_as_brute_force_when_errors_are_whole_units(seed, native):
    rng = np.random.default_rng(seed)
    layers, cands = rng.integers(1, 5), rng.integers(1, 5)
    costs = rng.integers(1, 50, (layers, cands)).astype(float).tolist()
    errors = rng.integers(0, 20, (layers, cands)).astype(float).tolist()
    budget = float(rng.integers(0, 20 * layers))
    best = _brute(costs, errors, budget)
    if best is None:
        with pytest.raises(ValueError, match="no plan meets the error budget"):
            solve(costs, errors, budget, units=max(1, int(budget)), native=native)
        return
    plan = solve(costs, errors, budget, units=max(1, int(budget)), native=native)
    assert plan.cost == pytest.approx(best[0])
    assert plan.error <= budget


@pytest.mark.parametrize("native", IMPLS)
@pytest.mark.parametrize("seed", range(40))
def test_budget_always_held_and_near_optimal_with_real_errors(seed, native):
    rng = np.random.default_rng(100 + seed)
    layers, cands = rng.integers(2, 6), rng.integers(2, 5)
    errors = np.sort(rng.uniform(0, 1, (layers, cands)), axis=1)
    costs = np.sort(rng.uniform(1, 100, (layers, cands)), axis=1)[:, ::-1]
    ref = [cands // 2] * layers
    budget = float(sum(errors[l][j] for l, j in enumerate(ref)))
    plan = solve(costs.tolist(), errors.tolist(), budget, reference=ref, native=native)
    assert plan.error <= budget * (1 + 1e-9)
    best = _brute(costs.tolist(), errors.tolist(), budget)
    assert plan.cost >= best[0] - 1e-9
    # Rounding each error up to 1/10,000 of the budget costs at most that much slack.
    tight = _brute(costs.tolist(), errors.tolist(), budget * (1 - layers / 10_000))
    assert tight is None or plan.cost <= tight[0] + 1e-9
    assert plan.cost <= sum(costs[l][j] for l, j in enumerate(ref)) + 1e-9


@pytest.mark.skipif(not _native_built(), reason="cgx._cquant is not built (make ext)")
@pytest.mark.parametrize("seed", range(5))
def test_c_and_numpy_agree_on_large_instances(seed):
    rng = np.random.default_rng(500 + seed)
    errors = np.sort(rng.uniform(0, 1, (80, 12)), axis=1)
    costs = np.sort(rng.uniform(1, 100, (80, 12)), axis=1)[:, ::-1]
    ref = [3] * 80
    budget = float(sum(errors[l][j] for l, j in enumerate(ref)))
    a = solve(costs, errors, budget, reference=ref, native=True)
    b = solve(costs, errors, budget, reference=ref, native=False)
    assert a.cost == pytest.approx(b.cost, rel=1e-5)
    assert a.error <= budget * (1 + 1e-9) and b.error <= budget * (1 + 1e-9)


def test_solver_validation():
    with pytest.raises(ValueError, match="same shape"):
        solve([[1.0, 2.0]], [[0.0]], 1.0)
    with pytest.raises(ValueError, match="at least one candidate"):
        solve([[]], [[]], 1.0)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        solve([[1.0]], [[0.0]], -1.0)


def test_candidates_and_wire_sizes():
    cands = candidates_for((256, 64), [Family.QUANTIZE])
    assert cands[0] == Candidate(Family.EXACT)
    assert Candidate(Family.QUANTIZE, 4, 1024) in cands
    for c in cands[1:]:
        assert c.wire_bytes(256 * 64) == QuantSpec(c.bits, c.bucket_size).nbytes(256 * 64)
    assert cands[0].wire_bytes(10) == 40
    assert candidates_for((0,), [Family.QUANTIZE]) == [Candidate(Family.EXACT)]


@pytest.mark.parametrize("kwargs,match", [
    ({"alpha": 0}, "alpha=0 must be a number > 0"),
    ({"alpha": -1.0}, "must be a number > 0"),
    ({"families": ()}, "families is empty"),
    ({"families": ("sparsify",)}, "unknown compressor family 'sparsify'"),
    ({"window": 0}, "window=0 must be an int >= 1"),
    ({"window": 20, "adjust_every": 10}, "adjust_every=10 is shorter than window=20"),
    ({"warmup_steps": -1}, "warmup_steps=-1 must be an int >= 0"),
    ({"bits": (2, 16)}, "bits"),
    ({"bucket_sizes": (100,)}, "bucket_size"),
    ({"rounding": "up"}, "rounding='up'"),
])
def test_auto_settings_are_checked_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Compression.auto(**kwargs)


def test_auto_string_and_env():
    from cgx.compression import AutoCompression, resolve
    from cgx.config import CompressionMode, Config
    assert isinstance(resolve("auto"), AutoCompression)
    cfg = Config.from_env({"CGX_COMPRESSION": "auto", "CGX_AUTO_ALPHA": "1.5",
                           "CGX_AUTO_WINDOW": "5", "CGX_AUTO_ADJUST_EVERY": "50"})
    assert cfg.compression is CompressionMode.AUTO
    assert (cfg.auto_alpha, cfg.auto_window, cfg.auto_adjust_every) == (1.5, 5, 50)
    from cgx.errors import ConfigError
    with pytest.raises(ConfigError, match="auto_window=60 must be in"):
        Config.from_env({"CGX_AUTO_WINDOW": "60", "CGX_AUTO_ADJUST_EVERY": "50"})
    assert math.isfinite(cfg.auto_alpha)


@pytest.mark.parametrize("factory", [Compression.quantize, Compression.topk])
def test_warmup_steps_validation(factory):
    with pytest.raises(ValueError, match="warmup_steps=-1 must be an int >= 0"):
        factory(warmup_steps=-1)
    assert factory(warmup_steps=5).warmup_steps == 5
