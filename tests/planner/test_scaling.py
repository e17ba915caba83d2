"""cgx.policy.planner.scaling: the layer profiles are the real models', and predictions behave."""

from __future__ import annotations

import pytest

from cgx.policy.planner.scaling import MODELS, main, predict, profile


def test_layer_profiles_have_the_published_parameter_counts():
    count = {m: sum(layer.numel for layer in f()) for m, f in MODELS.items()}
    assert count["resnet50"] == 25_557_032  # torchvision's resnet50
    assert count["bert-base"] == 109_482_240  # bert-base-uncased (with the pooler)
    assert count["vgg11"] == 28_149_514  # benchmarks/training.py's VGG-11 (batch norm, 10 classes)


def test_profile_ready_times_follow_backward():
    tensors, backward, forward = profile(MODELS["resnet50"](), batch=8, flops=1e12)
    assert tensors[0].name == "fc.bias" and tensors[-1].name == "conv1.weight"
    ready = [t.ready_s for t in tensors]
    assert ready == sorted(ready) and ready[-1] == pytest.approx(backward)
    assert backward == pytest.approx(2 * forward)
    fc = next(t for t in tensors if t.name == "fc.weight")
    assert fc.shape == (1000, 2048) and fc.rows == 8


def test_predictions_never_lose_to_ddp_and_gain_most_on_slow_links():
    args = dict(batch=32, flops=2e12)
    slow = predict("resnet50", 8, 1.0, **args)
    fast = predict("resnet50", 8, 100.0, **args)
    shared = predict("resnet50", 8, 1.0, ranks_per_node=4, **args)
    for p in (slow, fast, shared):
        assert p.cgx_step_s <= p.ddp_step_s * (1 + 1e-9) and p.cgx_step_s >= p.compute_s
    assert slow.speedup > fast.speedup
    assert shared.ddp_step_s > slow.ddp_step_s  # 4 ranks share each node's link


def test_command_line(tmp_path, capsys):
    out = tmp_path / "scaling"
    assert main(["--models", "bert-base", "--nodes", "2,16", "--gbit", "1,25",
                 "--ranks-per-node", "1", "--flops", "1e12", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.count("| bert-base |") == 4
    assert (tmp_path / "scaling.png").stat().st_size > 10_000
    assert (tmp_path / "scaling.md").read_text().strip() == text.strip()
    with pytest.raises(SystemExit):
        main(["--models", "alexnet"])
