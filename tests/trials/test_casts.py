"""16-bit casts (fp16, bf16) as per-tensor candidates: their bytes and measured error, the
solver's handling of an overflowed cast, the families each objective offers, the fused
cast exchange on real ranks, and the deciding mode's 16-bit proposals."""

from __future__ import annotations

import math

import pytest
import torch

from cgx.policy.levels.candidates import CASTS, Candidate, Family, candidates_for, parse_families
from cgx.policy.levels.solver import solve
from cgx.policy.levels.stats import candidate_errors, cast_error
from cgx.compression import Compression
from cgx.compression.auto_policy import CASTS as CAST_NAMES, FAMILIES
from spawn import run_gloo


def test_a_cast_sends_two_bytes_a_value_and_round_trips_as_a_list():
    for f in CASTS:
        c = Candidate(f)
        assert c.wire_bytes((10, 7)) == 140
        assert c.traffic((10, 7), 2) == 140  # an allreduce: 2 (W - 1) / W of the payload
        assert c.label == f.value
        assert Candidate.from_list(c.as_list()) == c
    assert parse_families(("bf16", "FP16")) == (Family.BF16, Family.FP16)


def test_casts_are_candidates_only_where_offered():
    plain = candidates_for((64, 32), [Family.QUANTIZE])
    assert not any(c.family in CASTS for c in plain)
    both = candidates_for((64, 32), [Family.QUANTIZE, Family.FP16, Family.BF16])
    assert [c for c in both if c.family in CASTS] == [Candidate(Family.FP16),
                                                      Candidate(Family.BF16)]
    assert candidates_for((0,), [Family.FP16]) == [Candidate(Family.EXACT)]


def test_cast_error_is_what_the_cast_loses_and_infinite_on_overflow():
    g = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    fp16, bf16 = cast_error(g, Family.FP16), cast_error(g, Family.BF16)
    assert fp16 == pytest.approx(float((g.half().float() - g).norm()))
    assert bf16 == pytest.approx(float((g.bfloat16().float() - g).norm()))
    # fp16 keeps 11 significant bits, bf16 8: about 8x less error
    assert 4 < bf16 / fp16 < 16
    big = g.clone()
    big[3] = 1e6  # beyond float16's 65504
    assert cast_error(big, Family.FP16) == math.inf
    assert math.isfinite(cast_error(big, Family.BF16))
    errs = candidate_errors(g, [Candidate(Family.EXACT), Candidate(Family.BF16),
                                Candidate(Family.QUANTIZE, 4, 1024)])
    assert errs[0] == 0.0 and errs[1] == pytest.approx(bf16)
    assert errs[2] > 10 * bf16  # 4 bits lose far more than a 16-bit cast


def test_the_solver_never_picks_an_overflowed_cast():
    # layer 0: exact (4 bytes), fp16 overflowed (2 bytes, infinite error), bf16 (2, small)
    costs = [[4.0, 2.0, 2.0], [4.0, 1.0]]
    errors = [[0.0, math.inf, 0.5], [0.0, 0.4]]
    choice = solve(costs, errors, budget=1.0)
    assert choice.choice == [2, 1] and choice.error == pytest.approx(0.9)
    nan = solve([[4.0, 2.0]], [[0.0, float("nan")]], budget=1.0)
    assert nan.choice == [0]
    for native in (True, False):
        only = solve([[4.0, 2.0]], [[0.0, math.inf]], budget=1.0, native=native)
        assert only.choice == [0]


def test_the_deciding_objective_offers_the_casts_by_default_the_bytes_objective_does_not():
    assert Compression.auto().families == FAMILIES
    assert Compression.auto(objective="time").families == FAMILIES + CAST_NAMES
    named = Compression.auto(families=("quantize", "bf16"), objective="time")
    assert named.families == ("quantize", "bf16")
    with pytest.raises(ValueError, match="fp16, bf16"):
        Compression.auto(families=("fp8",))


# -- on real ranks ------------------------------------------------------------------------

