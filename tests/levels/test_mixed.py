"""compression="auto" across families: top-k and PowerSGD beside quantization, per layer."""

import io
import math

import pytest
import torch

from cgx.policy.levels import Candidate, Family, candidates_for
from cgx.policy.levels.stats import PowerSGDScorer, topk_errors
from cgx.compression import Compression
from cgx.compression.powersgd import PowerSGDCompressor, initial_q
from cgx.compression.topk import TopKCompressor
from spawn import run_gloo

pytestmark = pytest.mark.multiproc

ALL = [Family.QUANTIZE, Family.TOPK, Family.POWERSGD]


def test_candidate_sizes_are_the_compressors_own():
    shape = (96, 40)
    cands = candidates_for(shape, ALL)
    fams = {c.family for c in cands}
    assert fams == {Family.EXACT, *ALL}
    for c in cands:
        if c.family is Family.TOPK:
            assert c.wire_bytes(shape) == TopKCompressor(c.density).payload_nbytes(96 * 40)
        if c.family is Family.POWERSGD:
            psgd = PowerSGDCompressor(rank=c.rank, min_compression_rate=0.0)
            assert c.wire_bytes(shape) == 4 * psgd.payload_numel(shape)
            assert c.wire_bytes(shape) < 4 * 96 * 40
    # Top-k travels by allgather: W - 1 copies; the allreduce families 2 (W - 1) / W.
    t = next(c for c in cands if c.family is Family.TOPK)
    q = next(c for c in cands if c.family is Family.QUANTIZE)
    assert t.traffic(shape, 4) == 3 * t.wire_bytes(shape)
    assert q.traffic(shape, 4) == 1.5 * q.wire_bytes(shape)
    # No PowerSGD for vectors, nor ranks whose factors are no smaller than the matrix.
    assert all(c.family is not Family.POWERSGD for c in candidates_for((500,), ALL))
    assert {c.rank for c in candidates_for((8, 6), ALL) if c.family is Family.POWERSGD} == {1, 2}
    for c in cands:
        assert Candidate.from_list(c.as_list()) == c


def test_topk_error_is_what_the_compressor_drops():
    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    for density in (0.001, 0.01, 0.3):
        comp = TopKCompressor(density)
        sent = comp.decompress(*comp.compress(x))
        k = comp.num_selected(x.numel())
        assert topk_errors(x, [k])[0] == pytest.approx(float((x - sent).norm()), rel=1e-5)


def test_powersgd_error_is_what_one_warm_started_power_iteration_sends():
    # One scorer run at the largest rank gives every rank's error: each equals what a
    # rank-r PowerSGD sends, step after step, from the leading r columns of the warm start.
    n, m = 64, 48
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, m, generator=g) @ torch.diag(torch.linspace(3, 0.1, m))
             for _ in range(4)]
    scorer = PowerSGDScorer()
    measured = [scorer.step("w", x.reshape(-1), (n, m), [1, 2, 4], True) for x in grads]
    for j, r in enumerate((1, 2, 4)):
        comp = PowerSGDCompressor(rank=r, min_compression_rate=0.0, error_feedback=False)
        comp._q["w"] = initial_q(0, "w", 0, m, 4)[:, :r].clone()
        for x, errs in zip(grads, measured):
            sent = comp.decompress(*comp.compress(x, "w"))
            assert errs[j] == pytest.approx(float((sent - x).norm()), rel=1e-5)
    # Not the best rank-r approximation: one iteration from a random start is worse.
    tail = float(torch.linalg.svdvals(grads[0].double())[1:].square().sum().sqrt())
    assert measured[0][0] > 1.01 * tail


def test_quantization_error_is_measured_with_the_exchanges_rounding():
    from cgx.policy.levels import AdaptiveSchedule
    from cgx.quant.codec import QuantSpec, quantize
    from cgx.config import Config, Rounding
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))

    def measured(rounding):
        sched = AdaptiveSchedule(["w"], [(64, 64)], [True], Compression.auto(
            window=1, families=("quantize",), bits=(4,), bucket_sizes=(1024,),
            rounding=rounding), Config())
        sched.observe(0, [0], [x.view(64, 64)])
        return sched._sums["w"][sched.candidates[0].index(sched.default)]

    def sent(rounding, key):
        y = x.clone()
        quantize(y, QuantSpec(4, 1024, rounding), write_back=True, key=key)
        return float((y - x).norm())
    assert measured("nearest") == pytest.approx(sent(Rounding.NEAREST, 0), rel=1e-6)
    stochastic = sum(sent(Rounding.STOCHASTIC, k) for k in range(20)) / 20
    assert measured("stochastic") == pytest.approx(stochastic, rel=0.05)
    assert stochastic > 1.2 * sent(Rounding.NEAREST, 0)  # the two differ: both are checked


