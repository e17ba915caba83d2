"""Compressed allreduce on real Gloo ranks: identical results, bounded error.

Inputs are generated from (case, rank) seeds, so the test process recomputes
the exact reduction itself and checks every rank's result against it.
"""

import pytest
import torch

from cgx.config import Config, Rounding, ReductionType, Hierarchy
from cgx.quant.codec import QuantSpec
from spawn import run_gloo

NEAREST, STOCH = Rounding.NEAREST, Rounding.STOCHASTIC

# (numel, dtype, spec) per tensor: odd sizes, mixed dtypes and bit widths in one
# fused call, a zero tensor, many tiny tensors, an exact (spec None) tensor.
def _case_tensors(rounding):
    q = lambda bits, bucket=64: QuantSpec(bits, bucket, rounding)  # noqa: E731
    case = [(1, torch.float32, q(4)), (1023, torch.float32, q(4)), (1025, torch.float16, q(8)),
            (4099, torch.bfloat16, q(3, 128)), (70001, torch.float32, q(2, 1024)),
            (3000, torch.float32, None), (2048, torch.float32, q(5))]
    case += [(9, torch.float32, q(4, 8))] * 20
    return case


def _inputs(case, rank, seed):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    xs = []
    for i, (n, dtype, _) in enumerate(case):
        x = torch.randn(n, generator=g) * (1 + i)
        if i == 6:  # a tensor of zeros
            x.zero_()
        xs.append(x.to(dtype))
    return xs


def _reduce_worker(rank, world, case, seed, algorithm, op_name, pre, post, hier, block_mb,
                   cross_type=ReductionType.SRA):
    from cgx.comm.base import ReduceOp
    from cgx.comm.torch_dist import TorchTransport
    from cgx.collectives import Reducer

    t = TorchTransport()
    cfg = Config(pipeline_chunk_mb=block_mb, seed=7, cross_reduction=cross_type,
                 hierarchical=Hierarchy.ON if hier else Hierarchy.OFF)
    local = cross = None
    if hier:
        local = t.split([[0, 1], [2, 3]])
        cross = t.split([[0, 2], [1, 3]])
    red = Reducer(t, cfg, local=local, cross=cross)
    xs = _inputs(case, rank, seed)
    stats = red.allreduce(xs, [s for _, _, s in case], op=ReduceOp[op_name], algorithm=algorithm,
                          prescale_factor=pre, postscale_factor=post, name="grads")
    return xs, stats.wire_bytes


def _exact(case, world, seed, op_name, pre, post):
    acc = None
    for r in range(world):
        xs = [x.double() * pre for x in _inputs(case, r, seed)]
        acc = xs if acc is None else [a + x for a, x in zip(acc, xs)]
    scale = post / world if op_name == "AVERAGE" else post
    return [a * scale for a in acc]


def _bound(case, world, seed, pre, scale, exact, algorithm):
    """Documented per-tensor error bound (see cgx.collectives.algorithms).

    Per quantization the error is <= unit/2 (nearest) or < unit (stochastic),
    and a bucket's unit is <= (range of the whole tensor) / (2**bits - 1).
    SRA: W-1 peer contributions quantized once each, then the scaled sum once.
    RING: the running partial sum (range <= sum of input ranges) at W-1 hops,
    then the scaled sum once. ALLGATHER: each of the W contributions once.
    """
    bounds = []
    for i, (n, dtype, spec) in enumerate(case):
        ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
        rounding = 4 * ulp * (exact[i].abs().max().item() + 1e-30) * world
        if spec is None:
            bounds.append(rounding + 1e-6)
            continue
        levels = 2 ** spec.bits - 1
        per = 1.0 if spec.rounding is STOCH else 0.5
        ranges = [(x.double().max() - x.double().min()).item() * pre
                  for x in (_inputs(case, r, seed)[i] for r in range(world))]
        if algorithm is ReductionType.ALLGATHER:
            b = per * scale * sum(ranges) / levels
        else:
            peer_range = max(ranges) if algorithm is ReductionType.SRA else sum(ranges)
            stage1 = per * scale * (world - 1) * peer_range / levels
            out_range = (exact[i].max() - exact[i].min()).item() + 2 * stage1
            b = stage1 + per * out_range / levels
        bounds.append(b * 1.01 + rounding)
    return bounds


def _check(results, case, world, seed, op_name, pre, post, algorithm):
    exact = _exact(case, world, seed, op_name, pre, post)
    scale = post / world if op_name == "AVERAGE" else post
    bounds = _bound(case, world, seed, pre, scale, exact, algorithm)
    ref = results[0][0]
    for r, (xs, _) in enumerate(results):
        for i, x in enumerate(xs):
            assert torch.equal(x, ref[i]), f"rank {r} tensor {i} differs from rank 0"
    for i, x in enumerate(ref):
        err = (x.double() - exact[i]).abs().max().item()
        assert err <= bounds[i], f"tensor {i} {case[i]}: error {err} > bound {bounds[i]}"


