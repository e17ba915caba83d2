"""compression=Compression.planned(): traced, calibrated and planned in a real 2-rank job."""

from __future__ import annotations

import json

import pytest
import torch

from spawn import run_gloo

STEPS = 6


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _train(rank, world, compression_kwargs, exact=False):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    comp = hvd.Compression.exact if exact else hvd.Compression.planned(**compression_kwargs)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    g = torch.Generator().manual_seed(rank)
    seen_before = []
    for step in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        seen_before.append(None if exact else opt.exchange_plan() is not None)
    out = {"params": [p.detach().clone() for p in model.parameters()], "seen": seen_before}
    if not exact:
        p = opt.exchange_plan()
        out["chosen"] = [o.name for o in p.chosen]
        out["levels"] = [r["level"] for r in opt.compression_plan()]
        out["state"] = opt.state_dict()
        # A resumed run continues with the plan: no second calibration.
        fresh = _model()
        opt2 = hvd.DistributedOptimizer(torch.optim.SGD(fresh.parameters(), lr=0.05),
                                        named_parameters=fresh.named_parameters(),
                                        compression=hvd.Compression.planned(**compression_kwargs))
        opt2.load_state_dict(out["state"])
        out["restored_levels"] = [r["level"] for r in opt2.compression_plan()]
    return out


@pytest.mark.multiproc
def test_slow_link_plan_is_the_same_on_every_rank_and_compresses_the_weights():
    a, b = run_gloo(_train, 2, {"calibrate_steps": 3, "assume_gbit": 0.001})
    # Planned at the first reduction of step 3: exchange_plan() is set from then on.
    assert a["seen"] == [False, False, False, True, True, True] == b["seen"]
    assert a["chosen"] == b["chosen"]
    assert a["levels"] == b["levels"]
    # At 1 Mbit/s every quantizable weight is worth compressing; biases stay exact (rules).
    assert a["levels"] == ["4-bit/1024", "exact", "4-bit/1024", "exact", "4-bit/1024", "exact"]
    assert a["restored_levels"] == a["levels"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert a["state"]["cgx"]["plan"]["planned"]["chosen"] == [True, False, True, False, True,
                                                              False]


def _grads_as_planned(rank, world, compression_kwargs):
    """Per step: each rank's own gradients (a plain copy of the model), what the planned
    exchange averaged, and the level the plan gave each tensor at that step."""
    import copy
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.planned(**compression_kwargs))
    g = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        plain = copy.deepcopy(model)  # no cgx hooks: this rank's own gradients
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        steps.append({"local": [p.grad.clone() for p in plain.parameters()],
                      "reduced": [p.grad.clone() for p in model.parameters()],
                      "levels": [r["level"] for r in opt.compression_plan()]})
        with opt.skip_synchronize():
            opt.step()
    return {"steps": steps, "chosen": [o.name for o in opt.exchange_plan().chosen]}


def _quantizer_bound(local: list, out: torch.Tensor, bits: int) -> float:
    """SRA's error bound with stochastic rounding (cgx.collectives.algorithms): each
    peer's share under one unit of its bucket, scaled by 1/W, and the final
    requantization under one unit of the sum's; a unit is at most the tensor's range
    over 2^bits - 1 levels."""
    levels = 2 ** bits - 1
    peers = (len(local) - 1) / len(local) * max(float(t.max() - t.min()) for t in local) / levels
    # the requantized sum is off the exact one by the peers' share: its range too
    return peers + (float(out.max() - out.min()) + 2 * peers) / levels


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_fast_link_keeps_everything_exact_and_matches_the_exact_exchange(world):
    # the planner's plan itself, without trials (tests/trials/test_planned_trials.py)
    ranks = run_gloo(_grads_as_planned, world, {"calibrate_steps": 2, "assume_gbit": 1e6,
                                                 "trials": False})
    assert set(ranks[0]["chosen"]) == {"exact"}
    levels = [s["levels"] for s in ranks[0]["steps"]]
    # Steps 0-1 trace with the uniform 4-bit exchange (biases exact by the rules); from
    # step 2 the plan sends everything exact.
    assert levels[:2] == [["4-bit/1024", "exact"] * 3] * 2
    assert levels[2:] == [["exact"] * 6] * (STEPS - 2)
    for step in range(STEPS):
        for i, level in enumerate(levels[step]):
            local = [r["steps"][step]["local"][i] for r in ranks]
            exact = sum(local) / world
            for r in ranks:
                out = r["steps"][step]["reduced"][i]
                assert torch.equal(out, ranks[0]["steps"][step]["reduced"][i])
                err = float((out - exact).abs().max())
                if level == "exact":  # what the exact exchange gives, to float32 rounding
                    assert torch.allclose(out, exact, rtol=1e-6, atol=1e-8), (step, i, err)
                else:  # quantized: off, but within the quantizer's bound
                    assert 0 < err <= _quantizer_bound(local, exact, 4), (step, i, err)


