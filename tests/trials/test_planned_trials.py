"""Compression.planned() decides by trials: after the planner's plan, all exact (fused), all
at the fixed level and the planner's plan take turns, the ranks agree on the measured steps
and the fastest travels; a checkpoint keeps the decision; without trials the planner's plan
travels as predicted."""

from __future__ import annotations

import pytest
import torch

from cgx.policy.trials.rounds import resolution
from spawn import run_gloo
from test_deciding_adapters import _keras  # model.fit, the trials of either mode

pytestmark = pytest.mark.multiproc
STEPS = 14  # planned at step 2, warm-up 1, then 2 or 3 plans x (1 settling + 2 measured)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _compression(hvd, gbit, trials=True):
    return hvd.Compression.planned(calibrate_steps=2, assume_gbit=gbit, replan_every=0,
                                   trial_steps=2, trial_warmup_steps=1, trials=trials,
                                   trial_runoffs=0)  # (one pass: the turns' steps are fixed)


def _train(rank, world, gbit, steps=STEPS, saved=None, trials=True):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=_compression(hvd, gbit, trials))
    start = 0
    if saved is not None:
        model.load_state_dict(saved[rank]["model"])
        opt.load_state_dict(saved[rank]["opt"])
        start = saved[rank]["next"]
    g = torch.Generator().manual_seed(rank)
    levels = []
    for step in range(start, steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        levels.append(tuple(r["level"] for r in opt.compression_plan()))
    return {"rounds": opt.exchange_trials(), "levels": levels, "next": steps,
            "planner": [o.name for o in opt.exchange_plan().chosen],
            "model": model.state_dict(), "opt": opt.state_dict(),
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("world, gbit", [(2, 1e6), (3, 0.001)])
def test_every_rank_tries_the_same_plans_and_keeps_the_fastest(world, gbit):
    ranks = run_gloo(_train, world, gbit)
    first = ranks[0]
    assert len(first["rounds"]) == 1
    r = first["rounds"][0]
    labels = [p["label"] for p in r["plans"]]
    # the two fixed choices always; the planner's own plan when it differs from both: some
    # weights compressed, others not (the biases stay exact by the rules in every plan)
    assert {"exact (fused)", "uniform 4-bit/1024"} <= set(labels)
    assert ("planner" in labels) == (len(set(first["planner"][0::2])) > 1)
    assert all(p["measured_s"] > 0 and p["error"] == 0.0 and p["eligible"] for p in r["plans"])
    for other in ranks[1:]:
        assert other["rounds"] == first["rounds"] and other["levels"] == first["levels"]
        assert all(torch.equal(a, b) for a, b in zip(first["params"], other["params"]))
    # the fastest, or a plan the clock could not tell from it (2%, or wider as the round's
    # steps spread) that sends fewer bytes
    fastest = min(r["plans"], key=lambda p: p["measured_s"])
    kept = next(p for p in r["plans"] if p["label"] == r["chosen"])
    margin = max(0.02, resolution(r["step_noise"], fastest["samples"], kept["samples"]))
    assert kept["measured_s"] <= (1 + margin) * fastest["measured_s"]
    assert kept is fastest or kept["bytes"] < fastest["bytes"]
    # what travelled: each plan in its turn, then the kept one
    exact, uniform = ("exact",) * 6, ("4-bit/1024", "exact") * 3
    travelled = {"exact (fused)": exact, "uniform 4-bit/1024": uniform}
    turn = {labels[k]: first["levels"][3 + 3 * k] for k in range(len(labels))}
    for label, levels in turn.items():
        if label in travelled:
            assert levels == travelled[label]
    if r["chosen"] in travelled:
        assert first["levels"][-1] == travelled[r["chosen"]]


def test_a_resumed_run_keeps_the_decision_and_does_not_try_again():
    full = run_gloo(_train, 2, 0.001)
    done = full[0]["rounds"]
    assert len(done) == 1
    resumed = run_gloo(_train, 2, 0.001, STEPS + 4, full)
    for before, after in zip(full, resumed):
        assert after["rounds"] == done  # no second round
        assert set(after["levels"]) == {before["levels"][-1]}  # the kept plan travels on


def test_a_plan_restored_without_trials_is_tried_at_the_next_step():
    # a checkpoint of trials=False (or of a version before trials): the plan is there,
    # no decision; the run it resumes with trials tries the plan at once
    untried = run_gloo(_train, 2, 0.001, 6, None, False)
    a, b = run_gloo(_train, 2, 0.001, 16, untried)
    assert len(a["rounds"]) == 1 and a["rounds"] == b["rounds"]
    assert a["rounds"][0]["start"] == 6


def test_without_trials_the_planners_plan_travels():
    a, _ = run_gloo(_train, 2, 1e6, 6, None, False)
    # a fast link: the planner keeps all exact, from its plan at step 2 on
    assert a["rounds"] == [] and a["levels"][2:] == [("exact",) * 6] * 4


def test_keras_planned_mode_tries_the_same_plans_on_every_rank():
    a, b = run_gloo(_keras, 2, "planned")
    assert len(a["rounds"]) == 1 and a["rounds"] == b["rounds"]
    r = a["rounds"][0]
    labels = {p["label"] for p in r["plans"]}
    assert {"exact (fused)", "uniform 4-bit/1024"} <= labels and r["chosen"] in labels
    kept = ("exact",) * 6 if r["chosen"] == "exact (fused)" else None
    assert a["levels"] == b["levels"] and (kept is None or tuple(a["levels"]) == kept)
    assert all((x == y).all() for x, y in zip(a["weights"], b["weights"]))
