"""The deciders on CUDA tensors: 2 ranks sharing one GPU, Gloo carrying the bytes.

Marked ``gpu``: skipped without a CUDA device. As in test_gpu_exchange.py the ranks use
``CGX_BACKEND=gloo`` and ``cgx.init(device="cuda")`` (NCCL wants one GPU per rank).

Checked here:
- the deciding exchange (``Compression.auto(objective="time")``) on a CUDA model: its
  window samples CUDA gradients (quantization, PowerSGD and 16-bit casts), its trials
  time CUDA steps; both ranks agree on every measurement and keep the same plan, their
  parameters stay identical and the loss falls;
- the planned exchange (``Compression.planned()``) on a CUDA model with no profile given:
  rank 0 measures the GPU (``calibrate_device``), every rank plans with that profile, each
  quantized tensor is placed on the GPU or offloaded to the host's C path, and the
  exchange does what the plan says (offloaded calls happen exactly when a tensor is
  placed ``@cpu``; rank 0's calibration makes a few of its own, counted apart); the
  parameters stay identical on both ranks.

The same modes on CPU ranks: tests/trials/, tests/planner/test_planned_mode.py.
"""

from __future__ import annotations

import torch

from gpu_ranks import NEEDS_CUDA, init_on, mlp
from spawn import run_gloo

pytestmark = NEEDS_CUDA


def _model(device):
    return mlp(device, hidden=512)


def _steps(opt, model, rank, steps, device):
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 32, generator=g)
        y = (x[:, :10] * 3).argmax(1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _decide(rank, world, device, steps):
    hvd = init_on(device)
    model = _model(device)
    comp = hvd.Compression.auto(objective="time", window=3, trial_steps=1, recheck_every=0)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3),
                                   named_parameters=model.named_parameters(), compression=comp)
    losses = _steps(opt, model, rank, steps, device)
    return {"rounds": opt.exchange_trials(), "levels": [r["level"] for r in opt.compression_plan()],
            "losses": losses, "device": str(next(model.parameters()).device),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()}


def test_the_deciding_exchange_on_cuda_agrees_on_both_ranks_and_trains():
    a, b = run_gloo(_decide, 2, "cuda", 30, timeout=300)
    assert a["device"].startswith("cuda")
    assert len(a["rounds"]) == 1 and a["rounds"][0]["chosen"], a["rounds"]
    assert all(p["measured_s"] > 0 for p in a["rounds"][0]["plans"])
    assert a["rounds"] == b["rounds"] and a["levels"] == b["levels"]
    assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()
    for r in (a, b):
        assert sum(r["losses"][-5:]) < 0.8 * sum(r["losses"][:5]), r["losses"]


def _planned(rank, world, device, steps):
    from cgx.collectives import offload
    from cgx.policy.planner import placement
    hvd = init_on(device)
    # Offloaded quantizations of CUDA tensors: by the exchange, and by rank 0's calibration
    # (calibrate_device times a few offloaded calls for the profile's copy_s).
    calls = {"offloaded": 0, "calibration": 0, "calibrating": False}
    codec, fixed_cost = offload.quantize, placement._offload_fixed_s

    def counted(x, *args, **kwargs):
        calls["calibration" if calls["calibrating"] else "offloaded"] += int(x.is_cuda)
        return codec(x, *args, **kwargs)

    def calibrating(*args, **kwargs):
        calls["calibrating"] = True
        try:
            return fixed_cost(*args, **kwargs)
        finally:
            calls["calibrating"] = False

    offload.quantize, placement._offload_fixed_s = counted, calibrating
    model = _model(device)
    comp = hvd.Compression.planned(calibrate_steps=3, assume_gbit=0.01, trials=False)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=3e-3),
                                   named_parameters=model.named_parameters(), compression=comp)
    losses = _steps(opt, model, rank, steps, device)
    offload.quantize, placement._offload_fixed_s = codec, fixed_cost
    plan = opt.exchange_plan()
    return {"chosen": [o.name for o in plan.chosen], "profile": plan.model.device.to_dict(),
            "offloaded": calls["offloaded"], "calibration": calls["calibration"],
            "losses": losses,
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()}


def test_planned_mode_on_cuda_measures_the_gpu_and_places_each_quantized_tensor():
    a, b = run_gloo(_planned, 2, "cuda", 10, timeout=300)
    prof = a["profile"]
    assert prof["source"].startswith("measured on"), prof["source"]
    assert prof == b["profile"]  # rank 0's measurement, shared
    assert prof["gpu_quantize_gbps"] > 0 and prof["d2h_gbps"] > 0
    assert a["chosen"] == b["chosen"]
    # at 10 Mbit/s every weight is quantized, on the GPU or offloaded
    weights = a["chosen"][0::2]
    assert all(c.startswith("sra-") for c in weights), a["chosen"]
    # rank 0 alone measured the offloaded call's fixed cost; the exchange offloads exactly
    # when the plan places a tensor on the host
    assert a["calibration"] > 0 and b["calibration"] == 0, (a["calibration"], b["calibration"])
    placed_on_host = any(c.endswith("@cpu") for c in a["chosen"])
    for r in (a, b):
        assert (r["offloaded"] > 0) == placed_on_host, (r["offloaded"], a["chosen"])
    assert torch.equal(a["params"], b["params"]), (a["params"] - b["params"]).abs().max()
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (a, b))
