"""Which DistributedOptimizer hears of a parameter's gradient.

Each parameter carries one post-accumulate-grad hook, of one optimizer: a new
DistributedOptimizer over the same model (a notebook re-run, a new learning rate)
takes the parameter over and removes the old hook. Hooks hold their optimizer
weakly, so a dropped optimizer is released, and carry the *generation* of the
layout they were made for: a hook of an older layout (before freezing or
``add_param_group``) is ignored.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Callable

import torch

_owner_ids = itertools.count(1)
# id(parameter) -> (weakref to it, owner id, hook handle)
_owners: dict = {}


def _on_grad(callback_ref: weakref.WeakMethod, generation: int, p: torch.Tensor) -> None:
    callback = callback_ref()
    if callback is not None:
        callback(p, generation)


class GradHooks:
    """The hooks of one owner (a DistributedOptimizer).

    ``install(params, callback)`` calls ``callback(p, generation)`` (a bound method,
    held weakly) when ``p``'s gradient is accumulated; ``current(p, generation)``
    says whether the call comes from this owner's latest layout.
    """

    def __init__(self) -> None:
        self.owner_id = next(_owner_ids)
        self.generation = 0
        self.handles: list = []

    def install(self, params: list, callback: Callable) -> None:
        self.generation += 1
        self.remove()
        ref = weakref.WeakMethod(callback)
        for p in params:
            old = _owners.get(id(p))
            if old is not None and old[0]() is p and old[1] != self.owner_id:
                old[2].remove()  # another DistributedOptimizer had this parameter
            h = p.register_post_accumulate_grad_hook(
                functools.partial(_on_grad, ref, self.generation))
            _owners[id(p)] = (weakref.ref(p), self.owner_id, h)
            self.handles.append(h)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def current(self, p: torch.Tensor, generation: int) -> bool:
        """Is this a hook of the latest layout, on a parameter this owner still has?"""
        owner = _owners.get(id(p))
        return generation == self.generation and owner is not None and \
            owner[1] == self.owner_id
