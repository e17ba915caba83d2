"""Training patterns users write with torch, for the reference-equivalence harness.

Each function is ``pattern(hvd, shard) -> parameters`` (see equivalence.py).
Every one uses an exact exchange, so N ranks must match one process exactly.

Variants: ``init(variant)`` picks what every ``DistributedOptimizer`` built through
``_opt`` decides with (``run_patterns(..., variant=...)``); each variant must still
match the plain single-process reference:

* ``"plain"``: ``Compression.exact``.
* ``"sfb"``: ``Compression.exact`` with ``sufficient_factors=model``. ``_mlp``'s first
  layer (64 x 16, 12 rows over all ranks) sends factors whenever a step has one
  backward pass; the patterns below with a tied, shared or borrowed weight must take
  the plain path for it.
* ``"auto-exact"``: ``Compression.auto`` restricted to the exact candidate
  (``families=("exact",)``), planning every 2 steps from 1-step windows: auto's whole path
  (measurements, plans, residual bookkeeping) with nothing compressed; the DDP hook pattern
  too.
* ``"planned-exact"``: ``Compression.planned`` restricted to exact options by a layer rule
  that keeps every tensor exact (``rules=EXACT_ONLY``), tracing 2 steps, then planning,
  and a drift check every step after: the planned exchange's whole path (ready times,
  agreed profile, plan, checks, rebuilds when parameters are frozen or added) with
  nothing compressed.
* ``"decide-exact"``: ``Compression.auto(objective="time")`` restricted to the exact
  candidate: after each 1-step window the planner's measurements, the proposals, a round of
  trials (one plan: the proposals coincide) and a check of the kept plan every step; the
  deciding exchange's whole path with nothing compressed, the model not given and factor
  discovery off (``sufficient_factors=False``); the DDP hook pattern too.
* ``"decide-sfb"``: ``"decide-exact"`` given the model: its trials also send every linear
  layer as factors, and none.
* ``"decide-found"``: ``"decide-exact"`` with the model neither given nor refused: the
  layers are found in the first step (``cgx.torch.factor_discovery``) and the trials
  weigh their factors from the second; tied, shared and borrowed weights must take the
  plain path as with the model given.

A new variant is one more entry in ``VARIANTS`` and one more branch in ``_opt``.
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F

STEPS = 4
GLOBAL_BATCH = 12  # divisible by 1, 2 and 3 ranks


VARIANTS = ("plain", "sfb", "auto-exact", "planned-exact", "decide-exact", "decide-sfb",
            "decide-found")
EXACT_ONLY = {"layers": [{"pattern": "*", "exclude": True}]}  # per-layer rules: all exact
_variant = "plain"  # set by init(): what _opt's optimizers decide with


def init(variant: str = "plain"):
    global _variant
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    _variant = variant
    import cgx.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    return hvd


def _batch(step, dim=16, n=GLOBAL_BATCH):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(n, dim, generator=g)
    return x, (x[:, :4].sum(1) > 0).long()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))


def _compression(hvd):
    if _variant == "auto-exact":
        return hvd.Compression.auto(families=("exact",), window=1, adjust_every=2)
    if _variant == "planned-exact":
        return hvd.Compression.planned(calibrate_steps=2, replan_every=1)
    if _variant.startswith("decide"):  # the deciding exchange: proposals, a round, checks
        # (decide-sfb and decide-found: its trials also send every linear layer as
        # factors, and none)
        return hvd.Compression.auto(objective="time", families=("exact",), window=1,
                                    adjust_every=2, trial_steps=1, trial_warmup_steps=0,
                                    recheck_every=1)
    return hvd.Compression.exact


def _opt(hvd, model, opt, **kw):
    if _variant in ("sfb", "decide-sfb"):
        kw["sufficient_factors"] = model
    if _variant == "decide-exact":
        kw["sufficient_factors"] = False
    if _variant == "planned-exact":
        kw["rules"] = EXACT_ONLY
    return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                    compression=_compression(hvd), **kw)


def plain_sgd_momentum(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def adam_param_groups(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.Adam([
        {"params": model[0].parameters(), "lr": 1e-2},
        {"params": model[2].parameters(), "lr": 1e-3, "weight_decay": 0.1}]))
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


class TiedAndReused(torch.nn.Module):
    """Input embedding and output layer share one weight; a block is applied twice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(20, 8)
        self.block = torch.nn.Linear(8, 8)

    def forward(self, tokens):
        h = self.emb(tokens).mean(1)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))  # reused module
        return h @ self.emb.weight.t()  # tied output weight


def tied_and_reused_weights(hvd, shard):
    model = TiedAndReused()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 20, (GLOBAL_BATCH, 5), generator=g)
        target = torch.randint(0, 20, (GLOBAL_BATCH,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(shard(tokens)), shard(target)).backward()
        opt.step()
    return list(model.parameters())


def accumulation(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1),
               backward_passes_per_step=2)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(10 * step + micro)
            (F.cross_entropy(model(shard(x)), shard(y)) / 2).backward()
        opt.step()
    return list(model.parameters())


