"""Sufficient factors without the model: finding the layers that hold an optimizer's weights.

``DistributedOptimizer(..., sufficient_factors=model)`` searches ``model`` for the
``nn.Linear`` layers whose gradients may travel as sufficient factors. Most scripts never
pass the model, so the deciding default (and ``Compression.planned()``) finds the layers
itself: during the optimizer's first step a process-wide forward pre-hook
(``torch.nn.modules.module.register_module_forward_pre_hook``) notes every module that
runs forward in training mode, with gradients on, and registers one of the optimizer's
parameters itself. When that step's exchange is over, the hook is removed, the ranks
keep the layers every one of them saw (one gather), and those modules stand in for the
model: the exchange is laid out again with their factor layers, from the second step on.

Nothing about exactness changes (:mod:`cgx.torch.factor_capture`): a parameter registered
in two of the modules seen (a tied embedding and output layer) never travels as factors,
and a use the modules seen do not show (the weight read by ``F.linear`` elsewhere, a
module of the model that did not run in the first step) is caught at every pass by the
capture's proof that the layer's product is the weight's whole gradient; without it the
layer travels plainly for the step. A layer that first runs after the first step is not
found: pass ``sufficient_factors=model`` for it, or ``sufficient_factors=False`` to
search nothing.
"""

from __future__ import annotations

import weakref

import torch

from cgx import session


class FactorDiscovery:
    """Notes, until :meth:`finish`, the modules that register the optimizer's parameters.

    Args:
        params: the optimizer's trainable parameters, in index order.
    """

    def __init__(self, params: list) -> None:
        self._index = {id(p): i for i, p in enumerate(params)}
        self._seen: dict[int, weakref.ref] = {}  # id(module) -> the module
        self._handle = torch.nn.modules.module.register_module_forward_pre_hook(self._note)

    def _note(self, module: torch.nn.Module, args) -> None:
        if id(module) in self._seen or not (module.training and torch.is_grad_enabled()):
            return
        if any(p is not None and id(p) in self._index for p in module._parameters.values()):
            self._seen[id(module)] = weakref.ref(module)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def finish(self, group=None) -> list[torch.nn.Module]:
        """Stop noting; the modules seen on every rank of ``group`` (a collective: every
        rank calls it at the same step), as ``FactorCapture`` takes them."""
        self.remove()
        mine: dict[tuple, list] = {}  # modules registering the same parameters share a key
        for ref in self._seen.values():
            m = ref()
            if m is not None:
                mine.setdefault(self._key(m), []).append(m)
        self._seen = {}
        common = set(mine)
        for keys in _gather(sorted(mine), group):
            common &= set(keys)
        return [("", m) for k in sorted(common) for m in mine[k]]

    def _key(self, module: torch.nn.Module) -> tuple:
        """What names a module alike on every rank: the positions of its parameters."""
        return tuple(sorted(self._index[id(p)] if id(p) in self._index else -1
                            for p in module._parameters.values() if p is not None))


def _gather(keys: list, group=None) -> list:
    """Every rank's keys. Part of the optimizer's step, straight on the step's transport:
    a rank that called ``join()`` sends its own (none) from its shadow step, where a
    functional collective (``cgx.ops.allgather_object``) would be refused."""
    return session.run(lambda: session.reducer_of(group).transport.allgather_object(keys),
                       label="factor-discovery")
