"""What an exchange still owes: the error-feedback residuals of the fused exchange and the
remainders a tensor carries over when its compression family changes.

Units: ``residuals`` hold what the fused reducer dropped, in *input units* (after the
``1 / predivide`` prescale, see ``cgx.collectives.algorithms.ReduceContext``), so they
stay right whichever chunk of a fused reduction a value falls in; ``owed`` holds what a
tensor's previous family still owed, in *gradient units*, added once to its next gradient.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from cgx.policy.update_rule import Compensation
from cgx.exchange.compensation import Compensator, MovingAverage


def _copied(table: dict) -> dict:
    return {k: v.detach().clone() for k, v in table.items()}


class ResidualStore:
    """Residuals of the fused exchange (input units) and owed remainders (gradient units),
    keyed by tensor name.

    Args:
        predivide: the exchange's predivide factor (input units x predivide = gradient units).
        compensation: how the fused exchange's residuals come back
            (:mod:`cgx.exchange.compensation`): ``residuals`` hold the classic residual,
            or with MOVING_AVERAGE the average of what quantization dropped.
        settings: the moving average's settings (its defaults when None).
    """

    def __init__(self, predivide: float = 1.0,
                 compensation: Compensation = Compensation.ERROR_FEEDBACK,
                 settings: Optional[MovingAverage] = None):
        self.predivide = float(predivide)
        self.residuals: dict[str, torch.Tensor] = {}
        self.owed: dict[str, torch.Tensor] = {}
        self.compensation = compensation
        self.compensator = Compensator(compensation, self.residuals, settings)

    def buffers(self, work: Sequence[torch.Tensor], names: Sequence[str],
                specs: Sequence) -> list:
        """One float32 buffer per quantized tensor (None for exact ones) for the reducer
        to add and update; :meth:`settle` keeps what it left."""
        return [self.compensator.buffer(n, w, s, self.predivide) if s is not None else None
                for n, s, w in zip(names, specs, work)]

    def keeps_any(self) -> bool:
        """Whether any tensor keeps a residual (the exchange asks for buffers only then)."""
        return self.compensator.compensates()

    def set_kinds(self, kinds: dict, restored: bool = False) -> None:
        """Per tensor name, its :class:`Compensation` from now on (the others keep the
        store's). A classic residual is what the tensor still owes: when its compensation
        changes, it is added once to the tensor's next gradient; a moving average is not
        owed, and is dropped. ``restored``: the kinds of a checkpoint whose residuals the
        store already holds (nothing is moved)."""
        comp = self.compensator
        if restored:
            comp.kinds = dict(kinds)
            return
        for name, kind in kinds.items():
            old = comp.kind_of(name)
            if kind is old:
                continue
            e = self.residuals.pop(name, None)
            if old is Compensation.ERROR_FEEDBACK and e is not None:
                self.owe(name, e)
            comp.kinds[name] = kind

    def settle(self, names: Sequence[str], buffers: Sequence) -> None:
        """After the reducer: keep what the compensation keeps of what it dropped."""
        self.compensator.settle(names, buffers)

    def send_with_exact(self, work: Sequence[torch.Tensor], names: Sequence[str],
                        specs: Sequence) -> None:
        """A tensor that travels exact this time (spec None) sends what its quantization
        still owed with it and keeps no residual: a residual held through exact steps would
        come back stale when the tensor is quantized again."""
        for w, n, s in zip(work, names, specs):
            if s is None and n in self.residuals:
                e = self.residuals.pop(n)
                if e.numel() == w.numel():
                    w.view(-1).add_(e.to(w.device, w.dtype), alpha=self.predivide)

    def add_owed(self, work: Sequence[torch.Tensor], names: Sequence[str]) -> None:
        """Add each tensor's owed remainder (once) to its gradient."""
        for w, n in zip(work, names):
            e = self.owed.pop(n, None)
            if e is not None and e.numel() == w.numel():
                w.view(-1).add_(e.to(w.device, w.dtype))

    def owe(self, name: str, residual: Optional[torch.Tensor]) -> None:
        """Note ``residual`` (input units, from any family's compressor) as owed by ``name``."""
        if residual is None:
            return
        flat = residual.reshape(-1).to(torch.float32) * self.predivide
        old = self.owed.get(name)
        self.owed[name] = flat if old is None else old + flat

    def held(self, name: str) -> list[torch.Tensor]:
        """What is held for ``name`` here, flat float32 in gradient units."""
        parts = [(self.residuals.get(name), self.predivide), (self.owed.get(name), 1.0)]
        return [e.detach().reshape(-1).to(torch.float32) * f for e, f in parts if e is not None]

    def state_dict(self, with_owed: bool) -> dict:
        state = {"residuals": _copied(self.residuals)}
        if with_owed:
            state["owed"] = _copied(self.owed)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.residuals.clear()
        self.residuals.update(_copied(state["residuals"]))
        self.owed = _copied(state.get("owed", {}))
