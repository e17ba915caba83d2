"""What every adapter's exchange arguments share: one validated options object, and
tensor naming."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Optional, Sequence

from cgx.comm.base import ReduceOp


def _int_at_least(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class ExchangeOptions:
    """The gradient-exchange arguments of Horovod's optimizers and tape, checked once for
    every adapter (torch and Keras ``DistributedOptimizer``, ``DistributedGradientTape``).

    Attributes:
        op: ``ReduceOp.AVERAGE`` or ``ReduceOp.SUM``.
        predivide: ``gradient_predivide_factor`` (Average only): divide by it before the
            sum and by ``size / predivide`` after.
        backward_passes_per_step: passes accumulated locally per exchange.
        num_groups: cut the gradients into this many buckets (0: by size).
        sparse_as_dense: reduce sparse gradients densely (compressed) instead of gathering.
    """

    op: ReduceOp = ReduceOp.AVERAGE
    predivide: float = 1.0
    backward_passes_per_step: int = 1
    num_groups: int = 0
    sparse_as_dense: bool = False

    @classmethod
    def checked(cls, who: str, *, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                backward_passes_per_step: int = 1, num_groups: int = 0,
                sparse_as_dense: bool = False) -> "ExchangeOptions":
        """The options, or a ValueError that says which argument to change (``who``: the
        caller's name in the message)."""
        _int_at_least(backward_passes_per_step, "backward_passes_per_step", 1)
        if op is not ReduceOp.AVERAGE and op is not ReduceOp.SUM:
            raise ValueError(f"op must be Average or Sum for {who}, got {op!r}")
        factor = gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor > 0:
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")
        if factor != 1.0 and op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor applies to op=Average only")
        _int_at_least(num_groups, "num_groups", 0)
        return cls(op, float(factor), backward_passes_per_step, num_groups,
                   bool(sparse_as_dense))


def check_wrapped_once(optimizer, wrapper: type) -> None:
    """Horovod's optimizers wrap a plain optimizer once."""
    if isinstance(optimizer, wrapper):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap it once")


def unique_names(names: Sequence[Optional[str]], prefix: str) -> list[str]:
    """``names`` with None filled in and repeats made unique (``w``, ``w.1``, ``w.2``).

    Names key compressor state (residuals, warm starts), so two tensors must
    never share one; the suffixes depend only on the order, the same on every rank.
    """
    out, seen = [], {}
    for i, n in enumerate(names):
        n = n if n else f"{prefix}.noname.{i}"
        k = seen.get(n, 0)
        seen[n] = k + 1
        out.append(n if k == 0 else f"{n}.{k}")
    return out
