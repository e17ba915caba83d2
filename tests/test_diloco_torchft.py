"""cgx.torch.DiLoCo against torchft's DiLoCo (``torchft.local_sgd``, the pinned 0.2.0) on 2
real Gloo ranks: with exact outer gradients both take the same steps, and the benchmark's
``torchft-diloco`` method (benchmarks/timetoacc/methods_torchft.py) runs torchft as it is."""

import pytest
import torch

from spawn import run_gloo
from test_diloco_torch import _model, _train

pytestmark = pytest.mark.multiproc

H, ROUNDS = 3, 3


def test_streaming_fragments_hold_every_parameter_once():
    """torchft syncs modules: the benchmark's fragments hold the model's own tensors, each
    once, in cgx's partition."""
    from benchmarks.timetoacc.methods_torchft import fragments
    from benchmarks.timetoacc.workloads import make
    from cgx.diloco.schedule import balanced_fragments
    model = make("lm", 0, 1, 0, tiny=True).model
    parts = fragments(model, 5)
    held = [p for part in parts for p in part.parameters()]
    assert [id(p) for p in held] == [id(p) for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    assert [sum(p.numel() for p in part.parameters()) for part in parts] == \
        [sum(sizes[i] for i in g) for g in balanced_fragments(sizes, 5)]


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def _runs(rank, world):
    import cgx.torch as hvd
    from benchmarks.timetoacc import methods_torchft
    hvd.init()
    runs = {}
    for name, outer in (("cgx", "default"), ("cgx-averaging", None)):
        model = _model()
        kwargs = {} if outer == "default" else {"outer_optimizer": None}
        opt = hvd.DiLoCo(model, _adamw(model.parameters()), sync_every=H,
                         compression=hvd.Compression.exact, **kwargs)
        runs[name] = _train(hvd, opt, model, rank, H * ROUNDS)
    model = _model()
    setup = methods_torchft.build(f"torchft-diloco-h{H}", model, _adamw, world)
    try:
        runs["torchft"] = _train(None, setup["optimizer"], model, rank, H * ROUNDS)
    finally:
        setup["close"]()
    runs["torchft-bytes"] = setup["accounted_bytes"](H * ROUNDS)
    return runs


@pytest.fixture(scope="module")
def runs():
    return run_gloo(_runs, 2)


def test_exact_outer_gradients_take_torchfts_steps(runs):
    """Nesterov outer SGD (lr 0.7, momentum 0.9) on the averaged parameter change, every H
    AdamW steps: cgx's parameters after every step are torchft's, bit for bit, on both
    ranks; plain averaging (``outer_optimizer=None``) is not."""
    for rank in runs:
        for step, (ours, theirs) in enumerate(zip(rank["cgx"], rank["torchft"]), 1):
            assert torch.equal(ours, theirs), step
        averaged = rank["cgx-averaging"][-1]
        assert not torch.allclose(averaged, rank["torchft"][-1], rtol=1e-3, atol=1e-4)


def test_torchft_ranks_agree_after_each_sync_and_differ_between(runs):
    a, b = runs[0]["torchft"], runs[1]["torchft"]
    for step in range(1, H * ROUNDS + 1):
        assert torch.equal(a[step - 1], b[step - 1]) == (step % H == 0), step
    params = sum(p.numel() for p in _model().parameters())
    # One fp32 ring allreduce of every parameter per round (2 ranks: the whole vector).
    assert runs[0]["torchft-bytes"] == ROUNDS * 4 * params
