"""``hvd.DiLoCo``: DiLoCo-style local steps for torch (the loop itself is ``cgx.diloco``).

Example::

    import cgx.torch as hvd
    hvd.init()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=3e-4), sync_every=50)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()   # local AdamW step; every 50th also starts the outer exchange

Parameters only: buffers (BatchNorm statistics) stay each rank's own, as in DiLoCo.
"""

from __future__ import annotations

from typing import Sequence

import torch

from cgx.diloco import DiLoCoConfig, OuterLoop, OuterSGD
from cgx.ops import resolve_process_set
from cgx.process_sets import global_process_set

STATE_FORMAT = 1


class TorchParams:
    """The loop's view of a list of torch parameters (:class:`cgx.diloco.ParamAccess`)."""

    __slots__ = ("params",)

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)

    def read(self, indices) -> list:
        return [self.params[i].detach() for i in indices]

    def write(self, indices, values) -> None:
        with torch.no_grad():
            for i, v in zip(indices, values):
                self.params[i].copy_(v)  # casts to the parameter's dtype and device


class DiLoCo:
    """Wraps an inner ``torch.optim`` optimizer: local steps, and every ``sync_every`` steps
    the outer gradient averaged (compressed) over the ranks and applied by the outer optimizer.

    Args:
        model: the module whose trainable parameters are trained (their names key the
            error-feedback residuals and per-layer rules).
        optimizer: the inner optimizer over those parameters (AdamW in DiLoCo).
        sync_every: H, or ``"auto"`` (see :class:`cgx.diloco.DiLoCoConfig`).
        fragments: K: > 1 is Streaming DiLoCo (staggered, overlapped fragments).
        delay: inner steps a fragment's exchange overlaps (default 0 for K = 1, else 1).
        outer_optimizer: :class:`cgx.diloco.OuterSGD` (default lr 0.7, momentum 0.9,
            Nesterov; ``follow_inner_lr=True`` reads each parameter group's ``lr`` at
            every outer step) or None (plain averaging: local SGD).
        compression: how outer gradients travel; default 4-bit with error feedback.
        warmup_steps: steps of synchronous data parallel first (gradients averaged
            through ``warmup_compression``, default ``Compression.none``: ``CGX_*``).
        mix, calibrate_steps, assume_gbit: see :class:`cgx.diloco.DiLoCoConfig`.
        process_set: sync over this process set's ranks only.

    Raises:
        ValueError: H < 1, more fragments than parameters or than H, delay >= H, an
            outer lr <= 0 (from ``OuterSGD``), negative warm-up.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 sync_every=50, fragments: int = 1, delay=None,
                 outer_optimizer=OuterSGD(), compression=None, warmup_steps: int = 0,
                 warmup_compression=None, mix: float = 0.0, calibrate_steps: int = 5,
                 assume_gbit=None, process_set=global_process_set):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (the inner one), got "
                            f"{type(optimizer).__name__}")
        config = DiLoCoConfig(sync_every, fragments, delay, outer_optimizer, compression,
                              warmup_steps, warmup_compression, mix, calibrate_steps,
                              assume_gbit)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in named if id(p) not in stepped]
        if missing:
            raise ValueError(f"the optimizer does not step {missing[:3]} of the model's "
                             "trainable parameters; give it model.parameters()")
        self.optimizer = optimizer
        self._access = TorchParams([p for _, p in named])
        group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._group_of = [group_of[id(p)] for _, p in named]  # for the inner lr
        self._loop = OuterLoop([n for n, _ in named], [tuple(p.shape) for _, p in named],
                               config, group=resolve_process_set(process_set))

    @property
    def config(self) -> DiLoCoConfig:
        return self._loop.config

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def local_step(self) -> int:
        """Local steps done (after the warm-up)."""
        return self._loop.local_step

    @property
    def sync_every(self):
        """H in use (``"auto"``: None until chosen)."""
        return self._loop.state.sync_every

    @property
    def choice(self):
        """``sync_every="auto"``: the :class:`cgx.diloco.RoundChoice` made (else None)."""
        return self._loop.choice

    def step(self, closure=None):
        """One inner step (a synchronous one during the warm-up); the outer exchanges
        start and land at their steps."""
        if self._loop.in_warmup:
            self._average_gradients()
        self._loop.before_inner_step(self._access)
        out = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        self._loop.after_inner_step(self._access, inner_lr=self._inner_lr())
        return out

    def _inner_lr(self):
        """Per parameter, its group's learning rate (``OuterSGD(follow_inner_lr=True)``)."""
        if not self._loop.follows_inner_lr:
            return None
        lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        return [lrs[k] for k in self._group_of]

    def _average_gradients(self) -> None:
        params = self._access.params
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        grads = [g.to_dense() if g.is_sparse else g.contiguous() for g in grads]
        outs = self._loop.average_gradients(grads)
        for p, o in zip(params, outs):
            p.grad = o.view_as(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The inner optimizer's state and the loop's (anchors, outer momentum, residuals,
        counters, results of exchanges in flight: this waits for them)."""
        return {"format": STATE_FORMAT, "optimizer": self.optimizer.state_dict(),
                "diloco": self._loop.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"expected a DiLoCo.state_dict() of format {STATE_FORMAT}, got "
                             f"{type(state).__name__}")
        self.optimizer.load_state_dict(state["optimizer"])
        self._loop.load_state_dict(state["diloco"])

    def __repr__(self) -> str:
        c = self.config
        return (f"DiLoCo({type(self.optimizer).__name__}, sync_every={c.sync_every}, "
                f"fragments={c.fragments}, delay={c.delay}, outer={c.outer_optimizer})")
