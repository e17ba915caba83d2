"""What every adapter's exchange arguments share: one validated options object, and
tensor naming."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional, Sequence

from cgx import process_sets
from cgx.comm.base import ReduceOp
from cgx.rules import parse_rules


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
        process_set: Horovod's ``process_set=`` as given (None: every rank).
        group: the process set's registry entry for collectives (None: the world).
        rules: per-layer rules as given (dict, list or YAML path; checked here).
    """

    op: ReduceOp = ReduceOp.AVERAGE
    predivide: float = 1.0
    backward_passes_per_step: int = 1
    num_groups: int = 0
    sparse_as_dense: bool = False
    process_set: Any = None
    group: Any = None
    rules: Any = None

    @classmethod
    def checked(cls, who: str, *, op=ReduceOp.AVERAGE, gradient_predivide_factor=1.0,
                backward_passes_per_step: int = 1, num_groups: int = 0,
                sparse_as_dense: bool = False, process_set=None,
                rules=None) -> "ExchangeOptions":
        """The options, or a ValueError that says which argument to change (``who``: the
        caller's name in the message). A process set this rank may not use and rules that
        do not parse fail here, before the first step."""
        _int_at_least(backward_passes_per_step, "backward_passes_per_step", 1)
        if op is not ReduceOp.AVERAGE and op is not ReduceOp.SUM:
            raise ValueError(f"op must be Average or Sum for {who}, got {op!r}")
        factor = gradient_predivide_factor
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not factor > 0:
            raise ValueError(f"gradient_predivide_factor must be a number > 0, got {factor!r}")
        if factor != 1.0 and op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor applies to op=Average only")
        _int_at_least(num_groups, "num_groups", 0)
        group = process_sets.resolve(process_set)
        if rules is not None:
            parse_rules(rules)
        return cls(op, float(factor), backward_passes_per_step, num_groups,
                   bool(sparse_as_dense), process_set, group, rules)


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


def names_by_id(named, argument: str, required: Optional[Sequence] = None,
                unique: bool = False) -> dict:
    """``id(tensor) -> name`` from the user's ``(name, tensor)`` pairs or a dict
    ``name -> tensor`` (``named_parameters=``, ``named_variables=``).

    Args:
        argument: the argument's name, for the messages.
        required: tensors that must all be named when ``named`` is given.
        unique: refuse two pairs with one name (torch's parameter names must differ).
    """
    if named is None:
        return {}
    items = list(named.items()) if isinstance(named, dict) else list(named)
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"{argument} should be (name, tensor) pairs (e.g. "
                             f"model.named_parameters()) or a dict name -> tensor; got an item "
                             f"{item!r:.80}")
    if unique:
        names = [n for n, _ in items]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"{argument} has duplicate names: {dups}")
    by_id = {id(t): n for n, t in items}
    missing = [t for t in required or () if id(t) not in by_id]
    if missing:
        raise ValueError(f"{argument} was given, but {len(missing)} tensor(s) to exchange are "
                         f"not in it; pass {argument} of the model whose tensors these are")
    return by_id


def default_names(groups: Sequence[Sequence], names: dict, prefix: str) -> dict:
    """``names`` (id -> name) with Horovod's name for each tensor it lacks:
    ``<prefix>.noname.<group>.<index in the group>``."""
    out = dict(names)
    for i, group in enumerate(groups):
        for j, t in enumerate(group):
            out.setdefault(id(t), f"{prefix}.noname.{i}.{j}")
    return out
