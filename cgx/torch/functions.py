"""Broadcast helpers (``horovod.torch.functions``): parameters, optimizer state, objects."""

from __future__ import annotations

import torch

from cgx import runtime
from cgx import session
from cgx.collectives.functional import broadcast_object, broadcast_tensors


def broadcast_parameters(params, root_rank: int) -> None:
    """Copy ``root_rank``'s parameters (or any tensors) to every rank, in place.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list of
            ``(name, tensor)`` pairs; the same names in the same order on every rank.
        root_rank: the rank whose values win.

    Example::

        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and not all(isinstance(x, tuple) and len(x) == 2 for x in items):
            raise ValueError("params must be a dict or a sequence of (name, tensor) pairs, "
                             "e.g. model.state_dict() or model.named_parameters()")
    tensors = [t for _, t in items if isinstance(t, torch.Tensor)]
    if runtime.size() > 1 and tensors:
        session.run(broadcast_tensors, tensors, root_rank, label="broadcast_parameters")


def _split_tensors(tree, out: list):
    """Replace tensors in a nested state dict by placeholders; collect them in ``out``."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
        return ("__cgx_tensor__", len(out) - 1, tuple(tree.shape), str(tree.dtype)[6:],
                str(tree.device))
    if isinstance(tree, dict):
        return {k: _split_tensors(v, out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_split_tensors(v, out) for v in tree)
    return tree


def _join_tensors(tree, tensors: list):
    if isinstance(tree, tuple) and len(tree) == 5 and tree[0] == "__cgx_tensor__":
        return tensors[tree[1]]
    if isinstance(tree, dict):
        return {k: _join_tensors(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_join_tensors(v, tensors) for v in tree)
    return tree


def broadcast_optimizer_state(optimizer, root_rank: int) -> None:
    """Make every rank's optimizer state (and hyperparameters) equal to ``root_rank``'s.

    The structure travels pickled; the tensors (moments, step counters) travel
    as fused broadcasts. Works for a ``DistributedOptimizer`` or a plain one.
    """
    if runtime.size() == 1:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    tensors: list = []
    structure = _split_tensors(optimizer.state_dict(), tensors)
    structure = broadcast_object(structure if runtime.rank() == root_rank else None, root_rank)
    if runtime.rank() != root_rank:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for _, _, shape, dtype, device in _placeholders(structure)]
    if tensors:
        session.run(broadcast_tensors, tensors, root_rank, label="broadcast_optimizer_state")
    optimizer.load_state_dict(_join_tensors(structure, tensors))


def _placeholders(tree) -> list:
    found = []

    def walk(t):
        if isinstance(t, tuple) and len(t) == 5 and t[0] == "__cgx_tensor__":
            found.append(t)
        elif isinstance(t, dict):
            for v in t.values():
                walk(v)
        elif isinstance(t, (list, tuple)):
            for v in t:
                walk(v)

    walk(tree)
    return sorted(found, key=lambda t: t[1])
