"""A compression family defined in this file alone (a compressor class and one
``configs.register``) is used fixed by DistributedOptimizer, by the DDP hook, and
survives a Keras config round trip; one that also names its levels (``auto_levels``) is
offered to ``Compression.auto`` by its name, chosen, and reduced as it says."""

from __future__ import annotations

import contextlib
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


class BlockMean(Compressor):
    """Toy family offered to ``Compression.auto``: each block of ``block`` values sent as its
    mean (a linear map, so the payloads sum); ``block`` is its level."""

    family = Family.SUMMABLE
    summable = True
    config_type = "test-block-mean"

    def __init__(self, block: int = 16):
        self.block = int(block)

    def compress(self, tensor, name=None):
        flat = tensor.reshape(-1).float()
        pad = (-flat.numel()) % self.block
        means = torch.nn.functional.pad(flat, (0, pad)).view(-1, self.block).mean(1)
        return means, (tensor.shape, tensor.dtype, flat.numel())

    def decompress(self, payload, ctx):
        shape, dtype, n = ctx
        return payload.repeat_interleave(self.block)[:n].view(shape).to(dtype)

    def payload_nbytes(self, numel):
        return 4 * -(-numel // self.block)

    def to_config(self):
        return {"block": self.block}

    @classmethod
    def auto_levels(cls, shape):
        numel = 1
        for d in shape:
            numel *= d
        return [{"block": b} for b in (4, 16) if b < numel]


configs.register(BlockMean)


def _auto():
    from cgx.compression import Compression
    # a budget wide enough for the toy's coarse blocks, which send fewer bytes than 4 bits
    return Compression.auto(families=("quantize", "test-block-mean"), bits=(4,),
                            bucket_sizes=(1024,), alpha=50.0, window=2, adjust_every=4)


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(16, 32, generator=g)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))


def _auto_run(rank: int, world: int, via: str) -> dict:
    import cgx.torch as hvd
    from torch.nn.parallel import DistributedDataParallel as DDP
    hvd.init()
    model = _mlp()
    if via == "optimizer":
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       named_parameters=model.named_parameters(),
                                       compression=_auto())
        plan_of, trained = opt, model
    else:
        trained = DDP(model)
        opt = torch.optim.SGD(trained.parameters(), lr=0.05)
        plan_of = hvd.CGXState(trained, compression=_auto(), optimizer=opt)
        trained.register_comm_hook(plan_of, hvd.cgx_hook)
    for step in range(10):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.zero_grad()
        trained(_batch(step, rank)).square().mean().backward()
        if via == "optimizer":
            opt.synchronize()
        reduced = {n: p.grad.clone() for n, p in model.named_parameters()}
        with opt.skip_synchronize() if via == "optimizer" else contextlib.nullcontext():
            opt.step()
    local = []
    for r in range(world):  # every rank's own gradient of the last step
        m = _mlp()
        m.load_state_dict(before)
        m(_batch(step, r)).square().mean().backward()
        local.append({n: p.grad for n, p in m.named_parameters()})
    rows = plan_of.compression_plan()
    return {"rows": [(r["layer"], r["family"], r["level"]) for r in rows],
            "reduced": reduced, "local": local,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiproc
@pytest.mark.parametrize("world,via", [(2, "optimizer"), (2, "ddp-hook"), (3, "optimizer")])
def test_auto_chooses_the_registered_family_and_reduces_it_as_it_says(world, via):
    outs = run_gloo(_auto_run, world, via)
    rows = outs[0]["rows"]
    assert all(o["rows"] == rows for o in outs)  # one plan on every rank
    toy = [(layer, level) for layer, family, level in rows if family == "test-block-mean"]
    assert toy, rows  # auto offered the toy family and chose it where its bytes are fewest
    assert all(level.startswith("test-block-mean(block=") for _, level in toy)
    for o in outs[1:]:
        for p, q in zip(outs[0]["params"], o["params"]):
            assert torch.equal(p, q)
    if via != "optimizer":
        return  # the hook's buckets name their tensors by bucket: the optimizer's by layer
    for layer, level in toy:
        block = int(level.split("=")[1].rstrip(")"))
        expected = sum(BlockMean(block).decompress(*BlockMean(block).compress(g[layer]))
                       for g in outs[0]["local"]) / world
        torch.testing.assert_close(outs[0]["reduced"][layer], expected, rtol=0, atol=1e-6)


def test_auto_offering_the_family_round_trips_a_config_and_says_what_is_known():
    from cgx.compression import Compression
    back = configs.from_config(json.loads(json.dumps(configs.to_config(_auto()))))
    assert back.families == ("quantize", "test-block-mean")
    with pytest.raises(ValueError, match="test-block-mean"):  # the error lists it
        Compression.auto(families=("no-such-family",))
    with pytest.raises(ValueError, match="auto_levels"):
        Compression.auto(families=("test-round-to-step",))  # registered, but no levels
