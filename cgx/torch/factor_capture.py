"""Hooks on ``nn.Linear`` layers recording their sufficient factors and proving that the
factors' product is the weight's whole gradient (see :mod:`cgx.sufficient_factors`).

The exchange writes ``dy^T x`` (and ``sum(dy)`` for the bias) into ``.grad`` in place of
the plain reduction. That is exact only when, on this rank and in every backward pass
of the step, the layer's own product is the parameter's whole gradient. The rule, checked
exactly (by tensor identity and counts, never by comparing values):

* **Construction.** A weight or bias registered in more than one module of the model (a
  tied embedding and output layer, two ``nn.Linear`` sharing a weight) is never sent as
  factors: its layer is not captured and reduces like any other parameter.
* **Every backward pass.** During the layer's forward, ``layer.weight`` (and a trainable
  ``layer.bias``) reads as a fresh alias ``p.view_as(p)``, so the layer's own
  contribution to the parameter's gradient leaves through the alias's autograd node,
  where a post-hook notes the tensor. A pre-hook on the parameter's
  gradient-accumulator node (it runs after every tensor hook on the parameter) receives
  what autograd is about to accumulate: the sum over every use of the parameter in the
  pass. When the layer is the only use, that is the very tensor the alias sent (same
  object, same version). Any other use (``F.linear(x, layer.weight)`` elsewhere, a
  custom autograd Function, a penalty on the weight in the loss, a tied module outside
  the model given) or a gradient hook that replaces or edits it hands over another
  tensor, and a pass in which the layer took no part hands over a gradient with no
  contribution noted. Each such receipt makes the step's factors unfaithful, and so does
  a forward whose contribution never arrived alone.

An unfaithful layer takes the plain path for the step; every rank learns it through the
agreement that precedes the exchange (:func:`cgx.sufficient_factors.agree`), so all
ranks decide alike.

The inputs: each forward keeps its input by reference with the tensor's version counter.
When backward hands the layer its output gradient, the input must not have been written
since the forward (else the pass is not recorded, and the step goes plain), and both are
copied into one float32 block ``[dy | x]``. The copy is made during the pass's own
backward, so a later write to the input (one buffer refilled for each micro-batch with
``backward_passes_per_step > 1``, or for the next batch before ``step()``) cannot reach
the factors; the output gradient is copied as autograd hands it over, before anything
else can see it. The block is the allgather's send buffer when no padding is needed.

Not seen: writes that bypass the version counter (through ``.data`` or memory shared
with numpy) between a forward and its backward, and a forward pre-hook on the same layer
registered after the optimizer (it would see the alias, and its own uses of
``layer.weight`` would count as the layer's), and a global forward hook
(``register_module_forward_hook``) that replaces a layer's output.
"""

from __future__ import annotations

import collections
import weakref
from typing import Optional

import torch

from cgx.sufficient_factors import Capture

# id(module) -> (weakref to it, weakref to the FactorCapture hooking it): one capture
# hooks a layer; a new one over the same model (a new DistributedOptimizer) takes it over.
_hooked: dict = {}


class _Sole:
    """One parameter of a captured layer: proves, pass by pass, that its gradient is
    exactly the layer's own contribution (see the module docstring)."""

    def __init__(self, param: torch.Tensor, cap: Capture):
        self.param, self.cap = param, cap
        self.node = None  # the parameter's gradient accumulator, held so it stays the same
        self.handle = None
        self.pending = None  # the tensor the layer's alias sent in this pass
        self.version = 0

    def alias(self) -> torch.Tensor:
        """A view of the parameter for one forward call, its gradient noted on the way."""
        a = self.param.view_as(self.param)
        node = a.grad_fn.next_functions[0][0]  # the parameter's gradient accumulator
        if node is not self.node:  # first use, or autograd made a new accumulator
            self.remove()
            self.node, self.handle = node, node.register_prehook(self._received)
        a.grad_fn.register_hook(self._sent)
        self.cap.expected += 1
        return a

    def _sent(self, grad_inputs, grad_outputs) -> None:
        g = grad_inputs[0]
        self.pending, self.version = g, (g._version if g is not None else 0)

    def _received(self, grads) -> None:
        g, mine = grads[0], self.pending
        self.pending = None  # never keep it past here: autograd may then reuse it as .grad
        if mine is not None and g is mine and g._version == self.version:
            self.cap.sole += 1
        else:
            self.cap.foreign += 1

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.node = self.handle = self.pending = None


