"""Broadcast helpers (``horovod.torch.functions``): parameters, optimizer state, objects."""

from __future__ import annotations

import torch

from cgx import runtime
from cgx import session
from cgx import ops
from cgx.exchange.per_rank import with_per_rank, without_per_rank
from cgx.ops import broadcast_tensors
from cgx.process_sets import global_process_set
from cgx.torch.optimizer import DistributedOptimizer


def broadcast_object(obj=None, root_rank: int = 0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (pickled) on every rank of ``process_set``.

    Example::

        epoch = hvd.broadcast_object(epoch, root_rank=0)
    """
    g = ops.resolve_process_set(process_set)
    return ops.broadcast_object(obj, root_rank, name, g)


def allgather_object(obj, name=None):
    """Every rank's ``obj`` (pickled), as a list in rank order (Horovod's signature:
    no process set)."""
    return ops.allgather_object(obj, name)


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
        session.run(broadcast_tensors, tensors, root_rank, "broadcast_parameters",
                    label="broadcast_parameters")


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


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Make every rank's optimizer state (and hyperparameters) equal to ``root_rank``'s.

    The structure travels pickled; the tensors (moments, step counters) travel
    as fused broadcasts. Works for a ``DistributedOptimizer`` or a plain one.

    cgx's shared state travels too (step counters, PowerSGD's warm-start
    matrices, which are the same on every rank); per-rank state does not:
    each rank keeps its own error-feedback residuals (what its own
    compression left out). So "rank 0 loads a checkpoint, then broadcast"
    resumes with rank 0's residuals on rank 0 and the others' current ones
    (zeros in a fresh process). For a bit-exact resume with error feedback,
    save ``optimizer.state_dict()`` on every rank and load each rank's own.

    An optimizer with no state yet (just created) gets it first as Horovod gives it:
    every trainable parameter's gradient set to zeros (sparse ones for ``SparseAdam``
    and for ``model``'s sparse embeddings) and one step of the wrapped optimizer (so,
    as in Horovod, weight decay acts once and Adam's step count starts at 1).
    """
    if runtime.size() == 1:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not optimizer.state_dict()["state"]:
        _create_state(optimizer, model)
    local = optimizer.state_dict()
    tensors: list = []
    structure = _split_tensors(without_per_rank(local), tensors)
    structure = ops.broadcast_object(
        structure if runtime.rank() == root_rank else None, root_rank)
    if runtime.rank() != root_rank:
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device=device)
                   for _, _, shape, dtype, device in _placeholders(structure)]
    if tensors:
        session.run(broadcast_tensors, tensors, root_rank, "broadcast_optimizer_state",
                    label="broadcast_optimizer_state")
    optimizer.load_state_dict(with_per_rank(_join_tensors(structure, tensors), local))


def _create_state(optimizer, model=None) -> None:
    """Horovod's initialization of a fresh optimizer's state: zero gradients, one step of the
    wrapped optimizer (never the DistributedOptimizer's own step: no collective)."""
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if isinstance(inner, torch.optim.LBFGS):
        return  # its step needs a closure (Horovod refuses LBFGS); the root's state travels
    sparse = set() if model is None else {
        id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.sparse
        for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(inner, torch.optim.SparseAdam) or (
                        isinstance(inner, torch.optim.SGD) and id(p) in sparse):
                    p.grad = p.grad.to_sparse()
    inner.step()


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
