"""Sharded, low-communication and 16-bit training on CUDA tensors: 2 ranks sharing one GPU.

Marked ``gpu``: skipped without a CUDA device. As in test_gpu_exchange.py, the ranks
use ``CGX_BACKEND=gloo`` and ``cgx.init(device="cuda")`` (NCCL wants one GPU per rank):
parameters, gradients, the Triton kernels and the CUDA stream ordering are the GPU's,
the transport stages through host memory.

Checked here:
- FSDP2 (``fully_shard`` on a CUDA mesh) with cgx's 4-bit reduce-scatter (error
  feedback) and 8-bit parameter all-gather: FSDP2's reduce-scatter and all-gather
  streams ordered with cgx's engine; the same bytes as the same run on CPU tensors and
  losses that follow it;
- DiLoCo on a CUDA model: parameters identical on both ranks after every outer step,
  and the loss falls.

The 16-bit cast exchange of CUDA gradients is tested beside the CPU one
(tests/trials/test_casts.py, its ``cuda`` case).
"""

from __future__ import annotations

import torch

from gpu_ranks import NEEDS_CUDA, init_on
from spawn import run_gloo

pytestmark = NEEDS_CUDA


# -- FSDP2 ---------------------------------------------------------------------------------

def _lm():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(64, 96), torch.nn.Linear(96, 384),
                               torch.nn.ReLU(), torch.nn.Linear(384, 64))


def _lm_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randint(0, 64, (256,), generator=g)
    return x, (5 * x + 3) % 64


def _fsdp(rank, world, device, steps):
    import cgx.torch.fsdp as cfsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    hvd = init_on(device)
    model = _lm().to(device)
    mesh = init_device_mesh(device, (world,))
    for i in (1, 3):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = cfsdp.compress(model, compression=hvd.Compression.quantize(bits=4, error_feedback=True),
                           params_bits=8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before, losses = hvd.stats().wire_bytes, []
    for step in range(steps):
        x, y = (t.to(device) for t in _lm_batch(rank, step))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    torch.cuda.synchronize() if device == "cuda" else None
    shards = {n: p.detach().to_local().cpu() for n, p in model.named_parameters()}
    residuals = sum(float(r.float().norm()) for s in state.groups.values()
                    for rs in s.residuals.values() for r in rs)
    return {"losses": losses, "bytes": hvd.stats().wire_bytes - before, "shards": shards,
            "residuals": residuals, "device": str(next(model.parameters()).device),
            "gather_error": state.param_gather_error()}


def test_fsdp2_on_cuda_sends_what_the_cpu_run_sends_and_trains_like_it():
    steps = 30
    on_gpu = run_gloo(_fsdp, 2, "cuda", steps, timeout=300)
    on_cpu = run_gloo(_fsdp, 2, "cpu", steps, timeout=300)
    for g, c in zip(on_gpu, on_cpu):
        assert g["device"].startswith("cuda")
        assert g["bytes"] == c["bytes"] > 0
        assert g["residuals"] > 0  # error feedback kept what 4 bits did not send
        assert g["gather_error"] < 0.05, g["gather_error"]
        first, last = sum(g["losses"][:3]) / 3, sum(g["losses"][-3:]) / 3
        assert last < 0.7 * first, g["losses"]
        assert abs(last - sum(c["losses"][-3:]) / 3) < 0.1 * first, (g["losses"], c["losses"])
        for name, shard in g["shards"].items():
            assert torch.isfinite(shard).all(), name


# -- DiLoCo --------------------------------------------------------------------------------

def _diloco(rank, world, device, sync_every, steps):
    hvd = init_on(device)
    torch.manual_seed(rank)  # different starts: the first outer step starts from rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 5)).to(device)
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     sync_every=sync_every)
    synced, losses = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(32, 12, generator=g)
        y = (x[:, :5] * 2).argmax(1)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % sync_every == 0:
            synced.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu())
    return {"synced": synced, "losses": losses,
            "device": str(next(model.parameters()).device)}


def test_diloco_on_cuda_keeps_ranks_identical_after_each_outer_step():
    a, b = run_gloo(_diloco, 2, "cuda", 5, 40, timeout=300)
    assert a["device"].startswith("cuda")
    assert len(a["synced"]) == 8
    for i, (p, q) in enumerate(zip(a["synced"], b["synced"])):
        assert torch.equal(p, q), f"outer step {i}: ranks differ by {(p - q).abs().max()}"
    for r in (a, b):
        assert sum(r["losses"][-5:]) < 0.7 * sum(r["losses"][:5]), r["losses"]

