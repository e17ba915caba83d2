"""benchmarks/timetoacc/rank.py: evaluating with re-estimated BatchNorm statistics
(``benchmarks/train.py --bn-batches``)."""

from __future__ import annotations

import copy

import torch

from benchmarks.timetoacc import workloads
from benchmarks.timetoacc.rank import has_batch_norm, reestimated


def _bn(model):
    return [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]


def test_statistics_are_re_estimated_on_a_copy_from_the_training_batches():
    work = workloads.make("cnn", 0, 2, 0, tiny=True)
    assert has_batch_norm(work.model)
    for m in _bn(work.model):  # statistics that no longer fit the parameters
        m.running_mean.fill_(3.0)
        m.running_var.fill_(25.0)
    before = {k: v.clone() for k, v in work.model.state_dict().items()}
    fresh = reestimated(work, workloads.make("cnn", 0, 2, 0, tiny=True).model, 4)
    # the trained model keeps its own statistics
    assert all(torch.equal(before[k], v) for k, v in work.model.state_dict().items())
    # the copy: the same parameters, the statistics of this rank's first 4 batches
    ref = copy.deepcopy(work.model)
    torch.optim.swa_utils.update_bn([work.train_batch(i)[0] for i in range(4)], ref)
    for (name, a), b in zip(fresh.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b), name
    assert not torch.allclose(_bn(fresh)[0].running_mean, torch.full_like(
        _bn(fresh)[0].running_mean, 3.0))
    assert work.evaluate(fresh)["loss"] == work.evaluate(ref)["loss"]


def test_a_model_without_batch_norm_has_nothing_to_re_estimate():
    assert not has_batch_norm(workloads.make("lm", 0, 2, 0, tiny=True).model)