class FactorCapture:
    """Hooks on the ``nn.Linear`` layers among ``modules`` whose weights ``param_ids`` holds.

    Args:
        modules: ``(name, module)`` pairs, each module once: a model's ``named_modules()``,
            or the modules seen running forward (:mod:`cgx.torch.factor_discovery`). A
            parameter registered in more than one of them is shared.
        param_ids: ids of the parameters the optimizer owns (only their layers are captured).
        names: id(weight) -> the name its layer goes by (default: ``"<module>.weight"``).

    Attributes:
        captures: id(weight) -> :class:`Capture`, per captured layer.
        shared: names of the layers left out because their weight or bias is registered
            in more than one module.
    """

    def __init__(self, modules, param_ids: set, names: Optional[dict] = None):
        modules = list(modules)
        self.captures: dict[int, Capture] = {}  # id(weight) -> Capture
        self.shared: list[str] = []
        self._hooks: list = []
        self._soles: list[_Sole] = []
        owners = collections.Counter(id(p) for _, m in modules for _, p in
                                     m.named_parameters(recurse=False, remove_duplicate=False))
        for name, m in modules:
            if type(m) is not torch.nn.Linear or id(m.weight) not in param_ids:
                continue
            name = (names or {}).get(id(m.weight)) or (f"{name}.weight" if name else "weight")
            if owners[id(m.weight)] > 1 or (m.bias is not None and owners[id(m.bias)] > 1):
                self.shared.append(name)
                continue
            self._hook(m, Capture(name, m))

    def _hook(self, m: torch.nn.Linear, cap: Capture) -> None:
        old = _hooked.get(id(m))
        owner = old[1]() if old is not None and old[0]() is m else None
        if owner is not None and owner is not self:
            owner.remove()  # another optimizer's capture had this layer
        _hooked[id(m)] = (weakref.ref(m), weakref.ref(self))
        self.captures[id(m.weight)] = cap
        weight = _Sole(m.weight, cap)
        bias = _Sole(m.bias, cap) if m.bias is not None else None
        self._soles += [s for s in (weight, bias) if s is not None]
        self._hooks.append(m.register_forward_pre_hook(_before(cap, weight, bias)))
        # First among the forward hooks, and also when forward raises: the parameters
        # read as themselves again before any other hook runs.
        self._hooks.append(m.register_forward_hook(_after(cap), prepend=True,
                                                   with_kwargs=True, always_call=True))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for s in self._soles:
            s.remove()
        self._soles = []
        for key, (_, owner) in list(_hooked.items()):
            if owner() in (self, None):
                del _hooked[key]

    def clear(self) -> None:
        for cap in self.captures.values():
            cap.clear()
        for s in self._soles:
            s.pending = None


def _before(cap: Capture, weight: _Sole, bias):
    def hook(module, args):
        if not (module.training and torch.is_grad_enabled() and module.weight is weight.param
                and weight.param.requires_grad) or "weight" in vars(module):
            return
        # Instance attributes win over the parameters: the layer's forward reads the aliases.
        vars(module)["weight"] = weight.alias()
        if bias is not None and module.bias is bias.param and bias.param.requires_grad:
            vars(module)["bias"] = bias.alias()
        cap.forwards += 1
    return hook


def _after(cap: Capture):
    def hook(module, args, kwargs, output):
        aliased = vars(module).pop("weight", None) is not None
        vars(module).pop("bias", None)
        x = args[0] if args else kwargs.get("input")
        if not (aliased and isinstance(output, torch.Tensor) and output.requires_grad
                and isinstance(x, torch.Tensor)):
            return
        # A pre-hook on the node that made the output, not a hook on the output tensor:
        # it runs after every tensor hook (so it sees the gradient the layer's backward
        # gets), and an in-place op on the output (ReLU(inplace=True)) leaves it in place.
        node, at, version = output.grad_fn, output.output_nr, x._version

        def record(grads):
            dy = grads[at]
            if dy is not None and x._version == version:
                cap.blocks.append(_block(dy, x))
        node.register_prehook(record)
    return hook


def _block(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[dy | x]`` as one float32 K x (M + N) block (a copy: later writes cannot reach it)."""
    m, n = dy.shape[-1], x.shape[-1]
    block = torch.empty(dy.numel() // m, m + n, dtype=torch.float32, device=dy.device)
    return torch.cat((dy.detach().reshape(-1, m), x.detach().reshape(-1, n)), 1, out=block)
