"""``hvd.SyncBatchNorm``: batch normalization with statistics over every rank's batch.

Horovod 0.28.1's semantics: in training, the mean and variance come from the
union of all ranks' batches (ranks may have different batch sizes); the running
statistics are updated from them (unbiased variance), identically on every rank;
in eval mode with running statistics it is a plain ``BatchNorm``. Backward
reduces the two per-channel sums the input gradient needs; ``weight.grad`` and
``bias.grad`` stay local, to be averaged by ``DistributedOptimizer`` like every
other gradient.

Beyond Horovod: CPU tensors work too (Horovod refuses them), ``momentum=None``
gives the cumulative average as in ``torch.nn.BatchNorm``, and the statistics
travel in one collective per layer (count, mean and variance fused; combined with
the numerically stable parallel-variance formula).

Example::

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), ...)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from cgx import runtime
from cgx.ops import Sum


class SyncBatchNorm(_BatchNorm):
    """N-dimensional batch normalization synchronized over all ranks (``hvd.SyncBatchNorm``).

    Args:
        num_features: ``C`` of an ``(N, C, ...)`` input.
        eps: added to the variance. momentum: running-statistics factor (None: cumulative
            average). affine: learnable weight and bias. track_running_stats: keep
            running statistics (used in eval mode).
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = self.momentum if self.momentum is not None else \
                1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, False, 0.0, self.eps)
        if runtime.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight,
                                self.bias, True, factor, self.eps)
        return _SyncBatchNorm.apply(input, self.weight, self.bias, self.running_mean,
                                    self.running_var, self.eps, factor)


def _shape(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-channel vector shaped to broadcast against an ``(N, C, ...)`` input."""
    return t.view([1, -1] + [1] * (ndim - 2))


class _SyncBatchNorm(torch.autograd.Function):

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, factor):
        from cgx.torch.ops import allgather
        x = input.contiguous()
        C = x.size(1)
        dims = [0] + list(range(2, x.dim()))
        n = x.numel() // C if C else 0
        xf = x.float()
        if n:
            var, mean = torch.var_mean(xf, dim=dims, unbiased=False)
        else:
            mean = var = torch.zeros(C, device=x.device)
        # One collective: every rank's (count, mean, biased variance).
        mine = torch.cat([torch.tensor([float(n)], device=x.device), mean, var])
        rows = allgather(mine.unsqueeze(0), name="sync_batch_norm.stats").to(x.device)
        counts, means, vars_ = rows[:, :1], rows[:, 1:C + 1], rows[:, C + 1:]
        total = float(counts.sum())
        if total == 0:
            raise ValueError("SyncBatchNorm got an empty batch on every rank")
        g_mean = (counts * means).sum(0) / total
        g_var = (counts * (vars_ + (means - g_mean) ** 2)).sum(0) / total
        if running_mean is not None and factor:
            with torch.no_grad():
                unbiased = g_var * (total / (total - 1)) if total > 1 else g_var
                running_mean.mul_(1 - factor).add_(g_mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        invstd = torch.rsqrt(g_var + eps)
        y = (xf - _shape(g_mean, x.dim())) * _shape(invstd, x.dim())
        if weight is not None:
            y = y * _shape(weight.float(), x.dim())
        if bias is not None:
            y = y + _shape(bias.float(), x.dim())
        ctx.save_for_backward(x, weight, g_mean, invstd)
        ctx.total = total
        return y.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        from cgx.torch.ops import allreduce
        x, weight, mean, invstd = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        nd = x.dim()
        dims = [0] + list(range(2, nd))
        dy = grad_output.contiguous().float()
        xmu = x.float() - _shape(mean, nd)
        sum_dy = dy.sum(dims)
        sum_dy_xmu = (dy * xmu).sum(dims)
        grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) \
            if weight is not None and need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None
        grad_input = None
        if need_input:
            C = sum_dy.numel()
            sums = allreduce(torch.cat([sum_dy, sum_dy_xmu]), op=Sum,
                             name="sync_batch_norm.grad")
            g_dy, g_dy_xmu = sums[:C] / ctx.total, sums[C:] / ctx.total
            scale = invstd if weight is None else invstd * weight.float()
            grad_input = (dy - _shape(g_dy, nd) - xmu * _shape(invstd * invstd * g_dy_xmu, nd)) \
                * _shape(scale, nd)
            grad_input = grad_input.to(x.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
