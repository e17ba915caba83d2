"""Sufficient factors in the torch optimizer: which layers, and the exchange of one.

``DistributedOptimizer(..., sufficient_factors=model)`` exchanges the weight gradients
of the model's ``nn.Linear`` layers as sufficient factors (Poseidon) whenever that
moves fewer bytes: ``K x P x (M + N) < M x N`` for K rows per rank, P ranks and an
M x N weight. The rebuilt average is exact (the bias's too, from the output
gradients); each layer's exchange starts as soon as its gradient is ready, beside
the rest of backward, in a bucket of its own.

The factors go only when the layer's product is the weight's whole gradient on
every rank; otherwise the layer takes the plain path for the step (used twice in a
forward, unused on a rank, its weight also used elsewhere: ``F.linear`` on it, a
custom autograd function, a gradient hook). A weight or bias registered in several
modules (tied embedding and output layer, shared ``nn.Linear``) always takes the
plain path. The capture is ``cgx.torch.factor_capture``; the exchange of one layer
``cgx.sufficient_factors.exchange_layer``.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

from cgx.sufficient_factors import exchange_layer
from cgx.torch.factor_capture import FactorCapture


class FactorLayers:
    """The captured layers of one optimizer's parameters.

    Args:
        modules, names: as :class:`cgx.torch.factor_capture.FactorCapture` takes them.
        params, index: the optimizer's trainable parameters and id -> their index.
        owner: the optimizer (the hooks go when it does).

    Attributes:
        weights: indices (in the optimizer's parameter list) of the captured weights.
        biases: weight index -> index of its trainable bias.
        used: the last step's: layer name -> whether it travelled as factors.
    """

    def __init__(self, modules, params: list, index: dict, owner,
                 names: Optional[dict] = None) -> None:
        self.capture = FactorCapture(modules, {id(p) for p in params}, names)
        # Without the optimizer (``owner``), the hooks would go on recording for nobody.
        self._release = weakref.finalize(owner, self.capture.remove)
        self.weights = [i for i, p in enumerate(params) if id(p) in self.capture.captures]
        self.biases: dict = {}
        for i in self.weights:
            bias = self.capture.captures[id(params[i])].module.bias
            if bias is not None and id(bias) in index:
                self.biases[i] = index[id(bias)]
        self.used: dict = {}

    def remove(self) -> None:
        self.capture.remove()
        self._release.detach()

    def clear(self) -> None:
        """Forget what forward recorded (after a step, or ``zero_grad``)."""
        self.capture.clear()

    def members(self, i: int) -> list[int]:
        """The parameter indices of weight ``i``'s layer: the weight, then its bias."""
        return [i] + ([self.biases[i]] if i in self.biases else [])

    def exchange(self, i: int, params: list, plain: Callable[[list], None], reducer,
                 passes: int, average: bool, shadow: bool, choose=None) -> bool:
        """Engine thread: weight ``i``'s layer as factors, or ``plain(grads)`` when the
        factors do not go (``choose``: the planned mode's say). True: the factors went."""
        layer = [params[j] for j in self.members(i)]
        if shadow:
            grads = [torch.zeros_like(p) for p in layer]
        else:
            for p in layer:
                if p.grad is None:  # no gradient on this rank: it contributes zeros
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in layer]
        cap = self.capture.captures[id(layer[0])]
        bias: Optional[torch.Tensor] = layer[1] if len(layer) > 1 else None
        used = exchange_layer(cap, layer[0], reducer.transport, passes, average,
                              lambda: plain(grads), record=reducer.add_stats, choose=choose,
                              shadow=shadow, bias=bias)
        if not shadow:
            self.used[cap.name] = used
        return used
