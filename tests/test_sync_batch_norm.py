"""hvd.SyncBatchNorm: statistics over the union of every rank's batch (Horovod's semantics),
checked against torch.nn.BatchNorm on the concatenated batch, on 2 and 3 real ranks with
different batch sizes per rank.

Horovod's own SyncBatchNorm runs on GPU tensors only, so the reference here is the
single-process BatchNorm it is defined to equal."""

from __future__ import annotations

import pytest
import torch

from spawn import run_gloo

C = 3


def _batches(world, shape_tail):
    g = torch.Generator().manual_seed(7)
    return [torch.randn((r + 2, C) + shape_tail, generator=g) * (r + 1) + r
            for r in range(world)]


def _sync_bn(rank, world, shape_tail, momentum):
    import cgx.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    bn = hvd.SyncBatchNorm(C, momentum=momentum)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
        bn.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    x = _batches(world, shape_tail)[rank].requires_grad_()
    out = {}
    for step in range(2):
        y = bn(x)
        # A loss that weighs channels differently, so every gradient term matters.
        (y * torch.arange(1.0, y[0].numel() + 1).view(y[0].shape)).sum().backward()
    out["y"], out["dx"] = y.detach(), x.grad.clone()
    out["dw"], out["db"] = bn.weight.grad.clone(), bn.bias.grad.clone()
    out["running"] = (bn.running_mean.clone(), bn.running_var.clone(),
                      int(bn.num_batches_tracked))
    bn.eval()
    out["eval"] = bn(x.detach())
    return out


@pytest.mark.parametrize("world,shape_tail,momentum", [(2, (4, 4), 0.1), (3, (5,), None)],
                         ids=["2ranks-2d", "3ranks-1d-cumulative"])
def test_matches_batchnorm_on_the_whole_batch(world, shape_tail, momentum):
    outs = run_gloo(_sync_bn, world, shape_tail, momentum)
    xs = _batches(world, shape_tail)
    full = torch.cat(xs).requires_grad_()
    ref = torch.nn.BatchNorm1d(C, momentum=momentum) if not shape_tail or len(shape_tail) == 1 \
        else torch.nn.BatchNorm2d(C, momentum=momentum)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor([1.0, 2.0, -0.5]))
        ref.bias.copy_(torch.tensor([0.1, 0.0, 0.3]))
    for step in range(2):
        y = ref(full)
        w = torch.arange(1.0, y[0].numel() + 1).view(y[0].shape)
        (y * w).sum().backward()
    rows = torch.tensor([x.shape[0] for x in xs]).cumsum(0).tolist()
    parts = lambda t: torch.tensor_split(t, rows[:-1])  # noqa: E731
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["y"], parts(y.detach())[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o["dx"], parts(full.grad)[r], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(o["running"][0], ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o["running"][1], ref.running_var, rtol=1e-5, atol=1e-6)
        assert o["running"][2] == 2
    # weight/bias gradients stay local (DistributedOptimizer averages them): their sum
    # over ranks is the whole batch's gradient.
    torch.testing.assert_close(sum(o["dw"] for o in outs), ref.weight.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(sum(o["db"] for o in outs), ref.bias.grad, rtol=1e-4, atol=1e-4)
    ref.eval()
    for r, o in enumerate(outs):
        torch.testing.assert_close(o["eval"], ref(xs[r]), rtol=1e-5, atol=1e-5)


def test_one_rank_and_bad_input():
    import cgx.torch as hvd
    from cgx import runtime
    runtime.shutdown()
    hvd.init()
    try:
        bn, ref = hvd.SyncBatchNorm(2), torch.nn.BatchNorm1d(2)
        x = torch.randn(6, 2)
        torch.testing.assert_close(bn(x), ref(x))
        torch.testing.assert_close(bn.running_var, ref.running_var)
        with pytest.raises(ValueError, match="expected at least 2D input"):
            bn(torch.randn(4))
    finally:
        hvd.shutdown()
