"""How a quantized tensor's dropped values come back: the compensations of the fused exchange.

The fused reducer takes one float32 buffer per quantized tensor (``residuals=`` of
``Reducer.allreduce``): it adds the buffer to the tensor's values ``x`` before
quantizing, and leaves in it ``q``, what that quantization dropped (input units, see
``cgx.collectives.algorithms.ReduceContext``). A compensation decides what goes into
the buffer from what it holds (``e``), and what it holds after the call:

``ERROR_FEEDBACK`` (classic)::

    buffer = e;   e = q

  Everything dropped is sent one step later, so what is sent telescopes to the sum
  of the gradients. The sent error is ``e_prev - q``: twice the power of one
  quantization's error (``e`` enlarges the bucket's range too), and an adaptive
  optimizer's second moment takes all of it.

``MOVING_AVERAGE`` (for adaptive optimizers; LoCo, Xie et al. 2024)::

    buffer = clip(scale * e, min_b(x) - x, max_b(x) - x)
    e      = beta * e + (1 - beta) * q

  ``e`` is a moving average of the quantization errors: what is systematic in them
  (the low frequencies, a bias) is sent back in full, the step-to-step noise only
  by ``1 - beta``: with white errors (stochastic rounding) the sent error has
  ``1 + (1-beta)/(1+beta)`` times one quantization's power (1.03 at the default beta
  0.95, against 2 for classic), and an Adam-style first moment (beta1 0.9) keeps
  0.7 of the noise it keeps without compensation. The clip keeps each corrected value inside its bucket's range of
  this step's gradient (``min_b``/``max_b``), so the quantization step does not grow.
  ``e`` is then not what is owed: what the average and the clip hold back is dropped
  (:meth:`cgx.exchange.GradientPlan.residual` returns ``e``; the sum identity it
  documents holds for classic error feedback only).

Measured on the project's transformer LM under AdamW: docs/results/adaptive.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from cgx.policy.update_rule import Compensation, average_in, bucket_clamp

__all__ = ["Compensator", "MovingAverage", "bucket_clamp"]


@dataclasses.dataclass(frozen=True)
class MovingAverage:
    """Settings of :attr:`Compensation.MOVING_AVERAGE` (formulas in the module docstring).

    Attributes:
        beta: weight of the held average at each step, in [0, 1) (0: classic error
            feedback, clipped to the bucket's range).
        scale: factor on the average before it is added, > 0.
    """

    beta: float = 0.95
    scale: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"beta must be in [0, 1) (the held average's weight per step), "
                             f"got {self.beta!r}")
        if not self.scale > 0.0:
            raise ValueError(f"scale must be > 0 (the factor on the added average), got "
                             f"{self.scale!r}")


class Compensator:
    """The buffers handed to the reducer and what is kept after, per tensor name.

    Args:
        kind: the :class:`Compensation` of every tensor not in ``kinds`` (a store of an
            exchange without error feedback never asks for buffers).
        held: the store's residual table (name -> flat float32, input units), updated here.
        settings: the moving average's (default :class:`MovingAverage`).

    Attributes:
        kinds: per tensor name, a :class:`Compensation` that replaces ``kind`` (auto's
            measured choice, ``cgx.policy.levels.probe``); a tensor whose compensation is
            NONE gets no buffer.
    """

    def __init__(self, kind: Compensation, held: dict,
                 settings: Optional[MovingAverage] = None):
        self.kind = kind
        self.held = held
        self.settings = settings if settings is not None else MovingAverage()
        self.kinds: dict[str, Compensation] = {}

    def kind_of(self, name: str) -> Compensation:
        return self.kinds.get(name, self.kind)

    def compensates(self) -> bool:
        """Whether any tensor keeps a residual."""
        return self.kind is not Compensation.NONE or \
            any(k is not Compensation.NONE for k in self.kinds.values())

    def buffer(self, name: str, w: torch.Tensor, spec, predivide: float) -> Optional[torch.Tensor]:
        """The float32 buffer of ``name`` (gradient ``w``, quantized by ``spec``); None when
        its compensation is NONE."""
        kind = self.kind_of(name)
        if kind is Compensation.NONE:
            return None
        e = self.held.get(name)
        if e is None or e.numel() != w.numel() or e.device != w.device:
            e = torch.zeros(w.numel(), dtype=torch.float32, device=w.device)
            self.held[name] = e
        if kind is not Compensation.MOVING_AVERAGE:
            return e  # classic: the reducer updates the residual in place
        x = w.detach().reshape(-1).to(torch.float32)
        if predivide != 1.0:
            x = x / predivide  # input units, as the reducer sees the values
        scale = self.settings.scale
        return bucket_clamp(e * scale if scale != 1.0 else e, x, spec.bucket_size)

    def settle(self, names: Sequence[str], buffers: Sequence) -> None:
        """After the reducer: ``buffers`` hold what quantization dropped."""
        beta = self.settings.beta
        for n, b in zip(names, buffers):
            if b is None or self.kind_of(n) is not Compensation.MOVING_AVERAGE:
                continue
            self.held[n] = average_in(self.held[n], b, beta)