def freeze_unfreeze(hvd, shard):
    model = _mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(STEPS):
        if step == 2:
            for p in model[0].parameters():
                p.requires_grad_(True)
        if step == 3:
            for p in model[2].parameters():
                p.requires_grad_(False)
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def add_param_group_midway(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model[2].parameters(), lr=0.1))
    for p in model[0].parameters():
        p.requires_grad_(False)
    for step in range(STEPS):
        if step == 2:
            for p in model[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 0.05})
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def clipping(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        (10 * F.cross_entropy(model(shard(x)), shard(y))).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        with opt.skip_synchronize():
            opt.step()
    return list(model.parameters())


def grad_scaler(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        scaler.scale(F.cross_entropy(model(shard(x)), shard(y))).backward()
        scaler.unscale_(opt)  # reads the gradients: they must be reduced by now
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    return list(model.parameters())


def compiled_model(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1))
    fast = torch.compile(model, backend="aot_eager")  # no C++ toolchain needed
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(fast(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def sparse_embedding(hvd, shard):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(30, 6, sparse=True)
    head = torch.nn.Linear(6, 2)
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.2))
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 30, (GLOBAL_BATCH, 3), generator=g)
        y = torch.randint(0, 2, (GLOBAL_BATCH,), generator=g)
        opt.zero_grad()
        F.cross_entropy(head(emb(shard(tokens)).mean(1)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def ddp_hook_no_sync(hvd, shard):
    import cgx.torch
    from cgx.config import Config
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _mlp()
    ddp = DDP(model)
    if _variant == "auto-exact":  # the default config: auto plans the compressible layers
        state = cgx.torch.CGXState(ddp, config=Config(), compression=_compression(hvd))
    else:
        state = cgx.torch.CGXState(ddp, config=Config(bits=32))  # exact
    ddp.register_comm_hook(state, cgx.torch.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(10 * step)
        with ddp.no_sync():  # accumulate locally, reduce with the next backward
            (F.cross_entropy(ddp(shard(x)), shard(y)) / 2).backward()
        x, y = _batch(10 * step + 1)
        (F.cross_entropy(ddp(shard(x)), shard(y)) / 2).backward()
        opt.step()
    return list(model.parameters())


def save_load_resume(hvd, shard):
    """Rank 0 checkpoints after 2 steps; a fresh model and optimizer load it on rank 0 and
    broadcast; training goes on: the result equals the uninterrupted run."""
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    buf = io.BytesIO()
    for step in range(STEPS):
        if step == 2:
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            model = _mlp(seed=123)  # a restarted process: other weights until the broadcast
            opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.5))
            if hvd.rank() == 0:
                buf.seek(0)
                ckpt = torch.load(buf, weights_only=False)
                model.load_state_dict(ckpt["model"])
                opt.load_state_dict(ckpt["opt"])
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def replaced_optimizer(hvd, shard):
    model = _mlp()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.5))
    for step in range(STEPS):
        if step == 2:  # a new learning rate: a new DistributedOptimizer on the same model
            opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.05))
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


def _train(hvd, model, batches, **kw):
    """SGD on ``batches(step) -> (inputs, targets)`` (already sharded), cross-entropy."""
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    for step in range(STEPS):
        x, y = batches(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return list(model.parameters())


class _TiedHead(torch.nn.Module):
    """A language model's input embedding and output layer (an nn.Linear) share a weight."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.emb(tokens).mean(1)))


def tied_embedding_head(hvd, shard):
    def batches(step):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 64, (GLOBAL_BATCH, 5), generator=g)
        return shard(tokens), shard(torch.randint(0, 64, (GLOBAL_BATCH,), generator=g))
    return _train(hvd, _TiedHead(), batches)


class _SharedWeight(torch.nn.Module):
    """Two nn.Linear modules hold one weight (each its own bias)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(16, 64)
        self.b.weight = self.a.weight
        self.head = torch.nn.Linear(64, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)) * torch.tanh(self.b(x.flip(1))))


def weight_shared_by_two_modules(hvd, shard):
    return _train(hvd, _SharedWeight(), lambda step: tuple(map(shard, _batch(step))))


class _Borrowed(torch.nn.Module):
    """``F.linear`` on a module's weight, outside the module."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(16, 64)
        self.head = torch.nn.Linear(64, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.fc(x)) + 0.5 * torch.tanh(F.linear(x.flip(1),
                                                                             self.fc.weight)))


def functional_use_of_module_weight(hvd, shard):
    return _train(hvd, _Borrowed(), lambda step: tuple(map(shard, _batch(step))))


def reused_input_buffer(hvd, shard):
    """One input tensor refilled in place for every micro-batch (2 per step)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1),
               backward_passes_per_step=2)
    buf = torch.empty(GLOBAL_BATCH // hvd.size(), 64)
    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(2):
            x, y = _batch(10 * step + micro, dim=64)
            buf.copy_(shard(x))
            (F.cross_entropy(model(buf), shard(y)) / 2).backward()
        opt.step()
    return list(model.parameters())


class _TwoHeads(torch.nn.Module):
    """Head ``b`` is used from step 2 on: no gradient in the windows before."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(16, 64)
        self.a = torch.nn.Linear(64, 2)
        self.b = torch.nn.Linear(64, 2)
        self.step = 0

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h) + (self.b(h) if self.step >= 2 else 0)


def layer_unused_for_a_window(hvd, shard):
    model = _TwoHeads()
    opt = _opt(hvd, model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(STEPS):
        model.step = step
        x, y = _batch(step)
        opt.zero_grad()
        F.cross_entropy(model(shard(x)), shard(y)).backward()
        opt.step()
    return list(model.parameters())


PATTERNS = {f.__name__: f for f in (
    plain_sgd_momentum, adam_param_groups, tied_and_reused_weights, accumulation,
    freeze_unfreeze, add_param_group_midway, clipping, grad_scaler, compiled_model,
    sparse_embedding, ddp_hook_no_sync, save_load_resume, replaced_optimizer,
    tied_embedding_head, weight_shared_by_two_modules, functional_use_of_module_weight,
    reused_input_buffer, layer_unused_for_a_window)}