def _all_algorithms_worker(rank, world, seed):
    out = {}
    for algorithm in ReductionType:
        for rounding in (NEAREST, STOCH):
            case = _case_tensors(rounding)
            out[algorithm, rounding] = _reduce_worker(rank, world, case, seed, algorithm,
                                                      "AVERAGE", 1.0, 1.0, False, 0.05)
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_algorithms_identical_and_bounded(world):
    """Every algorithm x rounding: all ranks bit-identical, error within the bound."""
    res = run_gloo(_all_algorithms_worker, world, 1)
    for algorithm in ReductionType:
        for rounding in (NEAREST, STOCH):
            per_rank = [r[algorithm, rounding] for r in res]
            _check(per_rank, _case_tensors(rounding), world, 1, "AVERAGE", 1.0, 1.0, algorithm)


@pytest.mark.multiproc
def test_sum_prescale_postscale_and_one_huge_tensor():
    case = [(3_000_001, torch.float32, QuantSpec(4, 1024, NEAREST)), (17, torch.float32, None)]
    res = run_gloo(_reduce_worker, 2, case, 3, ReductionType.SRA, "SUM", 0.5, 3.0, False, 4.0)
    _check(res, case, 2, 3, "SUM", 0.5, 3.0, ReductionType.SRA)
    # 4-bit with bucket 1024: ~7.9x fewer bytes than fp32 for the big tensor.
    wire = res[0][1]
    fp32_wire = 2 * 1 * 3_000_001 * 4 // 2
    assert fp32_wire / wire > 7.5


@pytest.mark.multiproc
def test_hierarchical_four_ranks():
    case = _case_tensors(NEAREST)
    res = run_gloo(_reduce_worker, 4, case, 5, ReductionType.SRA, "AVERAGE", 1.0, 1.0, True, 0.05)
    exact = _exact(case, 4, 5, "AVERAGE", 1.0, 1.0)
    ref = res[0][0]
    for xs, _ in res:
        assert all(torch.equal(a, b) for a, b in zip(xs, ref))
    # Four quantizations (local scatter, cross SRA twice, local gather): twice the SRA bound.
    bounds = _bound(case, 4, 5, 1.0, 0.25, exact, ReductionType.SRA)
    for i, x in enumerate(ref):
        assert (x.double() - exact[i]).abs().max().item() <= 2 * bounds[i]


def _cross_types_worker(rank, world):
    return {cross: _reduce_worker(rank, world, _case_tensors(NEAREST), 5, ReductionType.SRA,
                                  "AVERAGE", 1.0, 1.0, True, 0.05, cross)
            for cross in ReductionType}


@pytest.mark.multiproc
def test_hierarchical_cross_reduction_types():
    """CGX_CROSS_REDUCTION_TYPE (``Config.cross_reduction``) picks the algorithm between
    hosts: each one's result is the same on every rank and within the two-level bound,
    and they are not one algorithm (the allgather's sums its peers' payloads unrequantized)."""
    case = _case_tensors(NEAREST)
    res = run_gloo(_cross_types_worker, 4)
    exact = _exact(case, 4, 5, "AVERAGE", 1.0, 1.0)
    bounds = _bound(case, 4, 5, 1.0, 0.25, exact, ReductionType.SRA)
    for cross in ReductionType:
        ref = res[0][cross][0]
        for out in res:
            assert all(torch.equal(a, b) for a, b in zip(out[cross][0], ref)), cross
        for i, x in enumerate(ref):
            assert (x.double() - exact[i]).abs().max().item() <= 2 * bounds[i], (cross, i)
    sra, gather = res[0][ReductionType.SRA][0], res[0][ReductionType.ALLGATHER][0]
    assert not all(torch.equal(a, b) for a, b in zip(sra, gather))


def _exact_ops_worker(rank, world):
    from cgx.comm.base import ReduceOp
    from cgx.comm.torch_dist import TorchTransport
    from cgx.collectives import Reducer

    red = Reducer(TorchTransport(), Config())
    out = {}
    for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.SUM, ReduceOp.AVERAGE):
        xs = [torch.arange(5, dtype=torch.float32) * (rank + 1), torch.full((3,), rank + 1.0),
              torch.tensor([rank + 1], dtype=torch.int64)]
        # Compression specs are ignored for Min/Max: those always travel exact.
        red.allreduce(xs, [QuantSpec(4, 8, NEAREST), None, None], op=op)
        out[op.name] = xs
    return out


