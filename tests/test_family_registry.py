"""A compression family defined in this file alone (a compressor class and one
``configs.register``) is used fixed by DistributedOptimizer, by the DDP hook, and
survives a Keras config round trip. (Offering a new family to ``compression="auto"``
still takes a candidate entry in cgx.policy.levels.)"""

from __future__ import annotations

import json

import pytest
import torch

from cgx.compression import Compressor, Family, configs
from spawn import run_gloo


class RoundToStep(Compressor):
    """Toy family: values rounded to multiples of ``step``; the payload is float and sums."""

    family = Family.SUMMABLE
    summable = True
    config_type = "test-round-to-step"

    def __init__(self, step: float = 0.5):
        self.step = float(step)

    def compress(self, tensor, name=None):
        return torch.round(tensor / self.step) * self.step, None

    def decompress(self, payload, ctx):
        return payload

    def to_config(self) -> dict:
        return {"step": self.step}


configs.register(RoundToStep)


def _grads(rank: int, world: int, via: str) -> list:
    import cgx.torch as hvd
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.randn(6, 8) * (rank + 1)
    if via == "optimizer":
        hvd.init()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=RoundToStep(0.25))
        model(x).square().sum().backward()
        opt.synchronize()
    else:
        ddp = DDP(model)
        ddp.register_comm_hook(hvd.CGXState(ddp, compression=RoundToStep(0.25)), hvd.cgx_hook)
        ddp(x).square().sum().backward()
    torch.manual_seed(0)
    local = torch.nn.Linear(8, 4)
    local(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()], [p.grad for p in local.parameters()]


@pytest.mark.parametrize("via", ["optimizer", "ddp-hook"])
def test_the_family_reduces_as_it_says(via):
    results = run_gloo(_grads, 2, via)
    raw = [results[0][1], results[1][1]]
    for reduced, _ in results:
        for k, g in enumerate(reduced):
            rounded = [RoundToStep(0.25).compress(r[k])[0] for r in raw]
            torch.testing.assert_close(g, (rounded[0] + rounded[1]) / 2, rtol=0, atol=1e-6)
            assert not torch.allclose(g, (raw[0][k] + raw[1][k]) / 2)  # it did round


def test_the_family_round_trips_a_config_and_a_keras_optimizer():
    back = configs.from_config(json.loads(json.dumps(configs.to_config(RoundToStep(0.125)))))
    assert type(back) is RoundToStep and back.step == 0.125
    pytest.importorskip("tensorflow")
    keras = pytest.importorskip("keras")
    import cgx.tensorflow.keras as hvd
    from cgx.config import Config
    hvd.init(Config())
    try:
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), compression=RoundToStep(2.0))
        rebuilt = hvd.DistributedOptimizer.from_config(json.loads(json.dumps(opt.get_config())))
        assert type(rebuilt._compression) is RoundToStep and rebuilt._compression.step == 2.0
    finally:
        hvd.shutdown()
