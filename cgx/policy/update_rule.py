"""Whether an exchange feeds compression errors back, and how: decided by the optimizer's
update rule.

Error feedback adds what compression dropped to the next step's gradient, so
the sum of what is sent over many steps equals the sum of the gradients. An
optimizer whose update is linear in the gradient (SGD, with or without
momentum) sees exactly that sum, and classic error feedback helps it. An
adaptive one (Adam and its kin) divides each coordinate by a running root mean
square of its gradients: classic error feedback sends each step's error twice
(dropped now, added next step), so that normaliser takes twice the noise and the
steps shrink. Measured (benchmarks/adaptive.py, a transformer LM, 2 ranks, 400
AdamW steps, 2-bit): classic error feedback ends 10% above fp32's validation
loss, no error feedback 5%.

So an exchange that keeps residuals under an adaptive optimizer uses
:attr:`Compensation.MOVING_AVERAGE` (LoCo's): a moving average of the errors is
added back, clipped to the bucket's range, which returns what is systematic in
the errors and only a small share of their step-to-step noise; on that LM at
2 bits (2 seeds) it ends 0.3% above no error feedback, where classic ends 5% above
it, and at 4 bits 0.2% below (docs/results/adaptive.md). ``CGX_COMPENSATION=classic`` (or ``moving_average``)
sets one for every optimizer.

``Compression.auto(error_feedback=None)`` (the default) starts from that rule, residuals
under linear optimizers and none under adaptive ones (an optimizer it does not know
leaves ``CGX_COMPRESSION_ERROR_FEEDBACK`` in charge), and then measures, per quantized
layer, which of none, classic feedback and the moving average keeps the optimizer's
path closest (:mod:`cgx.policy.levels.probe`); each plan applies what the window before it
measured. ``error_feedback=True`` measures between the two forms that keep a residual.
For top-k and PowerSGD the rule stands: they are biased without residuals, but under Adam
their residuals' bursts are what hurt (their residuals are classic: the moving
average is the fused quantized exchange's), and each candidate's error is
measured on what it sends without them (:mod:`cgx.policy.levels.stats`), so the plan
picks them only where that error fits the budget; under an adaptive optimizer they are
offered only when quantization is not (:func:`cgx.policy.levels.candidates.offered_families`).
"""

from __future__ import annotations

import enum
from typing import Optional

import torch

from cgx.config import CompensationChoice


class Compensation(enum.Enum):
    """What a quantized tensor's exchange does with the values its compression dropped
    (the algorithms and their formulas: :mod:`cgx.exchange.compensation`)."""

    NONE = "none"  # dropped for good (stochastic rounding keeps each step unbiased)
    ERROR_FEEDBACK = "error_feedback"  # all of it added to the next step's values (classic)
    MOVING_AVERAGE = "moving_average"  # its moving average added, clipped to the bucket's range


def bucket_clamp(e: torch.Tensor, x: torch.Tensor, bucket: int) -> torch.Tensor:
    """``e`` clipped per value so that ``x + e`` stays within the ``[min, max]`` of
    ``x``'s bucket (consecutive runs of ``bucket`` values, the last one shorter); a new
    contiguous float32 tensor.

    Hidden cost: about five passes over the tensor (the bounds, two differences, the clamp).
    """
    n = x.numel()
    full = n - n % bucket
    out = torch.empty_like(e)
    if full:
        xm, em = x[:full].view(-1, bucket), e[:full].view(-1, bucket)
        lo, hi = xm.amin(1, keepdim=True), xm.amax(1, keepdim=True)
        torch.minimum(torch.maximum(em, lo - xm), hi - xm, out=out[:full].view(-1, bucket))
    if full < n:
        xt, et = x[full:], e[full:]
        out[full:] = torch.minimum(torch.maximum(et, xt.min() - xt), xt.max() - xt)
    return out


def average_in(e: torch.Tensor, q: torch.Tensor, beta: float) -> torch.Tensor:
    """The moving average's update ``e = beta e + (1 - beta) q``, in place in ``e``
    (``q`` itself when ``beta`` is 0)."""
    return e.mul_(beta).add_(q, alpha=1.0 - beta) if beta else q


class UpdateRule(enum.Enum):
    """How an optimizer turns gradients into updates (as far as compensation cares)."""

    LINEAR = "linear"  # the update is linear in the gradients: SGD (momentum, Nesterov)
    ADAPTIVE = "adaptive"  # per-coordinate normalization: Adam, AdamW, RMSprop, Adagrad, ...
    UNKNOWN = "unknown"


# Class names of torch.optim and keras.optimizers (and common third-party ones); a
# subclass takes its nearest known ancestor's rule.
_RULES = {
    "SGD": UpdateRule.LINEAR,
    **{n: UpdateRule.ADAPTIVE for n in (
        "Adam", "AdamW", "Adamax", "NAdam", "Nadam", "RAdam", "SparseAdam", "Adagrad",
        "Adadelta", "RMSprop", "Adafactor", "Lion", "Lamb", "LAMB", "FusedAdam", "FusedLamb",
        "DeepSpeedCPUAdam", "Ftrl")},
}


def update_rule_of(optimizer) -> UpdateRule:
    """The :class:`UpdateRule` of an optimizer instance (torch or Keras), by its class."""
    inner = getattr(optimizer, "inner_optimizer", None)  # Keras LossScaleOptimizer
    if inner is not None and inner is not optimizer:
        return update_rule_of(inner)
    for cls in type(optimizer).__mro__:
        rule = _RULES.get(cls.__name__)
        if rule is not None:
            return rule
    return UpdateRule.UNKNOWN


def error_feedback_for(explicit: Optional[bool], rule: UpdateRule, configured: bool) -> bool:
    """Whether auto's layers keep residuals: ``explicit`` when given, else by ``rule``
    (``configured``, the environment's setting, for an unknown optimizer)."""
    if explicit is not None:
        return bool(explicit)
    if rule is UpdateRule.LINEAR:
        return True
    if rule is UpdateRule.ADAPTIVE:
        return False
    return bool(configured)


def named_form(choice: CompensationChoice) -> Optional[Compensation]:
    """The form ``CGX_COMPENSATION`` names (None: AUTO, which names none)."""
    return {CompensationChoice.CLASSIC: Compensation.ERROR_FEEDBACK,
            CompensationChoice.MOVING_AVERAGE: Compensation.MOVING_AVERAGE}.get(choice)


def compensation_for(error_feedback: bool, rule: UpdateRule,
                     choice: CompensationChoice = CompensationChoice.AUTO) -> Compensation:
    """The :class:`Compensation` of an exchange: NONE without ``error_feedback``; else
    ``choice`` (``CGX_COMPENSATION``), which by default (AUTO) is MOVING_AVERAGE under an
    adaptive optimizer and classic ERROR_FEEDBACK under any other."""
    if not error_feedback:
        return Compensation.NONE
    named = named_form(choice)
    if named is not None:
        return named
    return Compensation.MOVING_AVERAGE if rule is UpdateRule.ADAPTIVE else \
        Compensation.ERROR_FEEDBACK
