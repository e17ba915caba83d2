"""DDP set-ups that trainers use, each run with plain DDP and with cgx's hook (for tests).

``train(rank, world, setting, hook)`` trains a small model for a few steps under one DDP
setting and returns its parameters; with ``hook=True`` the same run goes through
``cgx_hook`` with ``Compression.exact``, so the two must agree to float rounding. The
settings are the ones Lightning, Hugging Face's Trainer and Accelerate turn on by default
or on request (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``,
``no_sync`` accumulation, ``join()``, autocast with a ``GradScaler``), plus user
collectives beside the hook and ``torch.compile``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 4
BATCH = 6  # per rank
SETTINGS = ("unused-some-steps", "unused-every-step", "static-graph", "bucket-view",
            "no-sync", "join-uneven", "autocast-scaler", "user-allreduce", "compile")


class _AllReduceInBackward(torch.autograd.Function):
    """The identity forward; backward sums the gradient over DDP's group from the
    training thread, as tensor-parallel layers and some user models do."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class Net(torch.nn.Module):
    """A trunk and two heads; ``head`` says which heads a step uses."""

    def __init__(self, allreduce_in_backward: bool = False):
        super().__init__()
        self.trunk = torch.nn.Linear(16, 48)
        self.a = torch.nn.Linear(48, 3)
        self.b = torch.nn.Linear(48, 3)
        self.allreduce_in_backward = allreduce_in_backward

    def forward(self, x, head: str = "ab"):
        h = torch.tanh(self.trunk(x))
        if self.allreduce_in_backward:
            h = _AllReduceInBackward.apply(h)
        out = 0
        if "a" in head:
            out = out + self.a(h)
        if "b" in head:
            out = out + self.b(h)
        return out


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, 16, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _ddp_kwargs(setting: str) -> dict:
    # several buckets: the hook runs while backward does (torch.compile's DDP optimizer
    # asks for a first bucket no larger than the others, at least 1 MB)
    kwargs = {"bucket_cap_mb": 1 if setting == "compile" else 0.002}
    if setting.startswith("unused"):
        kwargs["find_unused_parameters"] = True
    if setting == "static-graph":
        kwargs["static_graph"] = True
    if setting == "bucket-view":
        kwargs["gradient_as_bucket_view"] = True
    return kwargs


def _head(setting: str, step: int) -> str:
    if setting == "unused-some-steps":
        return "ab"[step % 2]  # each head unused every other step
    if setting in ("unused-every-step", "static-graph"):
        return "a"  # b never used (static_graph allows it: the same every step)
    return "ab"


def train(rank: int, world: int, setting: str, hook: bool) -> list:
    """This rank's parameters after ``STEPS`` steps of ``setting`` (see the module doc)."""
    import cgx.torch
    torch.manual_seed(0)
    net = Net(allreduce_in_backward=setting == "user-allreduce")
    ddp = DDP(net, **_ddp_kwargs(setting))
    if hook:
        state = cgx.torch.CGXState(ddp, compression=cgx.torch.Compression.exact)
        ddp.register_comm_hook(state, cgx.torch.cgx_hook)
    model = torch.compile(ddp) if setting == "compile" else ddp
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    if setting == "join-uneven":
        _train_uneven(rank, ddp, opt)
    elif setting == "autocast-scaler":
        _train_autocast(rank, ddp, opt)
    else:
        for step in range(STEPS):
            opt.zero_grad()
            if setting == "no-sync":
                with ddp.no_sync():  # accumulate locally; the next backward reduces both
                    x, y = _batch(step + 100, rank)
                    (F.cross_entropy(ddp(x), y) / 2).backward()
            x, y = _batch(step, rank)
            loss = F.cross_entropy(model(x, _head(setting, step)), y)
            loss.backward()
            opt.step()
            if setting == "user-allreduce":  # a metric averaged between steps
                dist.all_reduce(loss.detach())
    return [p.detach().clone() for p in net.parameters()]


def _train_uneven(rank: int, ddp, opt) -> None:
    """Rank r has STEPS + r batches: ranks that run out join the others' steps."""
    with ddp.join():
        for step in range(STEPS + rank):
            opt.zero_grad()
            x, y = _batch(step, rank)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()


def _train_autocast(rank: int, ddp, opt) -> None:
    """bfloat16 autocast on the CPU with a GradScaler; rank 0's first batch holds an inf, so
    the first step's averaged gradients are not finite on every rank and the scaler skips
    it everywhere alike (its scale halves)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=1)
    for step in range(STEPS + 2):
        opt.zero_grad()
        x, y = _batch(step, rank)
        if step == 0 and rank == 0:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step == 0 and scaler.get_scale() != 2.0 ** 15:
            raise AssertionError(f"the first step should be skipped; scale {scaler.get_scale()}")
