"""reducescatter is a real reduce-scatter: exact (all-to-all of row slices) and quantized
(the first half of SRA), with Horovod's split of uneven first dimensions and half the
traffic of an allreduce."""

from __future__ import annotations

import torch

from spawn import run_gloo


def _rs(rank, world):
    import cgx.torch as hvd
    from cgx.quant import wire
    hvd.init()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10, 300, generator=g)
    out = {}
    q = hvd.Compression.quantize(bits=4, bucket_size=128, rounding="nearest")
    before = hvd.stats().wire_bytes  # a functional call's own traffic: this one's less 1000 B
    hvd.allreduce(torch.ones(250), name="probe")
    out["call_bytes"] = hvd.stats().wire_bytes - before - 2 * (world - 1) * 1000 // world
    before = hvd.stats().wire_bytes
    out["q"] = hvd.reducescatter(x, compression=q, name="q")
    out["q_bytes"] = hvd.stats().wire_bytes - before
    before = hvd.stats().wire_bytes
    hvd.allreduce(x, compression=q, name="q_all")
    out["all_bytes"] = hvd.stats().wire_bytes - before
    before = hvd.stats().wire_bytes
    out["exact"] = hvd.reducescatter(x, op=hvd.Sum, name="e")
    out["exact_bytes"] = hvd.stats().wire_bytes - before
    rows = [10 // world + (1 if c < 10 % world else 0) for c in range(world)]
    out["slot"] = max(wire.packed_nbytes(n * 300, 4, 128) for n in rows)
    return out


def test_quantized_and_exact_reduce_scatter_on_3_ranks():
    world = 3
    outs = run_gloo(_rs, world)
    xs = [torch.randn(10, 300, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    total = sum(xs)
    starts = [0, 4, 7, 10]  # Horovod's split of 10 rows over 3 ranks: 4, 3, 3
    for r, o in enumerate(outs):
        mine = slice(starts[r], starts[r + 1])
        torch.testing.assert_close(o["exact"], total[mine], rtol=1e-6, atol=1e-5)
        # Each peer's rows quantized once at 4 bits (nearest): error <= (W-1) * unit/2 / W.
        err = (o["q"] - total[mine] / world).abs().max().item()
        unit = max(float(x.max() - x.min()) for x in xs) / 15
        assert 0 < err <= (world - 1) * unit / 2 / world + 1e-6
        # What each rank handed to the transport, as counted there (hvd.stats()): one
        # all-to-all of quantized peer rows (slots padded to the largest slice, 4 rows where
        # the allreduce's chunks hold 10/3), half the allreduce's bytes; and what every
        # functional call sends before it (its consistency check: a few int64 values).
        digest = o["call_bytes"]
        assert 0 < digest <= 2 * (world - 1) * 64 // world
        assert o["q_bytes"] == (world - 1) * o["slot"] + digest
        assert o["q_bytes"] - digest <= 0.5 * (o["all_bytes"] - digest) * 4 / (10 / 3) * 1.05
        # exact: the rows of the largest slice (4 x 300 float32) to each of the W - 1 others
        assert o["exact_bytes"] == (world - 1) * 4 * 300 * 4 + digest
