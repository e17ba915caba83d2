"""The exchange on CUDA tensors: 2 real ranks sharing one GPU, Gloo carrying the bytes.

Marked ``gpu``: skipped without a CUDA device. NCCL wants one GPU per rank, so
on a one-GPU machine the ranks run with ``CGX_BACKEND=gloo`` and
``cgx.init(device="cuda")``: the gradients, the Triton quantization kernels,
the engine's stream handling and the optimizer's hooks all work on the GPU,
and only the transport stages through host memory.

Checked here:
- a quantized allreduce of CUDA tensors returns, bit for bit, what the same
  allreduce of the same values on CPU tensors returns (Triton kernels vs the
  C path, same reduction order, same stochastic-rounding keys);
- the torch optimizer on a CUDA model, exact and 4-bit (with and without
  sufficient factors): ranks end with identical parameters, and each step's
  gradient is the true average (exact, and factors) or within the SRA bound
  of it (4-bit).
"""

from __future__ import annotations

import pytest
import torch

from gpu_ranks import NEEDS_CUDA, init_on, mlp
from spawn import run_gloo

pytestmark = NEEDS_CUDA


def _init(device: str, bits: int):
    from cgx import Rounding
    from cgx.config import Config
    return init_on(device, Config(bits=bits, minimal_size=0, rounding=Rounding.STOCHASTIC))


def _allreduce_on(rank, world, device):
    hvd = _init(device, 4)
    out = []
    for bits, n in ((4, 1 << 16), (2, 100_003), (8, 4097)):
        g = torch.Generator().manual_seed(100 * bits + rank)
        x = torch.randn(n, generator=g).to(device)
        comp = hvd.Compression.quantize(bits=bits, bucket_size=512)
        out.append(hvd.allreduce(x, name=f"x{bits}", compression=comp).cpu())
    return out


def test_quantized_allreduce_on_cuda_equals_the_cpu_path():
    on_cpu = run_gloo(_allreduce_on, 2, "cpu")
    on_gpu = run_gloo(_allreduce_on, 2, "cuda")
    for r in range(2):
        for a, b in zip(on_gpu[r], on_cpu[r]):
            assert torch.equal(a, b), (a - b).abs().max()
    for a, b in zip(on_gpu[0], on_gpu[1]):
        assert torch.equal(a, b), "ranks differ"


def _train_on_cuda(rank, world, bits, factors, steps):
    hvd = _init("cuda", bits)
    model = mlp("cuda")
    local = mlp("cuda")  # a copy without the exchange: this rank's own gradient
    kw = {"sufficient_factors": model} if factors else {}
    comp = hvd.Compression.exact if bits == 32 else hvd.Compression.quantize(bits=bits)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, **kw)
    worst = 0.0
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 32, generator=g).cuda()
        y = torch.randint(0, 10, (16,), generator=g).cuda()
        with torch.no_grad():
            for p, q in zip(local.parameters(), model.parameters()):
                p.copy_(q)
                p.grad = None
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.synchronize()
        torch.nn.functional.cross_entropy(local(x), y).backward()
        for i, (p, q) in enumerate(zip(model.parameters(), local.parameters())):
            mean = hvd.allreduce(q.grad.detach().clone(), name=f"ref.{step}.{i}",
                                 compression=hvd.Compression.exact)
            spread = hvd.allgather((q.grad.max() - q.grad.min()).view(1)).max().item()
            err = (p.grad - mean).abs().max().item()
            if bits == 32:
                bound = 1e-5 * (mean.abs().max().item() + 1e-12)
            else:  # SRA, stochastic rounding: each share quantized once (error < one unit), the
                # average once more
                levels = 2 ** bits - 1
                stage1 = spread / levels
                out_range = (mean.max() - mean.min()).item() + 2 * stage1
                bound = 1.01 * (stage1 + out_range / levels) + 1e-6
            worst = max(worst, err / bound)
        with opt.skip_synchronize():
            opt.step()
    flat = torch.cat([p.detach().view(-1) for p in model.parameters()]).cpu()
    return worst, flat


@pytest.mark.parametrize("bits,factors", [(32, False), (4, False), (32, True), (4, True)],
                         ids=["exact", "4bit", "exact-factors", "4bit-factors"])
def test_optimizer_on_cuda_tensors(bits, factors):
    res = run_gloo(_train_on_cuda, 2, bits, factors, 4)
    assert max(r[0] for r in res) <= 1.0, [r[0] for r in res]
    assert torch.equal(res[0][1], res[1][1]), "parameters differ across ranks"