def _resumable(rank, world, steps, saved=None):
    """Drift checks every 2 steps with a tolerance no measurement meets, so every check
    re-plans except the one right after a re-plan (see the drift test below). ``saved``:
    per rank, the state of a run stopped earlier, which this fresh process continues."""
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=hvd.Compression.planned(calibrate_steps=2, replan_every=2,
                                            drift_tolerance=1e-9, assume_gbit=0.001,
                                            trials=False),
        sufficient_factors=model)  # (found layers would be found again on resume: a step late)
    start, plan_on_load = 0, None
    if saved is not None:
        saved = saved[rank]
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["next_step"]
        p = opt.exchange_plan()
        plan_on_load = None if p is None else p.step_s
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * rank + step)  # the same data when resumed
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"checks": [(c.step, c.replanned) for c in opt.exchange_checks()],
            "ratios": {c.step: c.expected_ratio for c in opt.exchange_checks()},
            "predicted": {c.step: c.predicted_s for c in opt.exchange_checks()},
            "plan_on_load": plan_on_load,
            "step_s": None if opt.exchange_plan() is None else opt.exchange_plan().step_s,
            "model": model.state_dict(), "opt": opt.state_dict(), "next_step": steps,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
def test_a_resumed_run_checks_for_drift_and_replans_like_the_uninterrupted_one():
    full = run_gloo(_resumable, 2, 9)
    # Planned at step 2; checks at 4 (re-plan), 6 (takes the model's bias), 8 (re-plan)...
    expected = [(4, True), (6, False), (8, True)]
    assert full[0]["checks"] == expected == full[1]["checks"]
    # Stopped after step 4 (just re-planned for drift), continued in fresh processes.
    first = run_gloo(_resumable, 2, 5)
    assert first[0]["checks"] == expected[:1]
    resumed = run_gloo(_resumable, 2, 9, first)
    for r in range(2):
        saved, again = first[r], resumed[r]
        # The plan came back with the checkpoint: exchange_plan() and its prediction.
        assert again["plan_on_load"] is not None and again["plan_on_load"] == saved["step_s"]
        assert again["checks"] == expected  # the same checks, the same re-plans
        # Step 6 compared with the plan made at step 4 and took its ratio as the model's
        # bias (the first check after a drift re-plan); step 8 was judged against it.
        assert again["predicted"][6] == saved["step_s"]
        assert again["ratios"][8] == again["ratios"][6] != 1.0
        for p, q in zip(again["params"], full[r]["params"]):
            assert torch.equal(p, q)


@pytest.mark.multiproc
def test_measured_link_plans_alike_on_every_rank():
    a, b = run_gloo(_train, 2, {"calibrate_steps": 2})
    assert a["chosen"] == b["chosen"] and len(a["chosen"]) == 6


