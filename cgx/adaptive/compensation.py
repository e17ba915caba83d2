"""Whether ``auto`` feeds compression errors back: decided by the optimizer's update rule.

Error feedback adds what compression dropped to the next step's gradient, so
the sum of what is sent over many steps equals the sum of the gradients. An
optimizer whose update is linear in the gradient (SGD, with or without
momentum) sees exactly that sum, and error feedback helps it. An adaptive one
(Adam and its kin) divides each coordinate by a running root mean square of
its gradients, and the residual's delayed bursts inflate that normaliser and
swing single steps: the 1-bit Adam and LoCo papers report it, and we measured
it (benchmarks/adaptive.py, a transformer LM, 2 ranks, 400 AdamW steps: 2-bit
with error feedback 10% above fp32's validation loss, without 5%; moving-average
and decayed residuals in LoCo's spirit sat between the two, never below "off").

So ``Compression.auto(error_feedback=None)`` (the default) keeps residuals
under linear optimizers and not under adaptive ones; an optimizer it does not
know leaves ``CGX_COMPRESSION_ERROR_FEEDBACK`` in charge. The rule is the same
for every family: top-k and PowerSGD are biased without residuals, but under
Adam their residuals' bursts are what hurt, and each candidate's error is
measured on what it sends without them (:mod:`cgx.adaptive.stats`), so the
plan picks them only where that error fits the budget.
"""

from __future__ import annotations

import enum
from typing import Optional


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