@pytest.mark.multiproc
def test_min_max_exact_and_plain_path_exact():
    res = run_gloo(_exact_ops_worker, 2)
    for out in res:
        assert torch.equal(out["MIN"][0], torch.arange(5.0))
        assert torch.equal(out["MAX"][1], torch.full((3,), 2.0))
        assert torch.equal(out["SUM"][1], torch.full((3,), 3.0))
        assert torch.equal(out["AVERAGE"][1], torch.full((3,), 1.5))
        assert out["SUM"][2].item() == 3


def _async_worker(rank, world):
    from cgx.comm.torch_dist import TorchTransport
    from cgx.collectives import Reducer

    spec = QuantSpec(4, 256, Rounding.STOCHASTIC)
    g = torch.Generator().manual_seed(rank)
    data = [[torch.randn(5000 + k, generator=g)] for k in range(6)]
    sync = Reducer(TorchTransport(), Config(seed=3))
    a = Reducer(TorchTransport(), Config(seed=3))
    copies = [[x.clone() for x in d] for d in data]
    for d in data:
        sync.allreduce(d, [spec])
    handles = [a.allreduce_async(d, [spec]) for d in copies]
    polled = handles[-1].poll()
    for h in handles:
        h.wait(timeout=60)
    a.close()
    same = all(torch.equal(x, y) for d, c in zip(data, copies) for x, y in zip(d, c))
    return same, polled in (True, False), a.state_dict()


@pytest.mark.multiproc
def test_async_matches_sync_in_order():
    for same, poll_ok, state in run_gloo(_async_worker, 2):
        assert same and poll_ok
        assert state == {"calls": 6}


def test_validation_errors():
    from cgx.comm.base import SingleProcessTransport, ReduceOp
    from cgx.collectives import Reducer

    red = Reducer(SingleProcessTransport(), Config())
    with pytest.raises(TypeError, match="list of torch.Tensor"):
        red.allreduce(torch.ones(3))
    with pytest.raises(ValueError, match="one QuantSpec"):
        red.allreduce([torch.ones(3)], [None, None])
    with pytest.raises(TypeError, match="only float32"):
        red.allreduce([torch.ones(3, dtype=torch.int32)], [QuantSpec()])
    with pytest.raises(ValueError, match="not contiguous"):
        red.allreduce([torch.ones(4, 4).t()], [None])
    with pytest.raises(TypeError, match="QuantSpec or None"):
        red.allreduce([torch.ones(3)], ["4bit"])
    with pytest.raises(TypeError, match="ReduceOp"):
        red.allreduce([torch.ones(3)], op="sum")
    with pytest.raises(ValueError, match="both `local` and `cross`"):
        Reducer(SingleProcessTransport(), local=SingleProcessTransport())
    # One rank: average is the identity, exact.
    x = torch.randn(2000)
    y = x.clone()
    red.allreduce([y], [QuantSpec(2, 8, NEAREST)], op=ReduceOp.AVERAGE, postscale_factor=2.0)
    assert torch.equal(y, x * 2.0)


def _ef_worker(rank, world, steps, use_ef):
    from cgx.comm.torch_dist import TorchTransport
    from cgx.collectives import Reducer

    red = Reducer(TorchTransport(), Config())
    spec = QuantSpec(2, 64, NEAREST)  # coarse and biased: what error feedback is for
    g = torch.Generator().manual_seed(11 + rank)
    grad = torch.randn(3001, generator=g)  # the same gradient every step
    residual = torch.zeros(3001)
    total = torch.zeros(3001, dtype=torch.float64)
    for step in range(steps):
        x = grad.clone()
        red.allreduce([x], [spec], residuals=[residual] if use_ef else None, step=step)
        total += x.double()
    return total, grad


@pytest.mark.multiproc
def test_error_feedback_telescopes():
    """With residuals the dropped parts are re-sent: the summed output over T steps
    stays within one step's error of T * exact; without them a fixed bias grows with T."""
    steps = 20
    with_ef = run_gloo(_ef_worker, 2, steps, True)
    without = run_gloo(_ef_worker, 2, steps, False)
    grads = [r[1].double() for r in with_ef]
    exact = (grads[0] + grads[1]) / 2 * steps
    # One step's SRA bound for these inputs (see _bound): peer share + final quantization.
    levels = 3
    stage1 = 0.5 * 0.5 * max((x.max() - x.min()).item() for x in grads) / levels
    one_step = stage1 + 0.5 * ((exact / steps).max() - (exact / steps).min()).item() / levels
    # Residual sizes: each is at most one quantization step, so the gap stays bounded.
    err_ef = (with_ef[0][0] - exact).abs().max().item()
    err_plain = (without[0][0] - exact).abs().max().item()
    assert torch.equal(with_ef[0][0], with_ef[1][0])
    assert err_ef <= 2 * one_step, (err_ef, one_step)
    assert err_plain > 5 * err_ef, (err_plain, err_ef)


