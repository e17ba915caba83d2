"""cgx.policy.planner: the step simulator on hand-made timelines, the planner's decisions where
the answer is known, and the greedy planner against brute force."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from cgx.policy.planner import (AlphaBeta, Collective, CostModel, Option, TensorProfile, format_exchange,
                         options_for, plan, simulate)
from cgx.policy.planner.calibration import contention
from cgx.policy.planner.simulator import advance, group_cost
from cgx.policy.planner.strategy import _apply, _compose, _terminal, fusion_groups
from cgx.sufficient_factors import worth_it


def _model(gbit=1.0, world=2, **kw):
    return CostModel.uniform(world, gbit, latency_s=1e-4, **kw)


# ------------------------------------------------------------------ simulator
def test_simulator_on_a_hand_made_timeline():
    """Two groups through three lanes, every time worked out by hand."""
    m = CostModel(2, {c: AlphaBeta(0.0, 1.0) for c in Collective})  # 1 s per byte: easy sums
    tensors = [TensorProfile("a", 1, ready_s=1.0), TensorProfile("b", 1, ready_s=2.0)]
    a = Option("x", 0.5, ((Collective.ALLGATHER, 3),), 0.25)
    b = Option("x", 0.5, ((Collective.ALLGATHER, 1),), 0.25)
    tl = simulate(tensors, [a, b], [[0], [1]], m, backward_s=4.0, tail_s=0.1)
    # a: compress 1.0-1.5, wire 1.5-4.5, decompress 4.5-4.75
    # b: compress 2.0-2.5, wire waits for a: 4.5-5.5, decompress 5.5-5.75
    assert tl.groups == ((1.0, 4.5, 4.75), (2.0, 5.5, 5.75))
    assert tl.step_s == pytest.approx(5.85)
    assert tl.exposed_s == pytest.approx(5.85 - 4.0 - 0.1)
    # Fused: one call of 4 bytes after both are ready and compressed (2.0 + 0.5 + 0.5).
    fused = simulate(tensors, [a, b], [[0, 1]], m, backward_s=4.0)
    assert fused.groups == ((2.0, 7.0, 7.5),)
    # Different options in one group make separate calls: alpha is paid twice.
    m2 = CostModel(2, {c: AlphaBeta(10.0, 0.0) for c in Collective})
    c = Option("y", 0.0, ((Collective.ALLGATHER, 1),), 0.0)
    assert group_cost([0, 1], tensors, [a, c], m2).comm == 20.0
    assert group_cost([0, 1], tensors, [a, b], m2).comm == 10.0


def test_shared_cores_take_the_exchanges_cpu_work_from_the_compute():
    """With contention, an exchange that hides under backward on the wire still takes its
    CPU time from the compute: the step is at least backward plus that work."""
    m = CostModel(2, {c: AlphaBeta(0.0, 1.0, cpu=0.5) for c in Collective}, contention=2.0,
                  compress_bps=4.0, decompress_bps=8.0)
    t = TensorProfile("a", 1, ready_s=0.0)
    exact, sra = options_for(t, m, families=("exact", "sra"))
    # exact: 4 bytes of ring allreduce -> 4 s on the wire, 0.5 x 4 CPU s, x2 contention
    assert exact.cpu_s == pytest.approx(4.0)
    wire = sum(b for _, b in sra.wire)
    assert sra.cpu_s == pytest.approx(sra.compress_s + sra.decompress_s + 2.0 * 0.5 * wire)
    tl = simulate([t], [exact], [[0]], m, backward_s=10.0, tail_s=1.0)
    assert tl.groups == ((0.0, 4.0, 4.0),)  # the wire is done long before backward ends
    assert tl.cpu_s == pytest.approx(4.0) and tl.step_s == pytest.approx(10.0 + 4.0 + 1.0)
    assert tl.exposed_s == pytest.approx(4.0)
    # The same cores with one to spare per rank: the exchange runs beside backward.
    free = dataclasses.replace(m, contention=0.0)
    e0 = options_for(t, free)[0]
    assert e0.cpu_s == 0.0
    assert simulate([t], [e0], [[0]], free, 10.0, 1.0).step_s == pytest.approx(11.0)
    with pytest.raises(ValueError, match="contention"):
        dataclasses.replace(m, contention=-1.0)


def test_contention_from_ranks_threads_and_cores():
    assert contention(2, threads=1, cores=2) == 1.0  # two ranks fill two cores
    assert contention(4, threads=1, cores=2) == 2.0  # four ranks on two: each CPU s costs two
    assert contention(2, threads=1, cores=4) == 0.0  # a core to spare per rank
    assert contention(1, threads=2, cores=2) == 1.0
    assert contention(2, threads=0, cores=2) == 0.0  # compute on a GPU
    with pytest.raises(ValueError, match="local_ranks"):
        contention(0, threads=1, cores=2)


def test_cost_model_round_trips_and_reads_the_older_form():
    m = CostModel(3, {c: AlphaBeta(1e-4, 2e-9, 3e-10) for c in Collective}, contention=1.5)
    assert CostModel.from_dict(m.to_dict()) == m
    old = m.to_dict()
    old["links"] = {k: v[:2] for k, v in old["links"].items()}
    del old["contention"]
    back = CostModel.from_dict(old)  # a checkpoint from before the CPU terms
    assert back.contention == 0.0 and all(ab.cpu == 0.0 for ab in back.links.values())


def test_folded_suffix_equals_the_simulation():
    rng = random.Random(3)
    for _ in range(200):
        costs = [group_cost([0], [TensorProfile("t", 1, rng.uniform(0, 2))],
                            [Option("o", rng.uniform(0, 1), ((Collective.ALLGATHER, 1),),
                                    rng.uniform(0, 1))],
                            CostModel(2, {c: AlphaBeta(0, rng.uniform(0, 2)) for c in Collective}))
                 for _ in range(rng.randint(1, 6))]
        lanes0 = tuple(rng.uniform(0, 3) for _ in range(3))
        backward, tail = rng.uniform(0, 4), rng.uniform(0, 0.5)
        lanes = lanes0
        for g in costs:
            lanes = advance(lanes, g)[0]
        direct = max(backward, lanes[1], lanes[2]) + tail
        f = _terminal(backward, tail)
        for g in reversed(costs):
            f = _compose(g, f)
        assert _apply(f, lanes0) == pytest.approx(direct)


# ------------------------------------------------------------ known decisions
def test_a_tensor_hidden_under_compute_stays_exact():
    m = _model(gbit=10.0)
    t = TensorProfile("early", 1 << 20, ready_s=0.0)  # 4 MB: 3.4 ms at 10 Gbit/s
    p = plan([t], m, backward_s=0.2)
    assert p.chosen[0].name == "exact" and p.timeline.exposed_s == 0.0
    # Ready at the very end of backward: now its exchange is exposed and compression pays.
    late = TensorProfile("late", 1 << 20, ready_s=0.2)
    q = plan([late], _model(gbit=1.0), backward_s=0.2)
    assert q.chosen[0].name != "exact"
    assert q.step_s < simulate([late], [options_for(late, _model(gbit=1.0))[0]], [[0]],
                               _model(gbit=1.0), 0.2).step_s


def test_a_huge_tensor_on_a_slow_link_is_compressed_and_not_on_a_fast_one():
    big = TensorProfile("fc", 64 << 20, ready_s=0.1)  # 256 MB of float32
    slow = plan([big], _model(gbit=1.0), backward_s=0.1)
    assert slow.chosen[0].name in ("sra-4bit", "allgather-4bit")
    # A link far faster than the compressor: compressing would only cost time.
    fast = plan([big], _model(gbit=400.0, compress_bps=1e9, decompress_bps=1e9, cast_bps=1e9),
                backward_s=0.1)
    assert fast.chosen[0].name == "exact"


def test_shared_cores_compress_a_hidden_tensor_whose_exact_exchange_costs_more_cpu():
    """A tensor that hides under backward on a fast link stays exact with a core to spare,
    and is compressed when the cores are shared and the exact allreduce's CPU work (copies,
    reduction) exceeds compressing and decompressing it."""
    big = TensorProfile("conv", 16 << 20, ready_s=0.0)  # 64 MB, ready at once
    kw = dict(compress_bps=8e9, decompress_bps=16e9, cast_bps=1e9)
    links = {c: AlphaBeta(5e-5, 8 / 10e9, cpu=1e-9) for c in Collective}  # 10 Gbit/s
    free = plan([big], CostModel(2, links, contention=0.0, **kw), backward_s=1.0)
    assert free.chosen[0].name == "exact" and free.timeline.exposed_s == 0.0
    shared = plan([big], CostModel(2, links, contention=1.0, **kw), backward_s=1.0)
    assert shared.chosen[0].name != "exact"
    exact_cpu = shared.options[0][0].cpu_s
    assert shared.step_s < 1.0 + exact_cpu


@pytest.mark.parametrize("world", [2, 4, 8])
def test_sufficient_factors_are_chosen_exactly_when_the_rule_allows(world):
    """Exact-only choices (fp32 or factors) on a slow link with a free rebuild: the planner
    picks the factors for exactly the batch sizes where K x P x (M + N) < M x N."""
    M, N = 1024, 512
    m = _model(gbit=1.0, world=world, matmul_flops=1e18)
    limit = M * N / (world * (M + N))
    for rows in sorted({1, 8, int(limit) - 1, int(limit), int(limit) + 1, 4 * int(limit)}):
        t = TensorProfile("fc.weight", M * N, ready_s=0.05, shape=(M, N), rows=rows)
        p = plan([t], m, backward_s=0.05, families=("exact", "sfb"))
        assert (p.chosen[0].name == "sfb") == worth_it(rows, world, M, N), (rows, limit)


# --------------------------------------------------------------- brute force
def _instance(rng):
    world = rng.choice([2, 4, 8])
    m = CostModel.uniform(world, rng.choice([1.0, 10.0, 25.0]), latency_s=rng.choice([5e-5, 1e-3]),
                          compress_bps=rng.uniform(0.5e9, 4e9), decompress_bps=rng.uniform(1e9, 8e9),
                          matmul_flops=rng.uniform(1e9, 1e11))
    if rng.random() < 0.5:  # shared cores: the exchange's CPU work counts
        cpu = rng.uniform(0.2e-9, 3e-9)
        m = dataclasses.replace(m, contention=rng.choice([1.0, 2.0]), links={
            c: dataclasses.replace(ab, cpu=cpu) for c, ab in m.links.items()})
    tensors = []
    for i in range(rng.randint(2, 5)):
        numel = rng.choice([1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24])
        shape = rows = None
        if rng.random() < 0.4:
            shape = (numel // 1024, 1024)
            rows = rng.choice([8, 32, 256])
        tensors.append(TensorProfile(f"t{i}", numel, rng.uniform(0, 0.3), shape, rows))
    return m, tensors, rng.uniform(0.05, 0.4)


def test_greedy_is_within_ten_percent_of_brute_force():
    rng = random.Random(0)
    ratios = []
    for _ in range(300):
        m, tensors, backward = _instance(rng)
        mb = rng.choice([1.0, 16.0, 1e6])
        p = plan(tensors, m, backward, fusion_mb=(mb,))
        # The plan's own prediction is the simulator's.
        assert p.step_s == pytest.approx(simulate(tensors, p.chosen, p.groups, m, backward).step_s)
        best = min(simulate(tensors, list(combo), p.groups, m, backward).step_s
                   for combo in itertools.product(*p.options))
        assert p.step_s >= best * (1 - 1e-9)
        ratios.append(p.step_s / best)
    assert max(ratios) <= 1.10, sorted(ratios)[-5:]


def test_fusion_boundaries_and_the_table():
    ts = [TensorProfile(f"l{i}", 1 << 18, ready_s=0.01 * (9 - i)) for i in range(10)]  # 1 MB each
    order = sorted(range(10), key=lambda i: ts[i].ready_s)
    assert fusion_groups(ts, order, 3e6) == [[9, 8, 7], [6, 5, 4], [3, 2, 1], [0]]
    p = plan(ts, _model(gbit=1.0), backward_s=0.1, fusion_mb=(1.0, 4.0))
    assert p.fusion_bytes in (1e6, 4e6)
    assert sorted(i for g in p.groups for i in g) == list(range(10))
    table = format_exchange(p, limit=3)
    assert table.count("\n| l") == 3 and "(7 smaller tensors)" in table
    for i in range(10):
        alts = dict(p.alternatives(i))
        assert alts[p.chosen[i].name] == pytest.approx(p.step_s)
        assert min(alts.values()) >= p.step_s * (1 - 0.10)
    with pytest.raises(ValueError, match="at least one tensor"):
        plan([], _model(), 0.1)
