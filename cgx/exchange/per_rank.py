"""Which parts of an exchange's state belong to one rank, and never travel to another.

Error-feedback residuals (and what auto's owed mass counts) are what *this* rank's
compression dropped: a rank that took another's would send it again. Everything else
(steps, PowerSGD's warm start, the plan's levels) every rank must hold alike, and is sent
from one rank to the others when they sync: ``broadcast_optimizer_state``, an elastic
job's sync, a torchft heal.
"""

from __future__ import annotations

PER_RANK_KEYS = ("residuals", "owed")
_PER_RANK = "__cgx_per_rank__"


def without_per_rank(tree):
    """``tree`` (nested dicts) with every entry under a :data:`PER_RANK_KEYS` key replaced
    by a marker: what may be sent to other ranks."""
    if isinstance(tree, dict):
        return {k: (_PER_RANK if k in PER_RANK_KEYS else without_per_rank(v))
                for k, v in tree.items()}
    return tree


def with_per_rank(tree, local):
    """A received :func:`without_per_rank` tree with this rank's own per-rank entries (from
    ``local``, its own full tree) put back where the markers are (empty where it has none)."""
    if isinstance(tree, dict):
        local = local if isinstance(local, dict) else {}
        return {k: (local.get(k, {}) if v == _PER_RANK else with_per_rank(v, local.get(k)))
                if isinstance(v, (dict, str)) else v for k, v in tree.items()}
    return tree
