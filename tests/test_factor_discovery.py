"""Sufficient factors without the model (``cgx.torch.factor_discovery``): the deciding
default finds the optimizer's linear layers in the first step, on every rank alike, and
sends them as factors from the second, with the gradients of ``sufficient_factors=False``;
on 2 and 3 real ranks."""

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(64, 256)   # K*P*(M+N) < M*N: factors
        self.fc2 = torch.nn.Linear(256, 256)  # factors too
        self.early = torch.nn.Linear(256, 256)  # in the first step on rank 0 only
        self.enc = torch.nn.Linear(256, 256)  # tied: one weight in two modules
        self.dec = torch.nn.Linear(256, 256)
        self.dec.weight = self.enc.weight
        self.head = torch.nn.Linear(256, 4)   # 4 x 256: the plain gradient is smaller

    def forward(self, x, early):
        h = torch.tanh(self.fc2(torch.relu(self.fc1(x))))
        if early:
            h = torch.tanh(self.early(h))
        h = torch.tanh(self.dec(torch.tanh(self.enc(h))))
        return self.head(h)


def _batch(step, rank, k=4):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(k, 64, generator=g)


def _exact_deciding():
    """The deciding default restricted to the exact candidate: gradients comparable bit
    for bit with any other exact exchange, trials and all."""
    from cgx.torch import Compression
    return Compression.auto(objective="time", families=("exact",), window=1, adjust_every=2,
                            trial_steps=1, trial_warmup_steps=0, recheck_every=1)


def _train(rank, world, factors, steps=4):
    import cgx.torch as hvd
    hvd.init()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=_exact_deciding(), sufficient_factors=factors)
    model.eval()
    with torch.no_grad():  # an evaluation before training: not a training forward
        model(_batch(99, rank), early=True)
    model.train()
    grads, used = [], []
    for step in range(steps):
        opt.zero_grad()
        x = _batch(step, rank)
        model(x, early=step > 0 or rank == 0).pow(2).mean().backward()
        opt.synchronize()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        used.append(dict(opt.sfb_used))
        with opt.skip_synchronize():
            opt.step()
    return {"grads": grads, "used": used,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("world", [2, 3])
def test_found_layers_travel_as_factors_with_the_same_gradients(world):
    off = run_gloo(_train, world, False)
    found = run_gloo(_train, world, None)
    for r in range(world):
        for gf, go in zip(found[r]["grads"], off[r]["grads"]):
            assert gf.keys() == go.keys()
            for n in gf:
                torch.testing.assert_close(gf[n], go[n], rtol=1e-5, atol=1e-6)
        for a, b in zip(found[r]["params"], off[r]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert all(u == {} for u in off[r]["used"]), off[r]["used"]  # False: nothing found
        assert found[r]["used"] == found[0]["used"]  # found alike on every rank
    used = found[0]["used"]
    assert used[0] == {}  # the first step finds the layers; factors from the second on
    for step in used[1:]:  # found: captured, sent as factors where the plan says so
        assert {"fc1.weight", "fc2.weight", "head.weight"} <= step.keys(), step
        assert step["head.weight"] is False  # its plain gradient is smaller
        # seen by one rank only in the first step: not a layer of every rank
        assert "early.weight" not in step
        # a weight registered in two modules never travels as factors
        assert not step.get("enc.weight") and not step.get("dec.weight")
    # (a trial of the plan with no factors may take a step or two)
    assert any(s["fc1.weight"] and s["fc2.weight"] for s in used[1:]), used
    for o in found[1:]:  # bit-identical on every rank
        assert all(torch.equal(a, b) for a, b in zip(o["params"], found[0]["params"]))


def _joined_first(rank, world):
    """Rank 1 has no data at all: it joins before the first step, and its shadow steps
    take part in the discovery's gather."""
    import cgx.torch as hvd
    hvd.init()
    model = Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=_exact_deciding())
    used = []
    for step in range(3 if rank == 0 else 0):
        opt.zero_grad()
        model(_batch(step, rank), early=True).pow(2).mean().backward()
        opt.step()
        used.append(dict(opt.sfb_used))
    return {"last": hvd.join(), "used": used}


def test_a_rank_joined_before_the_first_step_takes_part_in_finding_layers():
    out = run_gloo(_joined_first, 2)
    assert [o["last"] for o in out] == [0, 0]
    assert out[0]["used"] == [{}, {}, {}]  # rank 1 saw no layer: none is common


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(32 * 8 * 8, 512),
                               torch.nn.ReLU(), torch.nn.Linear(512, 10))


def _decide(rank, world, factors):
    import cgx.torch as hvd
    from cgx.torch import Compression
    hvd.init()
    model = _model()
    comp = Compression.auto(objective="time", window=2, trial_steps=1, trial_warmup_steps=0,
                            recheck_every=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   sufficient_factors=factors)
    used = []
    for step in range(40):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        used.append(dict(opt.sfb_used))
    return {"rounds": opt.exchange_trials(), "used": used,
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("world", [2, 3])
def test_the_model_free_default_tries_plans_with_and_without_factors(world):
    out = run_gloo(_decide, world, None)
    a = out[0]
    for o in out[1:]:
        assert o["rounds"] == a["rounds"] and o["used"] == a["used"]
        assert all(torch.equal(x, y) for x, y in zip(o["params"], a["params"]))
    assert a["rounds"], "no round of trials"
    tried = [p["label"] for p in a["rounds"][0]["plans"]]
    assert {"uniform 4-bit/1024, factors", "uniform 4-bit/1024, no factors"} <= set(tried), tried
    assert any(u.get("5.weight") for u in a["used"]), a["used"]  # 2048 x 512: factors pay
    assert any(u.get("5.weight") is False for u in a["used"][1:]), a["used"]  # no factors' turn


def test_without_discovery_the_trials_offer_no_factor_plans():
    a = run_gloo(_decide, 2, False)[0]
    assert a["rounds"]
    assert not any("factors" in p["label"] for r in a["rounds"] for p in r["plans"])
    assert all(u == {} for u in a["used"])
