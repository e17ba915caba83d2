"""benchmarks/timetoacc/workloads.py: an evaluation reports its loss's standard error over
the validation set's independent parts (the CNN's images, the LM's sequences), and those
parts' losses, for comparisons item by item."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from benchmarks.timetoacc import workloads


def test_the_standard_error_is_the_parts_spread_over_the_root_of_their_count():
    losses = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # sample standard deviation sqrt(5/3), over sqrt(4)
    assert math.isclose(workloads.standard_error(losses), math.sqrt(5 / 3) / 2, rel_tol=1e-12)
    assert workloads.standard_error(torch.full((10,), 0.7)) == 0.0


def test_the_cnn_reports_the_standard_error_over_its_validation_images():
    work = workloads.make("cnn", 0, 2, 0, tiny=True)
    res = work.evaluate(work.model)
    _, _, val_x, val_y = workloads._digits()
    work.model.eval()
    with torch.no_grad():
        per_image = F.cross_entropy(work.model(val_x), val_y, reduction="none")
    assert math.isclose(res["loss"], float(per_image.mean()), rel_tol=1e-5)
    assert math.isclose(res["loss_se"], float(per_image.double().std()) / math.sqrt(len(val_y)),
                        rel_tol=1e-5)
    assert len(res["item_losses"]) == len(val_y) > 100
    assert math.isclose(sum(res["item_losses"]) / len(val_y), res["loss"], rel_tol=1e-5)


def test_the_lms_loss_is_its_token_mean_and_its_error_is_over_sequences():
    work = workloads.make("lm", 0, 2, 0, tiny=True)
    res = work.evaluate(work.model)
    batch = work.train_batch(0)
    assert math.isfinite(res["loss"]) and res["accuracy"] is None
    assert 0.0 < res["loss_se"] < res["loss"]
    items = res["item_losses"]
    assert len(items) > 1 and math.isclose(sum(items) / len(items), res["loss"], rel_tol=1e-5)
    with torch.no_grad():  # every token predicted uniformly: log(vocab) everywhere, no spread
        for p in work.model.parameters():
            p.zero_()
    flat = work.evaluate(work.model)
    assert math.isclose(flat["loss"], math.log(work.model(batch[0]).shape[-1]), rel_tol=1e-5)
    assert flat["loss_se"] < 1e-6
