"""Sparse gradients in the torch optimizer (``nn.Embedding(sparse=True)``), Horovod's way.

``sparse_as_dense=False`` (Horovod's default): a sparse gradient travels alone as
Horovod's sparse allreduce (every rank's indices and values all-gathered,
uncompressed) and ``p.grad`` becomes the (uncoalesced) sparse average, the layout
``torch.optim.SparseAdam`` expects. Once a parameter's gradient came sparse it
stays on that path: a rank that joined sends an empty sparse gradient for it.

``sparse_as_dense=True``: the gradient is made dense, travels with the others
(compressed), and is handed back sparse with its sparse dimensions.
"""

from __future__ import annotations

import torch

from cgx.ops import sparse_reduce


class SparseGradients:
    """Which parameters travel sparse, and their results of the step.

    Attributes:
        ids: id(parameter) of every parameter whose gradient came sparse (kept
            across re-setups: the path must not change between steps).
        results: this step's reduced sparse gradients, by parameter index.
        densified: this step's ``sparse_as_dense`` gradients: index -> sparse dims.
    """

    def __init__(self, sparse_as_dense: bool) -> None:
        self.sparse_as_dense = sparse_as_dense
        self.ids: set = set()
        self.results: dict = {}
        self.densified: dict = {}

    def travels_sparse(self, p: torch.Tensor, zeros: bool) -> bool:
        """Does ``p``'s gradient take the sparse path this step? (``zeros``: a joined rank's
        step, which sends nothing of its own.)"""
        grad = None if zeros else p.grad
        if grad is not None and grad.is_sparse and not self.sparse_as_dense:
            self.ids.add(id(p))
        return id(p) in self.ids and (zeros or (grad is not None and grad.is_sparse))

    @staticmethod
    def gradient(p: torch.Tensor, zeros: bool) -> torch.Tensor:
        """``p``'s sparse gradient, or an empty one of its shape for a joined rank."""
        if not zeros:
            return p.grad
        return torch.sparse_coo_tensor(
            torch.zeros((p.dim(), 0), dtype=torch.int64),
            torch.zeros((0,) + tuple(p.shape[1:]), dtype=p.dtype), p.shape).to(p.device)

    def dense(self, i: int, p: torch.Tensor) -> torch.Tensor:
        """``p.grad`` made dense if it is sparse (``sparse_as_dense``), remembered to be
        handed back sparse."""
        if p.grad.is_sparse:
            self.densified[i] = p.grad.sparse_dim()
            p.grad = p.grad.to_dense()
        return p.grad

    def reduce(self, i: int, grad: torch.Tensor, op, name: str, group, shadow: bool) -> None:
        """Engine thread: Horovod's sparse allreduce of one gradient (values divided by the
        number of ranks for Average)."""
        out = sparse_reduce(grad, op, name, group)
        if not shadow:
            self.results[i] = out

    def hand_back(self, params: list) -> None:
        """After the step's reductions: the sparse results into ``p.grad``, and the
        densified gradients back to their sparse layout."""
        for i, g in self.results.items():
            params[i].grad = g
        for i, dims in self.densified.items():
            params[i].grad = params[i].grad.to_sparse(dims)

    def clear(self) -> None:
        self.results = {}
        self.densified = {}