def _train_checked(rank, world, tolerance, trace=None):
    import cgx.torch as hvd
    hvd.init()
    if trace:
        hvd.start_timeline(trace)
    model = _model()
    comp = hvd.Compression.planned(calibrate_steps=2, replan_every=2, drift_tolerance=tolerance,
                                   assume_gbit=0.001, trials=False)  # the planner's own checks
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    g = torch.Generator().manual_seed(rank)
    for _ in range(10):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    if trace:
        hvd.stop_timeline()
    return {"checks": [(c.step, c.measured_s, c.expected_ratio, c.replanned)
                       for c in opt.exchange_checks()],
            "predicted": [c.predicted_s for c in opt.exchange_checks()],
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
def test_drift_beyond_the_tolerance_replans_on_every_rank_alike(tmp_path):
    # Planned at step 2; checks at steps 4, 6, 8. No measurement equals the prediction
    # to 1e-9, so step 4 re-plans; step 6 (the first check after a drift re-plan) takes
    # the ratio it sees as the model's bias; step 8's ratio differs from it: re-plan.
    a, b = run_gloo(_train_checked, 2, 1e-9, str(tmp_path / "trace.json"))
    assert [c[0] for c in a["checks"]] == [4, 6, 8]
    assert [c[3] for c in a["checks"]] == [True, False, True]
    assert a["checks"][0][2] == 1.0 and a["checks"][2][2] != 1.0
    assert all(c[1] > 0 for c in a["checks"])
    assert a["checks"] == b["checks"]  # measured = the MAX over ranks: the same everywhere
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    # The plans (steps 2, 4, 8) and the checks are marked on the timeline.
    events = json.loads((tmp_path / "trace.json").read_text())
    marks = [e for e in events if e.get("ph") == "i" and e["name"] in ("plan", "drift check")]
    assert [(e["name"], e["args"]["step"]) for e in marks] == [
        ("plan", 2), ("drift check", 4), ("plan", 4), ("drift check", 6), ("drift check", 8),
        ("plan", 8)]
    assert marks[0]["args"]["choices"]["0.weight"] == "sra-4bit"
    assert marks[0]["args"]["choices"]["0.bias"] == "exact"


@pytest.mark.multiproc
def test_no_drift_keeps_the_plan():
    a, b = run_gloo(_train_checked, 2, 1e6)
    assert [(c[0], c[3]) for c in a["checks"]] == [(4, False), (6, False), (8, False)]
    assert len(set(a["predicted"])) == 1  # one plan throughout
    assert a["checks"] == b["checks"]


def test_settings_are_checked():
    from cgx.torch import Compression
    with pytest.raises(ValueError, match="calibrate_steps"):
        Compression.planned(calibrate_steps=1)
    with pytest.raises(ValueError, match="assume_gbit"):
        Compression.planned(assume_gbit=0)
    with pytest.raises(ValueError, match="1..8"):
        Compression.planned(bits=32)
    with pytest.raises(ValueError, match="replan_every"):
        Compression.planned(replan_every=-1)
    with pytest.raises(ValueError, match="drift_tolerance"):
        Compression.planned(drift_tolerance=0)
    with pytest.raises(ValueError, match="trial_steps=0 must be an int >= 1"):
        Compression.planned(trial_steps=0)
    with pytest.raises(TypeError, match="trials must be True or False"):
        Compression.planned(trials="yes")
    from cgx.compression import as_compressor
    with pytest.raises(ValueError, match="inside the gradient exchange of DistributedOptimizer"):
        as_compressor(Compression.planned())  # a policy: one collective cannot carry it out


def test_the_plan_weighs_sufficient_factors_against_its_compressed_option():
    from cgx.compression.planned_policy import PlannedCompression
    from cgx.quant.codec import QuantSpec
    from cgx.policy.planner.costs import CostModel
    from cgx.policy.planner.schedule import PlannedSchedule
    from cgx.sufficient_factors import worth_it
    sched = PlannedSchedule(["fc.weight", "frozen.weight"], [(512, 512), (512, 512)],
                            [QuantSpec(4, 1024), None], PlannedCompression())
    # Before a plan: Poseidon's byte rule.
    assert sched.prefer_factors("fc.weight", 64, 2, 512, 512) == worth_it(64, 2, 512, 512)
    sched.cost = CostModel.uniform(2, 1.0)
    # 4 rows: the factors are 64x smaller than the gradient, 8x smaller than its 4 bits.
    assert sched.prefer_factors("fc.weight", 4, 2, 512, 512)
    # 64 rows: the byte rule still says factors (half the float32 gradient), but 4-bit
    # sends a quarter of what the factors would: the plan keeps the gradient.
    assert worth_it(64, 2, 512, 512)
    assert not sched.prefer_factors("fc.weight", 64, 2, 512, 512)
    # A layer the rules keep exact has no 4-bit option: factors win where the bytes say so.
    assert sched.prefer_factors("frozen.weight", 64, 2, 512, 512)
    # The model is kept with the plan (a resumed run decides the same).
    again = PlannedSchedule(["fc.weight", "frozen.weight"], [(512, 512), (512, 512)],
                            [QuantSpec(4, 1024), None], PlannedCompression())
    again.load_state_dict(sched.state_dict())
    assert again.cost == sched.cost


def test_a_changed_set_of_gradients_is_traced_again_then_planned():
    """The optimizer rebuilds its exchange when parameters are frozen, unfrozen or added
    and loads the old state into it: the old plan does not fit the new set, so the new
    set is traced for calibrate_steps steps from the next one; the ready times of the
    gradients in both sets carry over by name."""
    from cgx.compression.planned_policy import PlannedCompression
    from cgx.policy.planner.schedule import PlannedSchedule
    from cgx.quant.codec import QuantSpec
    spec = QuantSpec(4, 1024)
    old = PlannedSchedule(["a.weight", "b.weight"], [(64, 64), (64, 64)], [spec, spec],
                          PlannedCompression(calibrate_steps=2, assume_gbit=1.0))
    traced = old.state_dict()
    traced["ready"] = [[0.3] * 3, [0.1] * 3]  # seconds after backward's first gradient
    old.load_state_dict(traced)
    old.replan(_TwoRanksHere(), step=2)
    assert old.chosen is not None and not old.due(7)
    new = PlannedSchedule(["b.weight", "c.weight"], [(64, 64), (64, 64)], [spec, spec],
                          PlannedCompression(calibrate_steps=2, assume_gbit=1.0))
    new.load_state_dict(old.state_dict())
    assert new.chosen is None and new.plan is None and new.specs() == [spec, spec]
    assert new.state_dict()["ready"] == [[0.1] * 3, []]
    assert new.cost == old.cost
    assert not new.due(7)  # tracing starts at the next step seen...
    new.begin_step(7, _TwoRanksHere())
    assert not new.due(8) and new.due(9)  # ...and lasts calibrate_steps steps
    new.begin_step(9, _TwoRanksHere())
    assert new.chosen is not None and new.planned_at == 9


def _sfb_planned(rank, world, rows=64):
    import cgx.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        compression=hvd.Compression.planned(calibrate_steps=2, assume_gbit=1.0),
        sufficient_factors=model)
    g = torch.Generator().manual_seed(rank)
    used = []
    for step in range(4):
        x = torch.randn(rows, 64, generator=g)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        used.append(dict(opt.sfb_used))
    chosen = {t.name: o.name for t, o in zip(opt.exchange_plan().tensors,
                                             opt.exchange_plan().chosen)}
    # A resumed optimizer sends the same layers as factors without planning again.
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                 torch.nn.Linear(512, 512))
    model2.load_state_dict(model.state_dict())
    opt2 = hvd.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.01), named_parameters=model2.named_parameters(),
        compression=hvd.Compression.planned(calibrate_steps=2, assume_gbit=1.0),
        sufficient_factors=model2)
    opt2.load_state_dict(opt.state_dict())
    opt2.zero_grad()
    model2(torch.randn(rows, 64, generator=g)).square().mean().backward()
    opt2.step()
    return {"used": used, "params": [p.detach() for p in model.parameters()], "plan": chosen,
            "resumed": dict(opt2.sfb_used)}