@pytest.mark.parametrize("kwargs,match", [
    ({"families": ("quantize", "bogus")}, "unknown compressor family 'bogus'"),
    ({"families": ("topk",), "densities": ()}, "densities is empty"),
    ({"densities": (0.0,)}, "density=0.0 is out of range"),
    ({"ranks": (0,)}, "must be ints >= 1"),
    ({"families": ("powersgd",), "ranks": ()}, "ranks is empty"),
])
def test_bad_family_settings_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Compression.auto(**kwargs)


# -- on real ranks -------------------------------------------------------------------


class TwoBranch(torch.nn.Module):
    """Branch ``sparse`` sees inputs with 2 active features of 512 (its gradient has two
    non-zero columns: top-k's case); branch ``lowrank`` sees one direction scaled per
    sample (its gradient is exactly rank 1: PowerSGD's case)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.sparse = torch.nn.Linear(512, 64)
        self.lowrank = torch.nn.Linear(256, 64)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, xs, xl):
        return self.head(torch.relu(self.sparse(xs)) + torch.relu(self.lowrank(xl)))


def _batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    xs = torch.zeros(16, 512)
    xs[:, :2] = torch.randn(16, 2, generator=g)
    direction = torch.randn(256, generator=torch.Generator().manual_seed(7))
    xl = torch.randn(16, 1, generator=g) * direction
    y = torch.randint(0, 10, (16,), generator=g)
    return xs, xl, y


def _train(opt, model, steps, start, rank):
    for step in range(start, start + steps):
        xs, xl, y = _batch(step, rank)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xs, xl), y).backward()
        opt.step()


def _mixed(rank, world, phase, blob):
    import cgx.torch as hvd
    hvd.init()
    model = TwoBranch()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.auto(window=2, adjust_every=4, error_feedback=True))
    if phase == "second":
        ckpt = torch.load(io.BytesIO(blob[rank]), weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        _train(opt, model, 7, 7, rank)
        return [p.detach() for p in model.parameters()]
    history = []
    for block in range(7 if phase == "first" else 14):
        _train(opt, model, 1, block, rank)
        history.append({r["layer"]: (r["family"], r["level"]) for r in opt.compression_plan()})
    if phase == "first":  # mid-window (plans at steps 2 and 6): statistics are kept too
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        return buf.getvalue()
    psgd = opt._plan.reduction.powersgd
    return {"history": history, "params": [p.detach() for p in model.parameters()],
            "draws": dict(psgd._draws), "plans": opt._plan.adaptive.plans_made,
            "hvd_bytes": hvd.stats().wire_bytes}


@pytest.mark.parametrize("world", [2, 3])
def test_mixed_plan_is_the_same_everywhere_and_picks_each_family_where_it_fits(world):
    outs = run_gloo(_mixed, world, "full", None)
    first = outs[0]
    assert first["plans"] == 3  # at steps 2, 6 and 10
    for o in outs[1:]:
        assert o["history"] == first["history"]
        for p, q in zip(o["params"], first["params"]):
            assert torch.equal(p, q)
    last = first["history"][-1]
    assert last["sparse.weight"][0] == "topk", last
    assert last["lowrank.weight"][0] == "powersgd", last
    # Re-planning kept the warm start: one random Q draw for the PowerSGD layer, ever.
    assert first["draws"].get("lowrank.weight") == 1
    # The bytes of every family are counted (top-k and PowerSGD too).
    assert first["hvd_bytes"] > 0


def test_mixed_plan_checkpoint_resumes_bit_exactly_in_fresh_processes():
    full = run_gloo(_mixed, 2, "full", None)
    blobs = run_gloo(_mixed, 2, "first", None)
    resumed = run_gloo(_mixed, 2, "second", blobs)
    for r in range(2):
        for p, q in zip(full[r]["params"], resumed[r]):
            assert torch.equal(p, q)


T = lambda d: Candidate(Family.TOPK, density=d)  # noqa: E731
R = lambda r: Candidate(Family.POWERSGD, rank=r)  # noqa: E731
E = Candidate(Family.EXACT)
Q = Candidate(Family.QUANTIZE, 3, 128)


def _walk(rank, world, walk):
    """Layers walked through families by hand (``walk``: per layer, the candidate of each
    step), the same data on every rank (so the mean is each rank's own). Returns the
    summed inputs and outputs, who holds a residual after each step, PowerSGD's state."""
    import cgx.torch as hvd
    from cgx import session
    from cgx.exchange import GradientPlan
    hvd.init()
    plan = GradientPlan(list(walk), [(64, 48)] * len(walk),
                        hvd.Compression.auto(window=1, adjust_every=1, error_feedback=True,
                                             rounding="nearest"))
    sched = plan.adaptive

    def replan(step, transport, threads=1, verbose=False, hidden=()):
        sched.plan = [w[step] for w in walk.values()]
        return True
    sched.replan = replan
    sched.due = lambda step: True
    g = torch.Generator().manual_seed(5)
    total_in = [torch.zeros(64, 48) for _ in walk]
    total_out = [torch.zeros(64, 48) for _ in walk]
    held = []
    for step in range(len(next(iter(walk.values())))):
        grads = [torch.randn(64, 48, generator=g) for _ in walk]
        for t, x in zip(total_in, grads):
            t += x
        outs = session.run(plan.reduce, [x.clone() for x in grads], name="walk", step=step)
        for t, o in zip(total_out, outs):
            t += o
        held.append(sorted(n for n in walk if n in plan.residuals.residuals or n in plan.residuals.owed or
                           plan.reduction.topk.residual(n) is not None or
                           plan.reduction.powersgd.residual(n) is not None))
    return {"loss": [float((a - b).norm()) for a, b in zip(total_in, total_out)],
            "held": held, "draws": dict(plan.reduction.powersgd._draws),
            "q_cols": {n: q.shape[1] for n, q in plan.reduction.powersgd._q.items()}}


def test_residuals_and_warm_starts_follow_layers_across_families():
    walk = {"a": [T(0.01), R(2), T(0.04), R(2), E],
            "b": [R(1), T(0.01), R(4), T(0.004), E]}
    for o in run_gloo(_walk, 2, walk):
        assert max(o["loss"]) < 1e-4, o["loss"]  # nothing lost: all of it sent in the end
        assert o["held"][:4] == [["a", "b"]] * 4  # owed while compressed...
        assert o["held"][4] == []  # ...and all sent once exact
        # b: rank 1, then rank 4 later: the warm start was extended (one more draw), not
        # redrawn; a: rank 2 twice, one draw.
        assert o["draws"] == {"a": 1, "b": 2} and o["q_cols"] == {"a": 2, "b": 4}


def test_a_residual_handed_to_quantization_is_sent():
    # Quantization alone loses a little at its last step (its final requantization's
    # share, see GradientPlan._reduce_auto); top-k's large residual must not add to that.
    walk = {"alone": [E, Q, E], "after_topk": [T(0.01), Q, E], "dropped": [T(0.01), E, E]}
    for o in run_gloo(_walk, 2, walk):
        alone, after, dropped = o["loss"]
        assert dropped < 1e-4
        assert after < 1.5 * alone + 1e-3, o["loss"]


def test_error_feedback_follows_the_optimizers_update_rule():
    from cgx.policy.update_rule import UpdateRule, update_rule_of
    from cgx.config import Config
    from cgx.exchange import GradientPlan
    w = [torch.nn.Parameter(torch.zeros(3))]

    class MySGD(torch.optim.SGD):
        pass
    assert update_rule_of(torch.optim.SGD(w, lr=0.1, momentum=0.9)) is UpdateRule.LINEAR
    assert update_rule_of(MySGD(w, lr=0.1)) is UpdateRule.LINEAR
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad):
        assert update_rule_of(cls(w)) is UpdateRule.ADAPTIVE
    assert update_rule_of(torch.optim.LBFGS(w)) is UpdateRule.UNKNOWN

    def ef(comp, rule, configured=False):
        return GradientPlan(["w"], [(64, 64)], comp, update_rule=rule,
                            config=Config(error_feedback=configured)).error_feedback
    auto = Compression.auto()
    assert ef(auto, UpdateRule.LINEAR) is True
    assert ef(auto, UpdateRule.ADAPTIVE, configured=True) is False
    assert ef(auto, UpdateRule.UNKNOWN, configured=True) is True
    assert ef(auto, UpdateRule.UNKNOWN) is False
    # An explicit choice wins.
    assert ef(Compression.auto(error_feedback=True), UpdateRule.ADAPTIVE) is True
    assert ef(Compression.auto(error_feedback=False), UpdateRule.LINEAR) is False
    # Fixed compressors keep their own setting, whatever the optimizer.
    assert ef(Compression.quantize(bits=4), UpdateRule.LINEAR) is False


