"""One collective per compressor family per bucket: allreduce_many against one-by-one."""

from __future__ import annotations

import pytest
import torch

from spawn import run_gloo

SHAPES = [(64, 32), (128,), (7, 3, 3, 3), (0, 4), (300, 20), (5,)]


def _tensors(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=g) if 0 not in s else torch.zeros(s) for s in SHAPES]


def _make(kind):
    from cgx.compression import Compression
    return {"topk": lambda: Compression.topk(density=0.1, error_feedback=False),
            "topk-ef": lambda: Compression.topk(density=0.05),
            "powersgd": lambda: Compression.powersgd(rank=2, start_step=1,
                                                     min_compression_rate=1.5)}[kind]()


def _compare(rank, world, kind):
    import cgx.torch as hvd
    from cgx import runtime
    hvd.init()
    tr = runtime.transport()
    calls = {"allgather": 0, "allreduce": 0}
    for op in calls:
        real = getattr(tr, op)

        def counted(*a, _real=real, _op=op, **k):
            calls[_op] += 1
            return _real(*a, **k)
        setattr(tr, op, counted)
    fused, single = _make(kind), _make(kind)
    names = [f"t{i}" for i in range(len(SHAPES))]
    out = {"same": [], "close": [], "fused_calls": [], "single_calls": []}
    for step in range(3):
        ts = _tensors(rank, step)
        before = dict(calls)
        a = fused.allreduce_many([t.clone() for t in ts], tr, names)
        out["fused_calls"].append({k: calls[k] - before[k] for k in calls})
        before = dict(calls)
        b = [single.allreduce(t.clone(), tr, n) for t, n in zip(ts, names)]
        out["single_calls"].append({k: calls[k] - before[k] for k in calls})
        out["same"].append([torch.equal(x, y) for x, y in zip(a, b)])
        out["close"].append([torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b)])
        out.setdefault("shapes", [tuple(x.shape) for x in a])
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("kind", ["topk", "topk-ef"])
def test_topk_travels_in_one_allgather_bit_identical(world, kind):
    res = run_gloo(_compare, world, kind)
    for r in res:
        assert r["shapes"] == [tuple(s) for s in SHAPES]
        assert all(all(step) for step in r["same"]), r["same"]
        # One allgather for the bucket, against one per non-empty tensor.
        assert all(c == {"allgather": 1, "allreduce": 0} for c in r["fused_calls"])
        assert all(c["allgather"] == 5 for c in r["single_calls"])


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 3])
def test_powersgd_batches_p_and_q(world):
    res = run_gloo(_compare, world, "powersgd")
    for r in res:
        # Step 0 is before start_step: everything exact, one allreduce.
        assert r["fused_calls"][0] == {"allgather": 0, "allreduce": 1}
        # Then: exact tensors (1-D, too small to pay) in one, all P in one, all Q in one.
        assert r["fused_calls"][1:] == [{"allgather": 0, "allreduce": 3}] * 2
        assert all(c["allreduce"] > 3 for c in r["single_calls"][1:])
        assert all(all(step) for step in r["close"]), r["close"]
        if world == 2:  # two summands: every order gives the same float sums
            assert all(all(step) for step in r["same"]), r["same"]