@pytest.mark.multiproc
def test_planned_mode_chooses_sufficient_factors_per_layer():
    a, b = run_gloo(_sfb_planned, 2)
    assert a["used"] == b["used"]
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)
    # 64 rows: while calibrating, Poseidon's rule sends the 512x512 layer as factors (64 x 2
    # x 1024 values < 512 x 512); once planned, its 4-bit exchange beats them at 1 Gbit/s.
    # The 512x64 layer never qualifies (64 x 2 x 576 > 512 x 64).
    assert a["used"][0] == {"0.weight": False, "2.weight": True}
    assert a["used"][-1] == {"0.weight": False, "2.weight": False}
    assert a["plan"]["2.weight"] != "sfb" and a["plan"] == b["plan"]
    assert a["resumed"] == a["used"][-1]  # the restored plan decides, not the byte rule


@pytest.mark.multiproc
def test_the_plan_itself_offers_sufficient_factors():
    """With 4 rows the factors of the 512x512 layer are 1/64 of its gradient: the plan's
    simulated step takes them (shown in its table), and the exchange follows the plan."""
    a, b = run_gloo(_sfb_planned, 2, 4)
    assert a["plan"] == b["plan"]
    assert a["plan"]["2.weight"] == "sfb"
    assert a["used"][-1] == {"0.weight": a["plan"]["0.weight"] == "sfb", "2.weight": True}
    assert a["resumed"] == a["used"][-1] == b["resumed"]
    for p, q in zip(a["params"], b["params"]):
        assert torch.equal(p, q)