def _mixed_residuals_worker(rank, world, steps):
    from cgx.comm.torch_dist import TorchTransport
    from cgx.collectives import Reducer

    red = Reducer(TorchTransport(), Config())
    spec = QuantSpec(2, 64, NEAREST)
    g = torch.Generator().manual_seed(11 + rank)
    grads = [torch.randn(3001, generator=g), torch.randn(1000, generator=g)]
    residual = torch.zeros(3001)
    total = torch.zeros(3001, dtype=torch.float64)
    same = True
    for step in range(steps):
        xs = [t.clone() for t in grads]
        red.allreduce(xs, [spec, spec], residuals=[residual, None], step=step)
        plain = [t.clone() for t in grads]
        red.allreduce(plain, [spec, spec], step=step)
        same = same and torch.equal(xs[1], plain[1])
        total += xs[0].double()
    return total, grads[0], same


@pytest.mark.multiproc
def test_a_compressed_tensor_without_a_residual_beside_one_with():
    """A None residual for a compressed tensor (its compensation is none): that tensor is
    reduced as without error feedback, while its neighbour's residual telescopes."""
    steps = 12
    outs = run_gloo(_mixed_residuals_worker, 2, steps)
    exact = (outs[0][1].double() + outs[1][1].double()) / 2 * steps
    assert all(o[2] for o in outs)
    assert torch.equal(outs[0][0], outs[1][0])
    levels = 3
    one_step = max((g[1].max() - g[1].min()).item() for g in outs) / levels
    assert (outs[0][0] - exact).abs().max().item() <= one_step


def _residual_worker(rank, world, hierarchy):
    from cgx.comm.torch_dist import TorchTransport
    from cgx.collectives import Reducer

    t = TorchTransport()
    two_level = Reducer(t, Config(seed=7, hierarchical=Hierarchy(hierarchy)),
                        local=t.split([[0, 1], [2, 3]]), cross=t.split([[0, 2], [1, 3]]))
    flat = Reducer(t, Config(seed=7, hierarchical=Hierarchy.OFF))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(5000, generator=g)
    spec = [QuantSpec(4, 512, NEAREST)]
    out = {"hierarchical": two_level.hierarchical}
    try:
        a, ea = [x.clone()], [torch.zeros(5000)]
        two_level.allreduce(a, spec, algorithm=ReductionType.SRA, residuals=ea, name="g")
    except ValueError as err:
        out["error"] = str(err)
        # leave together: a rank that exits while another still connects its subgroups
        # closes the sockets that one waits on
        t.barrier()
        return out
    b, eb = [x.clone()], [torch.zeros(5000)]
    flat.allreduce(b, spec, algorithm=ReductionType.SRA, residuals=eb, name="g")
    c = [x.clone()]
    two_level.allreduce(c, spec, algorithm=ReductionType.SRA, name="g")  # no residuals
    d = [x.clone()]
    flat.allreduce(d, spec, algorithm=ReductionType.SRA, name="g")
    out.update(same=torch.equal(a[0], b[0]) and torch.equal(ea[0], eb[0]),
               residual=float(ea[0].abs().max()), two_level_differs=not torch.equal(c[0], d[0]))
    return out


@pytest.mark.multiproc
def test_error_feedback_reduces_flat_on_several_hosts_unless_two_levels_are_asked_for():
    # CGX_HIERARCHICAL=auto on 2 hosts x 2 ranks: a call with residuals goes flat (the same
    # result and residuals as the flat reducer's), one without goes in two levels
    for r in run_gloo(_residual_worker, 4, "auto"):
        assert r["hierarchical"] and r["same"] and r["residual"] > 0
        assert r["two_level_differs"]
    # asked for explicitly: the error says what to change
    for r in run_gloo(_residual_worker, 4, "on"):
        assert "CGX_HIERARCHICAL=auto" in r["error"]


def test_statistics_are_thread_safe():
    """``hvd.stats()`` (the reducer's snapshot) while other threads add statistics, as the
    engine thread and the training thread do: no addition lost, and every snapshot a
    consistent copy (fields added together are seen together)."""
    import threading
    from cgx.collectives.reducer import Reducer, ReduceStats
    from cgx.comm.base import SingleProcessTransport
    red = Reducer(SingleProcessTransport(), Config())
    seen = []

    def add():
        for _ in range(3000):
            red.add_stats(ReduceStats(steps=1, calls=2, exposed_seconds=0.5))

    def watch():
        for _ in range(1000):
            s = red.snapshot()
            seen.append((s.steps, s.calls, s.exposed_seconds))

    threads = [threading.Thread(target=add) for _ in range(4)] + [threading.Thread(target=watch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = red.snapshot()
    assert (total.steps, total.calls, total.exposed_seconds) == (12000, 24000, 6000.0)
    assert len(seen) == 1000 and all(c == 2 * s and e == 0.5 * s for s, c, e in seen)
    red.close()
