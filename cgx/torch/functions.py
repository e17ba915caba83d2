"""Broadcast helpers (``horovod.torch.functions``): parameters, optimizer state, objects."""

from __future__ import annotations

import collections
from typing import Any

import torch

from cgx import runtime
from cgx import session


def _broadcast_tensors(tensors: list, root_rank: int) -> None:
    """In-place broadcast of many tensors, fused into one buffer per dtype and device."""
    tr = session.reducer().transport
    if not 0 <= root_rank < tr.size:
        raise ValueError(f"root_rank={root_rank} is not a rank (world size {tr.size})")
    groups = collections.defaultdict(list)
    for t in tensors:
        groups[(t.dtype, t.device)].append(t)
    for (_dtype, device), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1).to(tr.device) for t in group])
        tr.broadcast(flat, root_rank)
        for t, part in zip(group, flat.split([t.numel() for t in group])):
            with torch.no_grad():
                t.copy_(part.view_as(t).to(device))


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
        session.run(_broadcast_tensors, tensors, root_rank, label="broadcast_parameters")


def broadcast_object(obj: Any = None, root_rank: int = 0, name: str = None) -> Any:
    """``root_rank``'s ``obj`` (pickled) on every rank."""
    if runtime.size() == 1:
        return obj
    return session.run(lambda: session.reducer().transport.broadcast_object(obj, root_rank),
                       label=name or "broadcast_object")


def allgather_object(obj: Any, name: str = None) -> list:
    """Every rank's ``obj`` (pickled), as a list in rank order."""
    if runtime.size() == 1:
        return [obj]
    return session.run(lambda: session.reducer().transport.allgather_object(obj),
                       label=name or "allgather_object")


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
        session.run(_broadcast_tensors, tensors, root_rank, label="broadcast_optimizer_state")
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
