"""Forward/backward hooks on ``nn.Linear`` layers recording sufficient factors
(see :mod:`cgx.sufficient_factors`)."""

from __future__ import annotations

import torch

from cgx.sufficient_factors import Capture


class FactorCapture:
    """Hooks on the ``nn.Linear`` layers of ``model`` whose weights ``params`` holds.

    Args:
        model: the module to search.
        params: ids of the parameters the optimizer owns (only their layers are captured).
    """

    def __init__(self, model: torch.nn.Module, param_ids: set):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"sufficient_factors= takes the model (a torch.nn.Module), got "
                            f"{type(model).__name__}")
        self.captures: dict[int, Capture] = {}  # id(weight) -> Capture
        self._hooks = []
        for name, m in model.named_modules():
            if type(m) is torch.nn.Linear and id(m.weight) in param_ids:
                cap = Capture(f"{name}.weight" if name else "weight", m)
                self.captures[id(m.weight)] = cap
                self._hooks.append(m.register_forward_hook(self._forward_hook(cap)))

    @staticmethod
    def _forward_hook(cap: Capture):
        def hook(module, args, output):
            if module.training and torch.is_grad_enabled() and module.weight.requires_grad:
                x = args[0]
                cap.inputs.append(x.detach().reshape(-1, x.shape[-1]).to(torch.float32))
                cap.forwards += 1
                if output.requires_grad:
                    # A hook on the output tensor, not a module backward hook: the latter
                    # wraps the output in a view that an in-place ReLU may not modify.
                    # Registered before any in-place op, it sees d loss / d output.
                    output.register_hook(lambda g: cap.grads.append(
                        g.detach().reshape(-1, g.shape[-1]).to(torch.float32)))
        return hook

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def clear(self) -> None:
        for cap in self.captures.values():
            cap.clear()
