"""The L-GreCo knapsack: per layer one candidate, minimal total bytes, total error within budget.

Minimize ``sum_l cost[l][c_l]`` subject to ``sum_l error[l][c_l] <= budget``.
Errors are discretized into integer units of ``budget / units`` (at least
10,000 units) and a dynamic program over (layer, error used) keeps the
cheapest cost, with backtracking through the stored choices. Rounding each
error *up* to whole units keeps every plan the DP returns within the real
budget. When rounding up leaves no feasible plan, the budget is rounded to
the nearest unit instead and the result checked against the real budget, and
as a last resort the reference plan (the uniform default, which meets the
budget by definition for ``alpha >= 1``) is returned.

The dynamic program runs in C (``cgx_knapsack`` in cgx/csrc/knapsack.c) when
the extension is built, else in numpy (the same choices up to ties between
equal costs; both are checked against brute force).
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Optional, Sequence

import numpy as np

DEFAULT_UNITS = 10_000


@dataclasses.dataclass
class LevelChoice:
    """A solution: the chosen candidate index per layer, its cost and error."""

    choice: list
    cost: float
    error: float
    budget: float


def _pareto(c: np.ndarray, e: np.ndarray) -> np.ndarray:
    """Indices of the candidates no other one beats on both cost and error."""
    order = np.lexsort((c, e))  # by error, then cost
    keep, best = [], np.inf
    for j in order:
        if c[j] < best:
            keep.append(j)
            best = c[j]
    return np.asarray(keep, dtype=np.int64)


_native = None
_native_lock = threading.Lock()


def _native_knapsack():
    """``cgx_knapsack`` from the C extension, or None when it is not built."""
    global _native
    with _native_lock:
        if _native is None:
            from cgx.quant import cpu
            lib = cpu.load_library()
            fn = getattr(lib, "cgx_knapsack", None) if lib is not None else None
            if fn is not None:
                p = ctypes.c_void_p
                fn.argtypes = [ctypes.c_int64, p, p, p, ctypes.c_int64, p]
                fn.restype = ctypes.c_int
            _native = fn if fn is not None else False
    return _native or None


def _dp_native(fn, costs: list, units_err: list, capacity: int) -> Optional[list]:
    sizes = [len(c) for c in costs]
    offsets = np.zeros(len(costs) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    c = np.ascontiguousarray(np.concatenate(costs), dtype=np.float64)
    u = np.ascontiguousarray(np.concatenate(units_err), dtype=np.int64)
    choice = np.zeros(len(costs), dtype=np.int32)
    status = fn(len(costs), offsets.ctypes.data, c.ctypes.data, u.ctypes.data, int(capacity),
                choice.ctypes.data)
    if status == -1:  # rows of (capacity + 1) float64 per layer: 24 MB for 300 layers
        raise MemoryError(f"the solver could not allocate {len(costs) + 1} x {capacity + 1} "
                          "float64 entries; pass fewer units")
    if status < 0:
        raise RuntimeError(f"cgx_knapsack failed to backtrack (status {status})")
    return None if status else [int(j) for j in choice]


def _dp(costs: list, units_err: list, capacity: int, native: bool = True) -> Optional[list]:
    fn = _native_knapsack() if native else None
    if fn is not None:
        return _dp_native(fn, costs, units_err, capacity)
    return _dp_numpy(costs, units_err, capacity)


def _dp_numpy(costs: list, units_err: list, capacity: int) -> Optional[list]:
    """Cheapest choice per layer with total discretized error <= capacity (None: infeasible).

    dp_l[e] = the least cost of layers 0..l with discretized error exactly e: per
    layer and candidate one shifted add and minimum over a float32 vector (in
    place, no temporaries). Dominated candidates are dropped first; the dp rows
    are kept and the choices recovered by backtracking through them.
    """
    n = capacity + 1
    dp = np.full(n, np.inf, dtype=np.float32)
    dp[0] = 0.0
    rows = []
    tmp = np.empty(n, dtype=np.float32)
    kept = []
    reach = 0  # the largest error index with a finite cost so far
    for c, e in zip(costs, units_err):
        idx = _pareto(c, e)
        idx = idx[e[idx] <= capacity]
        if len(idx) == 0:
            return None
        new = np.full(n, np.inf, dtype=np.float32)
        for j in idx:
            ej = int(e[j])
            m = min(n - ej, reach + 1)  # dp is inf beyond `reach`: skip that part
            np.add(dp[:m], np.float32(c[j]), out=tmp[:m])
            np.minimum(new[ej:ej + m], tmp[:m], out=new[ej:ej + m])
        reach = min(n - 1, reach + int(e[idx].max()))
        rows.append(dp)
        kept.append(idx)
        dp = new
    end = int(np.argmin(dp))
    if not np.isfinite(dp[end]):
        return None
    choice = [0] * len(costs)
    e, value = end, dp[end]
    for layer in range(len(costs) - 1, -1, -1):
        prev, c, ue = rows[layer], costs[layer], units_err[layer]
        # the candidate that produced dp_layer[e] (float32: compare with a tolerance)
        best_j, best_gap = None, np.inf
        for j in kept[layer]:
            ej = int(ue[j])
            if ej <= e and np.isfinite(prev[e - ej]):
                gap = abs(float(prev[e - ej]) + float(np.float32(c[j])) - float(value))
                if gap < best_gap:
                    best_j, best_gap = int(j), gap
        choice[layer] = best_j
        e -= int(ue[best_j])
        value = prev[e]
    return choice


def solve(costs: Sequence[Sequence[float]], errors: Sequence[Sequence[float]], budget: float,
          *, units: int = DEFAULT_UNITS, reference: Optional[Sequence[int]] = None,
          native: bool = True) -> LevelChoice:
    """Pick one candidate per layer: minimal total cost with total error <= ``budget``.

    Args:
        costs, errors: per layer, per candidate (the same shape).
        budget: the largest total error allowed.
        units: error discretization (>= 10,000 by default).
        reference: a plan known to be within budget (returned if nothing better is).
        native: use the C dynamic program when it is built (False: numpy).

    Returns:
        The :class:`LevelChoice`.
    """
    if len(costs) != len(errors) or any(len(c) != len(e) for c, e in zip(costs, errors)):
        raise ValueError("costs and errors must have the same shape: one list per layer, one "
                         "value per candidate")
    if any(len(c) == 0 for c in costs):
        raise ValueError("every layer needs at least one candidate")
    if not budget >= 0:
        raise ValueError(f"budget must be >= 0, got {budget!r}")
    costs = [np.asarray(c, dtype=np.float64) for c in costs]
    # a non-finite error (a cast that overflowed) is never within any budget
    errors = [np.where(np.isnan(e), np.inf, e) for e in
              (np.asarray(e, dtype=np.float64) for e in errors)]

    def total(choice):
        return (float(sum(c[j] for c, j in zip(costs, choice))),
                float(sum(e[j] for e, j in zip(errors, choice))))

    best = None
    if budget > 0:
        unit = budget / units

        def discrete(rounded):  # in units, beyond the capacity clipped (never chosen)
            return [np.minimum(rounded(e), units + 1).astype(np.int64) for e in errors]
        choice = _dp(costs, discrete(lambda e: np.ceil(e / unit - 1e-9)), units, native)
        if choice is None:  # rounding up cost too much: round to nearest, then check
            choice = _dp(costs, discrete(lambda e: np.rint(e / unit)), units, native)
        if choice is not None and total(choice)[1] <= budget * (1 + 1e-12):
            best = choice
    else:  # only zero-error candidates fit
        zero = [[j for j in range(len(e)) if e[j] == 0] for e in errors]
        if all(zero):
            best = [min(z, key=lambda j, c=c: c[j]) for z, c in zip(zero, costs)]
    if reference is not None:
        ref_cost, ref_err = total(reference)
        if best is None or (ref_err <= budget * (1 + 1e-12) and ref_cost < total(best)[0]):
            best = list(reference)
    if best is None:
        raise ValueError("no plan meets the error budget (and no reference plan was given)")
    cost, err = total(best)
    return LevelChoice([int(j) for j in best], cost, err, float(budget))
