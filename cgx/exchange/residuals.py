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


def _copied(table: dict) -> dict:
    return {k: v.detach().clone() for k, v in table.items()}


class ResidualStore:
    """Residuals of the fused exchange (input units) and owed remainders (gradient units),
    keyed by tensor name.

    Args:
        predivide: the exchange's predivide factor (input units x predivide = gradient units).
    """

    def __init__(self, predivide: float = 1.0):
        self.predivide = float(predivide)
        self.residuals: dict[str, torch.Tensor] = {}
        self.owed: dict[str, torch.Tensor] = {}

    def for_tensor(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """The float32 residual of ``name`` for the reducer to update (zeros when new)."""
        e = self.residuals.get(name)
        if e is None or e.numel() != w.numel() or e.device != w.device:
            e = torch.zeros(w.numel(), dtype=torch.float32, device=w.device)
            self.residuals[name] = e
        return e

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
        self.residuals = _copied(state["residuals"])
        self.owed = _copied(state.get("owed", {}))
