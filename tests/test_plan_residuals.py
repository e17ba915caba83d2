"""Error-feedback residuals follow their tensor through every change of plan.

With error feedback, nothing a compressed exchange drops is lost: over any steps, on
every rank, the reduced outputs' sum plus the reduction of every rank's residual equals
the reduction of the gradients' sum (``GradientPlan.residual``). That must hold while
the plan moves tensors between exact and quantized (planned mode), changes the set of
tensors fused in one reduction (which moves the chunk boundaries of the compressed
allreduce), or moves a layer between families (auto), with a gradient predivide
factor too; and a tensor that travels exact owes nothing afterwards.

The plans are forced by hand (the planned schedule's ``chosen``, auto's ``plan``), so
every rank takes the same ones at the same steps.
"""

from __future__ import annotations

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc

SHAPES = {"a": (40, 29), "b": (64, 17), "c": (50, 50), "d": (23, 61)}  # all >= 1024 values
# Per step: which tensors are quantized (the others exact), and how the step's
# reductions split the tensors (one fused call per group).
CHANGING = [("abcd", ["abcd"]), ("acd", ["abcd"]), ("abd", ["abcd"]), ("abcd", ["ab", "cd"]),
            ("bcd", ["ac", "bd"]), ("abc", ["abcd"]), ("abcd", ["dcba"]), ("", ["abcd"])]
STEADY = [("abcd", ["abcd"])] * len(CHANGING)


def _planned_walks(rank, world):
    """Both walks with each predivide factor, in one process (spawning ranks is slow)."""
    import cgx.torch as hvd
    hvd.init()
    return {(name, predivide): _planned_walk(rank, walk, predivide)
            for name, walk in (("changing", CHANGING), ("steady", STEADY))
            for predivide in (1.0, 2.0)}


def _planned_walk(rank, walk, predivide):
    """The planned exchange with error feedback, its choice set by hand at every step.
    Returns the gradients' and outputs' running sums, and the residuals, after each step."""
    import cgx.torch as hvd
    from cgx import session
    from cgx.exchange import GradientPlan
    names = list(SHAPES)
    plan = GradientPlan(names, list(SHAPES.values()),
                        hvd.Compression.planned(bits=2, bucket_size=64, replan_every=0,
                                                error_feedback=True), predivide=predivide)
    g = torch.Generator().manual_seed(100 + rank)
    total_in = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    total_out = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    after = []
    for step, (quantized, calls) in enumerate(walk):
        plan.planned.chosen = [n in quantized for n in names]  # the plan of this step
        grads = {n: torch.randn(s, generator=g) + 0.5 for n, s in SHAPES.items()}
        for call in calls:
            idx = [names.index(n) for n in call]
            outs = session.run(plan.reduce, [grads[n].clone() for n in call],
                               name=f"call.{call}", step=step, indices=idx)
            for n, o in zip(call, outs):
                total_out[n] += o.double()
        for n in names:
            total_in[n] += grads[n].double()
        after.append({"in": {n: t.clone() for n, t in total_in.items()},
                      "out": {n: t.clone() for n, t in total_out.items()},
                      "residual": {n: plan.residual(n) for n in names}})
    return after


def _check_sums(world_results, walk, atol=2e-4):
    """On every rank after every step: outputs + mean residual == mean gradient (summed)."""
    W = len(world_results)
    for step, (quantized, _) in enumerate(walk):
        for n, shape in SHAPES.items():
            mean_in = sum(r[step]["in"][n] for r in world_results) / W
            owed = [r[step]["residual"][n] for r in world_results]
            if n not in quantized:  # it just travelled exact: it owes nothing any more
                assert all(e is None for e in owed), (step, n)
            mean_owed = sum(e.double().view(shape) for e in owed if e is not None) / W
            for r in world_results:
                err = float((r[step]["out"][n] + mean_owed - mean_in).abs().max())
                assert err < atol, f"step {step}, tensor {n}: off by {err:.3g}"


