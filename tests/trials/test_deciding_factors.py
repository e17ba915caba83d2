"""The deciding mode given the model (``sufficient_factors=model``): its large linear layers
travel as sufficient factors where the planner prefers them, the trials decide the rest,
and the ranks agree on both."""

from __future__ import annotations

import pytest
import torch

from spawn import run_gloo


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _decide_with_factors(rank, world):
    import copy

    import cgx.torch as hvd
    from cgx.torch import Compression
    hvd.init()
    model = _model()
    comp = Compression.auto(objective="time", window=2, trial_steps=1, trial_warmup_steps=0,
                            recheck_every=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   sufficient_factors=model)
    used, exact_err = [], []
    for step in range(52):  # window 2, up to 6 plans x 2 steps, 3 runoffs of as many
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        ref = copy.deepcopy(model)  # this rank's own gradient, averaged exactly below
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        used.append(dict(opt.sfb_used))
        for name, p in model.named_parameters():
            if used[-1].get(name):  # factors rebuild the average exactly
                mean = hvd.allreduce(dict(ref.named_parameters())[name].grad,
                                     name=f"ref.{step}.{name}", compression=Compression.exact)
                exact_err.append(float((p.grad - mean).abs().max() / mean.abs().max()))
        with opt.skip_synchronize():
            opt.step()
    return {"rounds": opt.exchange_trials(), "used": used, "exact_err": exact_err,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
def test_factors_and_trials_together_and_the_same_on_every_rank():
    a, b = run_gloo(_decide_with_factors, 2)
    assert a["rounds"] == b["rounds"] and a["used"] == b["used"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert a["rounds"], "no round of trials: the conv layers had nothing to decide"
    assert any(u.get("5.weight") for u in a["used"]), a["used"]  # 2048 x 512: factors pay
    assert a["exact_err"] and max(a["exact_err"]) < 1e-5, a["exact_err"]
    tried = [p["label"] for p in a["rounds"][0]["plans"]]
    assert "exact (fused)" in tried, tried
    # the factors are measured, not only modelled: the uniform plan with and without them
    assert {"uniform 4-bit/1024, factors", "uniform 4-bit/1024, no factors"} <= set(tried)
    # and counted as they travel: the factor layer's bytes as factors and no error; sent
    # at 4 bits, the error auto measured on its gradients while the factors went (the
    # window's steps)
    rec = {p["label"]: p for p in a["rounds"][0]["plans"]}
    sfb, plain = rec["uniform 4-bit/1024, factors"], rec["uniform 4-bit/1024, no factors"]
    assert sfb["bytes"] < 0.2 * plain["bytes"] and sfb["error"] < plain["error"], (sfb, plain)
    assert any(u.get("5.weight") is False for u in a["used"]), a["used"]  # its turn ran


def _resumed_keeps_the_factor_say(rank, world):
    import cgx.torch as hvd
    from cgx.torch import Compression
    hvd.init()
    runs, saved = [], None
    for resume in (False, True):
        model = _model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
            compression=Compression.auto(objective="time", window=2, trial_steps=1,
                                         trial_warmup_steps=0, recheck_every=0),
            sufficient_factors=model)
        if resume:
            opt.load_state_dict(saved)
        used = []
        for step in range(52 if not resume else 3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            used.append(dict(opt.sfb_used))
        saved = opt.state_dict()
        runs.append({"rounds": opt.exchange_trials(), "used": used,
                     "factors": saved["cgx"]["plan"]["decider"]["factors"]})
    return runs


@pytest.mark.multiproc
def test_a_resumed_run_sends_the_factor_layers_as_the_kept_plan_said():
    for first, resumed in run_gloo(_resumed_keeps_the_factor_say, 2):
        assert first["rounds"] and resumed["rounds"] == first["rounds"]  # no new round
        # each tried plan's say on the factor layers came back with the checkpoint
        assert resumed["factors"] == first["factors"]
        assert True in first["factors"] and False in first["factors"]
        kept = first["used"][-1]
        assert all(u == kept for u in resumed["used"]), (kept, resumed["used"])