class _TwoRanksHere:
    """A stand-in transport for a plan's bookkeeping: 2 ranks on this host, every rank
    with the same values (the agreed MAX is this rank's own)."""

    size, rank, device = 2, 0, torch.device("cpu")

    def allreduce(self, t, op=None):
        return None

    def allgather_object(self, obj):
        return [obj, obj]


@pytest.mark.parametrize("shared", [0.0, 1.0])
def test_ready_times_traced_beside_the_exchange_lose_its_cpu_work(monkeypatch, shared):
    """On shared cores the calibration steps' backward ran with the 4-bit exchange taking
    CPU beside it: the plan starts from the traced times minus that work, once."""
    import cgx.policy.planner.calibration as calibration
    from cgx.compression.planned_policy import PlannedCompression
    from cgx.quant.codec import QuantSpec
    from cgx.policy.planner import TensorProfile, options_for
    from cgx.policy.planner.schedule import PlannedSchedule
    monkeypatch.setattr(calibration, "contention", lambda *a, **k: shared)
    names, shapes = ["a.weight", "b.weight", "b.bias"], [(1024, 1024), (512, 1024), (512,)]
    sched = PlannedSchedule(names, shapes, [QuantSpec(4, 1024), QuantSpec(4, 1024), None],
                            PlannedCompression(assume_gbit=10.0))
    traced = [0.30, 0.12, 0.10]
    for q, t in zip(sched._ready, traced):
        q.extend([t] * 3)
    p = sched.replan(_TwoRanksHere())
    assert sched.cost.contention == shared
    # the exchange in use while tracing: 4-bit for the two weights, the bias exact
    busy = sum(options_for(TensorProfile(n, t.numel, 0.0), sched.cost,
                           families=("exact", "sra"))[1 if q else 0].cpu_s
               for n, t, q in zip(names, p.tensors, (True, True, False)))
    assert (busy > 0) == (shared > 0)
    scale = max(0.5, 1 - busy / 0.30)
    assert p.backward_s == pytest.approx(0.30 * scale)
    assert [t.ready_s for t in p.tensors] == pytest.approx([t * scale for t in traced])


def _placed(rank, world, slow_gpu):
    """A device profile given on CPU ranks: the plan weighs the GPU against the host's C
    path, and the exchange quantizes each tensor where the plan says (on a CPU tensor the
    host either way: the numerics are the same)."""
    import cgx.torch as hvd
    from cgx.collectives import offload
    from cgx.policy.planner.placement import DeviceProfile
    hvd.init()
    offloaded = []
    codec = offload.quantize

    def counted(*args, **kwargs):
        offloaded.append(1)
        return codec(*args, **kwargs)

    offload.quantize = counted
    # a GPU whose kernels crawl (1 MB/s) against a fast host: offloading wins; an H200's
    # figures: the GPU's kernels win
    profile = DeviceProfile(0.001, 0.001, ((1, 50.0),), ((1, 50.0),), 100.0, 100.0) \
        if slow_gpu else DeviceProfile.h200()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=hvd.Compression.planned(calibrate_steps=2, assume_gbit=0.001, trials=False,
                                            device_profile=profile),
        sufficient_factors=False)  # quantized tensors only
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    offload.quantize = codec
    return {"chosen": [o.name for o in opt.exchange_plan().chosen], "offloaded": len(offloaded),
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
def test_a_device_profile_places_each_quantized_tensor_and_the_exchange_follows():
    slow, _ = run_gloo(_placed, 2, True)
    fast, _ = run_gloo(_placed, 2, False)
    assert slow["chosen"] == ["sra-4bit@cpu", "exact"] * 3
    assert fast["chosen"] == ["sra-4bit", "exact"] * 3
    # planned at step 2: from then on the three weights go through the host's codec
    assert slow["offloaded"] > 0 and fast["offloaded"] == 0
    assert all(torch.equal(a, b) for a, b in zip(slow["params"], fast["params"]))


def test_a_device_profile_of_the_wrong_type_is_refused():
    from cgx.compression.planned_policy import PlannedCompression
    from cgx.policy.planner.schedule import PlannedSchedule
    with pytest.raises(TypeError, match="takes a cgx.policy.planner.placement.DeviceProfile"):
        PlannedSchedule(["w"], [(4, 4)], [None], PlannedCompression(device_profile="h200"))