@pytest.mark.parametrize("world", [2, 3])
def test_planned_residuals_follow_tensors_through_plan_changes(world):
    results = run_gloo(_planned_walks, world)
    for predivide in (1.0, 2.0):
        changing = [r[("changing", predivide)] for r in results]
        steady = [r[("steady", predivide)] for r in results]
        # The residuals are real: a 2-bit exchange drops a lot each step.
        assert float(steady[0][0]["residual"]["c"].abs().max()) > 0.1
        _check_sums(changing, CHANGING)
        _check_sums(steady, STEADY)
        # The same gradients (each rank's seed) in both runs: what was sent plus what is
        # owed agrees; the changing run ends with a step where all travel exact, so it
        # owes nothing and its outputs alone sum to the mean gradient.
        last = len(CHANGING) - 1
        for n, shape in SHAPES.items():
            assert torch.equal(changing[0][last]["in"][n], steady[0][last]["in"][n])
            mean_in = sum(r[last]["in"][n] for r in changing) / world
            owed = sum(r[last]["residual"][n].double().view(shape) for r in steady) / world
            for a, b in zip(changing, steady):
                assert float((a[last]["out"][n] - mean_in).abs().max()) < 2e-4
                assert float((a[last]["out"][n] - (b[last]["out"][n] + owed)).abs().max()) \
                    < 2e-4


def _auto_walks(rank, world, walk):
    import cgx.torch as hvd
    hvd.init()
    return {predivide: _auto_walk(rank, walk, predivide) for predivide in (1.0, 2.0)}


def _auto_walk(rank, walk, predivide):
    """compression="auto" with error feedback, each layer's candidate set by hand per step
    (every step re-plans). Returns the gradients' and outputs' sums and the residuals."""
    import cgx.torch as hvd
    from cgx import session
    from cgx.exchange import GradientPlan
    names = list(walk)
    plan = GradientPlan(names, [(64, 48)] * len(names),
                        hvd.Compression.auto(window=1, adjust_every=1, error_feedback=True),
                        predivide=predivide)
    sched = plan.adaptive

    def replan(step, transport, threads=1, verbose=False, hidden=()):
        sched.plan = [w[step] for w in walk.values()]
        return True
    sched.replan = replan  # a test double: the plan of each step is the walk's
    sched.due = lambda step: True
    g = torch.Generator().manual_seed(7 + rank)
    total_in = [torch.zeros(64, 48, dtype=torch.float64) for _ in names]
    total_out = [torch.zeros(64, 48, dtype=torch.float64) for _ in names]
    for step in range(len(next(iter(walk.values())))):
        grads = [torch.randn(64, 48, generator=g) for _ in names]
        outs = session.run(plan.reduce, [x.clone() for x in grads], name="walk", step=step)
        for t_in, t_out, x, o in zip(total_in, total_out, grads, outs):
            t_in += x.double()
            t_out += o.double()
    return {"in": total_in, "out": total_out, "residual": [plan.residual(n) for n in names]}


@pytest.mark.parametrize("world", [2, 3])
def test_auto_family_changes_send_exactly_what_was_owed(world):
    from cgx.policy.levels import Candidate, Family
    T = Candidate(Family.TOPK, density=0.01)
    R = Candidate(Family.POWERSGD, rank=2)
    Q = Candidate(Family.QUANTIZE, 3, 128)
    E = Candidate(Family.EXACT)
    # Each layer is compressed a while, then exact: all it owed must have been sent,
    # quantization's share of its final requantization and top-k's with a predivide too.
    walk = {"quantized": [Q, Q, E], "topk": [T, T, E], "topk_then_q": [T, Q, E],
            "powersgd_then_q": [R, Q, E], "q_then_topk": [Q, T, E]}
    results = run_gloo(_auto_walks, world, walk)
    for predivide in (1.0, 2.0):
        out = [r[predivide] for r in results]
        for k, n in enumerate(walk):
            mean_in = sum(o["in"][k] for o in out) / world
            for o in out:
                assert o["residual"][k] is None, n
                err = float((o["out"][k] - mean_in).abs().max())
                assert err < 2e-4, f"{n} (predivide {predivide}): off by {err:.3g}"
