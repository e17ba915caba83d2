"""compression=Compression.auto(objective="time") in real 2- and 3-rank jobs: the ranks agree
on every trial measurement and on the plan kept, the error budget holds, a resumed run keeps
the plan and what the trials learned."""

from __future__ import annotations

import pytest
import torch

from cgx.policy.trials.rounds import resolution
from spawn import run_gloo

WINDOW, TRIAL_STEPS = 3, 1
# window 3, warm-up 3, then 3-5 plans x (1 settle + 1 measured) steps and up to three
# runoff passes of at most as many: decided by step 46
STEPS = 50


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _optimizer(hvd, model, runoff_margin=None, **kw):
    import dataclasses
    comp = hvd.Compression.auto(objective="time", window=WINDOW, trial_steps=TRIAL_STEPS,
                                recheck_every=0, **kw)
    if runoff_margin is not None:  # (every plan within it runs again)
        comp.trials = dataclasses.replace(comp.trials, runoff_margin=runoff_margin)
    return hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                    named_parameters=model.named_parameters(), compression=comp)


def _steps(opt, model, rank, steps, seed=0):
    g = torch.Generator().manual_seed(100 * seed + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _train(rank, world, steps, kw):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = _optimizer(hvd, model, **kw)
    _steps(opt, model, rank, steps)
    return {"rounds": opt.exchange_trials(), "levels": [r["level"] for r in opt.compression_plan()],
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_agrees_on_the_trials_and_keeps_the_same_plan(world):
    # the first runoff pass: every plan, by a margin no step misses
    ranks = run_gloo(_train, world, STEPS, {"runoff_margin": 100.0})
    first = ranks[0]
    assert len(first["rounds"]) == 1
    r = first["rounds"][0]
    assert r["start"] == WINDOW
    labels = [p["label"] for p in r["plans"]]
    assert {"exact (fused)", "uniform 4-bit/1024"} <= set(labels)  # the baselines, always
    predicted = [p["predicted_s"] for p in r["plans"]]
    assert predicted == sorted(predicted)  # the likely fastest first
    assert all(p["measured_s"] > 0 for p in r["plans"])
    # a runoff pass: every plan that finished its turn again, in the reverse order (later
    # passes: the plans still tied with the fastest)
    K = len(labels)
    assert r["runoffs"] >= 1 and r["turns"][:K] == list(range(K)), r["turns"]
    first_runoff = r["turns"][K:2 * K]
    assert sorted(first_runoff, reverse=True) == first_runoff and len(r["turns"]) > K
    assert all(r["plans"][k]["samples"] >= 2 * TRIAL_STEPS for k in first_runoff)
    for other in ranks[1:]:  # the same agreed measurements, the same choice, the same plan
        assert other["rounds"] == first["rounds"]
        assert other["levels"] == first["levels"]
        assert all(torch.equal(a, b) for a, b in zip(first["params"], other["params"]))
    # the kept plan is the fastest measured within the budget, or ties it (2%, or wider as
    # the round's steps spread: what the clock cannot resolve) with a smaller error or,
    # at equal error, fewer bytes
    kept = next(p for p in r["plans"] if p["label"] == r["chosen"])
    fastest = min((p for p in r["plans"] if p["eligible"]), key=lambda p: p["measured_s"])
    margin = max(0.02, resolution(r["step_noise"], fastest["samples"], kept["samples"]))
    assert kept["eligible"] and kept["measured_s"] <= fastest["measured_s"] * (1 + margin)
    assert kept is fastest or (kept["error"], kept["bytes"]) < (fastest["error"],
                                                               fastest["bytes"])


@pytest.mark.multiproc
@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_no_plan_tried_or_kept_exceeds_the_error_budget(alpha):
    a, _ = run_gloo(_train, 2, STEPS, {"alpha": alpha})
    r = a["rounds"][0]
    assert r["budget"] > 0
    uniform = r["budget"] / alpha  # the uniform default's measured error
    for p in r["plans"]:
        assert p["eligible"] == (p["error"] <= r["budget"] * (1 + 1e-9) or p["kind"] == "exact")
        assert p["eligible"]  # only plans within the budget are tried
    kept = next(p for p in r["plans"] if p["label"] == r["chosen"])
    assert kept["error"] <= alpha * uniform * (1 + 1e-9)
    labels = [p["label"] for p in r["plans"]]
    # at half the uniform default's error, the uniform default itself is out
    assert ("uniform 4-bit/1024" in labels) == (alpha >= 1.0)


def _resume(rank, world, trace):
    import contextlib
    import io
    import os
    import cgx.torch as hvd
    os.environ["CGX_VERBOSE"] = "1"
    hvd.init()
    hvd.start_timeline(trace)
    model = _model()
    opt = _optimizer(hvd, model)
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        _steps(opt, model, rank, STEPS)
    hvd.stop_timeline()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    levels = [r["level"] for r in opt.compression_plan()]
    fresh = _model()
    opt2 = _optimizer(hvd, fresh)
    fresh.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    restored = [r["level"] for r in opt2.compression_plan()]
    decider = state["opt"]["cgx"]["plan"]["decider"]["trials"]
    _steps(opt2, fresh, rank, 6, seed=1)  # no new round: the plan and the corrections stay
    after = opt2.state_dict()["cgx"]["plan"]["decider"]["trials"]
    from cgx.timeline import load, rank_path
    marks = [(e["name"], e.get("args", {}).get("plan")) for e in load(rank_path(trace, rank))
             if e.get("ph") == "i" and e["name"] in ("trials", "trial", "decided")]
    return {"levels": levels, "restored": restored, "rounds": (decider["rounds"], after["rounds"]),
            "marks": marks, "printed": printed.getvalue(), "tried": opt.exchange_trials(),
            "corrections": (decider["corrections"], after["corrections"]),
            "phase": after["phase"], "levels_after": [r["level"] for r in opt2.compression_plan()]}


@pytest.mark.multiproc
def test_a_resumed_run_keeps_the_plan_and_the_learned_corrections(tmp_path):
    a, b = run_gloo(_resume, 2, str(tmp_path / "trace.json"))
    # the trials are visible: on the timeline's decider row, and printed by rank 0
    plans, turns = a["tried"][0]["plans"], a["tried"][0]["turns"]
    assert sorted(set(turns)) == list(range(len(plans)))  # each plan, runoffs after
    tried = [plans[k]["label"] for k in turns]
    assert a["marks"] == b["marks"] == [("trials", None)] + [("trial", t) for t in tried] + [
        ("decided", a["tried"][0]["chosen"])]
    assert "after trials" in a["printed"] and "| plan | measured step |" in a["printed"]
    assert "after trials" not in b["printed"]
    for out in (a, b):
        del out["marks"], out["printed"]
    assert a == b
    assert a["restored"] == a["levels"] == a["levels_after"]
    assert a["rounds"] == (1, 1) and a["phase"] == "decided"
    assert a["corrections"][0] == a["corrections"][1] and a["corrections"][0]
