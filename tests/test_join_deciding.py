"""``hvd.join()`` under the deciding default: a joined rank's shadow step counts as a step,
so the trials it takes part in are the ones the stepping ranks run, whenever it joined
(before, a rank that joined before the trials hung the others); on 2 and 3 real ranks."""

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _uneven(rank, world, steps, fast):
    import cgx.torch as hvd
    from cgx.torch import Compression
    hvd.init()
    model = _model()
    comp = Compression.none if not fast else Compression.auto(
        objective="time", window=2, trial_steps=1, trial_warmup_steps=0, recheck_every=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    for step in range(steps[rank]):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 10, (4,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    last = hvd.join()
    return {"last": last, "rounds": opt.exchange_trials(),
            "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("steps", [(12, 0), (12, 3)])
def test_the_default_with_a_rank_that_joined_early(steps):
    """The default's first steps measure every candidate: a rank that joined before them
    (or among them) takes part in each."""
    out = run_gloo(_uneven, 2, steps, False)
    assert [o["last"] for o in out] == [0, 0]
    assert out[1]["rounds"] == out[0]["rounds"]


def test_trials_agree_with_ranks_that_joined_at_different_steps():
    out = run_gloo(_uneven, 3, (30, 0, 7), True)
    assert [o["last"] for o in out] == [0, 0, 0]
    assert out[0]["rounds"], "no round of trials"
    for o in out[1:]:  # the joined ranks followed the same trials and the same choice
        assert o["rounds"] == out[0]["rounds"]