def test_layers_the_planner_keeps_exact_leave_their_budget_to_the_others():
    from types import SimpleNamespace
    from cgx.policy.levels import AdaptiveSchedule
    from cgx.config import Config
    one = SimpleNamespace(size=1, rank=0, device=torch.device("cpu"))
    shapes = [(256, 128), (256, 128), (128, 64)]

    def planned(hidden):
        sched = AdaptiveSchedule(["a", "b", "c"], shapes, [True] * 3,
                                 Compression.auto(window=1, families=("quantize",)), Config())
        g = torch.Generator().manual_seed(3)
        sched.observe(0, [0, 1, 2], [torch.randn(s, generator=g) for s in shapes])
        sched.replan(1, one, hidden=hidden)
        return sched
    free, helped = planned([]), planned([0])
    assert helped.plan[0] == Candidate(Family.EXACT)
    assert helped.rows()[0]["level"] == "exact (planner: no time saved)"
    assert helped.budget == pytest.approx(free.budget)  # the same budget...
    bytes_of = lambda s, i: s.plan[i].wire_bytes(shapes[i])  # noqa: E731
    # ...spent on fewer layers: b and c get levels at least as cheap, one strictly cheaper.
    assert all(bytes_of(helped, i) <= bytes_of(free, i) for i in (1, 2))
    assert sum(bytes_of(helped, i) for i in (1, 2)) < sum(bytes_of(free, i) for i in (1, 2))