def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _fp16_plan(rank, world, device):
    """A plan of fp16 everywhere (the fewest bytes within a tiny budget), then one step whose
    averaged gradient is compared with the cast's reduction of every rank's gradient.
    On CUDA (ranks sharing one GPU), Gloo carries the bytes through host memory."""
    import copy
    import os

    import torch.distributed as dist

    import cgx.torch as hvd
    from cgx import runtime
    if device == "cuda":
        os.environ["CGX_BACKEND"] = "gloo"
    hvd.init(device=device)
    tr = runtime.transport()
    halves = []
    real = tr.allreduce

    def counted(t, *a, **k):
        halves.append(t.dtype == torch.float16)
        return real(t, *a, **k)
    tr.allreduce = counted
    model = _model().to(device)
    comp = Compression.auto(families=("quantize", "fp16"), alpha=0.01, window=2,
                            error_feedback=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=comp)
    loss_fn = torch.nn.functional.cross_entropy
    for step in range(3):
        x, y = (t.to(device) for t in _batch(rank, step))
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    levels = [r["level"] for r in opt.compression_plan()]
    ref = copy.deepcopy(model)  # this rank's own gradient of the next batch, unreduced
    x, y = (t.to(device) for t in _batch(rank, 3))
    loss_fn(ref(x), y).backward()
    local = [p.grad.detach().cpu() for p in ref.parameters()]
    every = []
    for g in local:
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        every.append(parts)
    del halves[:]
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    averaged = [p.grad.detach().cpu() for p in model.parameters()]  # what was reduced
    return {"levels": levels, "averaged": averaged, "every": every, "halves": list(halves)}


@pytest.mark.multiproc
@pytest.mark.parametrize("world,device", [
    (2, "cpu"), (3, "cpu"),
    pytest.param(2, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_fp16_layers_travel_cast_in_one_fused_allreduce(world, device):
    ranks = run_gloo(_fp16_plan, world, device, timeout=300)
    for r in ranks:
        # the two large weights planned (the rules keep small tensors exact, unplanned)
        assert r["levels"] == ["fp16", "exact (not planned)"] * 2 + ["exact (not planned)"] * 2
        assert sum(r["halves"]) == 1  # both in one float16 allreduce
        for avg, other in zip(r["averaged"], ranks[0]["averaged"]):
            assert torch.equal(avg, other)  # the same on every rank
        for avg, parts in list(zip(r["averaged"], r["every"]))[0:4:2]:  # the two weights
            exact = sum(parts) / world
            assert not torch.equal(avg, exact)  # it was cast
            assert torch.allclose(avg, exact, rtol=0, atol=4e-3 * float(exact.abs().max()))
            if world == 2:  # one rounding of each half and one of their float16 sum
                cast = ((parts[0] / 2).half() + (parts[1] / 2).half()).float()
                assert torch.equal(avg, cast)


def _decide(rank, world):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    comp = Compression.auto(objective="time", window=2, trial_steps=1, trial_warmup_steps=0,
                            recheck_every=0, model_plans=10)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    # window 2, up to 7 plans x 2 steps, up to 3 runoff passes of as many: 58 at most
    for step in range(60):
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {"rounds": opt.exchange_trials(),
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
def test_the_deciding_mode_tries_the_16_bit_plans_within_the_budget():
    a, b = run_gloo(_decide, 2)
    assert a["rounds"] == b["rounds"]
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    plans = {p["label"]: p for p in a["rounds"][0]["plans"]}
    sixteen = plans["16-bit"]
    exact = plans["exact (fused)"]
    assert sixteen["eligible"] and sixteen["measured_s"] > 0
    planned = 32 * 256 + 256 * 64  # the two large weights (small tensors stay exact)
    assert exact["bytes"] - sixteen["bytes"] == 2 * planned  # 2 bytes a value, not 4
    assert 0 < sixteen["error"] < plans["uniform 4-bit/1024"]["error"] / 10


def _fused_cast(rank, world):
    import cgx.torch as hvd
    from cgx import runtime
    from cgx.comm.base import ReduceOp
    from cgx.exchange.per_layer import FusedCast
    hvd.init()
    tr = runtime.transport()
    out = {}
    for family in (Family.FP16, Family.BF16):
        fused = FusedCast(family)
        for op in (ReduceOp.AVERAGE, ReduceOp.SUM):
            for sizes in ([(300, 7), (5,), (64, 3, 3)], [(11,)], [(0,)]):  # smaller, empty
                g = torch.Generator().manual_seed(rank + 10 * len(sizes))
                ws = [torch.randn(*s, generator=g) * 3 for s in sizes]
                ref = fused.compressor.allreduce(torch.cat([w.reshape(-1) for w in ws]), tr,
                                                 op=op)
                got = fused.allreduce_many([w.clone() for w in ws], tr, [""] * len(ws), op)
                out[(family.value, op.name, sum(math.prod(s) > 0 for s in sizes))] = (
                    torch.cat([o.reshape(-1) for o in got]), ref, [o.shape for o in got])
    return out


@pytest.mark.multiproc
def test_fused_cast_reduces_in_place_as_the_compressor_does_bit_for_bit():
    for rank in run_gloo(_fused_cast, 3):
        for key, (got, ref, shapes) in rank.items():
            assert torch.equal(got, ref), key
            assert [tuple(s) for s in shapes] == {3: [(300, 7), (5,), (64, 3, 3)], 1: [(11,)],
                                                  0: [(0,)]}[key[2]], key