def test_the_window_reads_a_gradient_only_at_the_steps_that_measure_it():
    # a quantize-only layer is measured at the window's sampled steps (10 steps: 0, 3, 6, 9);
    # a layer that may pick PowerSGD is read at every step (its scorer's warm start follows
    # the exchange's); an ineligible layer never. The factor path copies a gradient only
    # where it is read (cgx.torch.bucket_exchange).
    from cgx.policy.levels import AdaptiveSchedule
    from cgx.config import Config
    shapes = [(64, 64), (64, 64), (64,)]
    sched = AdaptiveSchedule(["q", "p", "b"], shapes, [True, True, False],
                             Compression.auto(window=10, families=("quantize", "powersgd")),
                             Config())
    sched.candidates[0] = [c for c in sched.candidates[0] if c.family is not Family.POWERSGD]
    assert [s for s in range(12) if sched.wants(s, 0)] == [0, 3, 6, 9]
    assert [s for s in range(12) if sched.wants(s, 1)] == list(range(10))
    assert not any(sched.wants(s, 2) for s in range(12))
    g = torch.Generator().manual_seed(5)
    for step in range(10):
        grads = [torch.randn(s, generator=g) if sched.wants(step, i) else None
                 for i, s in enumerate(shapes)]
        sched.observe(step, [0, 1, 2], grads)  # a None read would raise
    assert sched._counts == {"q": 4, "p": 4}


def test_a_gradient_that_is_not_finite_is_not_measured():
    # a loss-scaling overflow's step (inf or nan in a gradient) would make every error of
    # the layer infinite for the window: it is skipped, as an all-zero gradient is
    from cgx.policy.levels import AdaptiveSchedule
    from cgx.config import Config
    sched = AdaptiveSchedule(["w", "v"], [(64, 64), (64, 64)], [True, True],
                             Compression.auto(window=4, families=("quantize",)), Config())
    g = torch.Generator().manual_seed(2)
    for step in range(4):  # every step sampled
        bad = torch.randn(64, 64, generator=g)
        bad[3, 5] = float("inf") if step == 1 else float("nan") if step == 2 else bad[3, 5]
        sched.observe(step, [0, 1], [bad, torch.randn(64, 64, generator=g)])
    assert sched._counts == {"w": 2, "v": 4}
    assert all(math.isfinite(e) for e in sched._sums["w"])
