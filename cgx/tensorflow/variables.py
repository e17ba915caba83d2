"""Which of a Keras model's and optimizer's variables all ranks share, and which stay
each rank's own; and the cgx optimizer inside a wrapped one.

Keras-free (duck-typed on ``model.variables``, ``optimizer.variables`` and
``inner_optimizer``), so that ``cgx.tensorflow`` can use it without importing Keras:
the Keras callbacks, the loss-scale optimizer and elastic training read it.
"""

from __future__ import annotations

# What cgx's Keras DistributedOptimizer carries as a class attribute: an optimizer that
# exchanges its gradients over the ranks (recognized without importing its class).
MARKER = "cgx_exchanges_gradients"

# Keras' dropout/noise layers keep their RNG state in variables; broadcasting it would
# give every rank the same masks, so it stays per rank.
RNG_STATE_SUFFIX = "seed_generator_state"

# DistributedOptimizer's gradient accumulators: this rank's own partial sums.
ACCUMULATOR = "cgx_accumulator"
# ... and the count of passes they hold, which every rank must agree on (it decides
# which branch of the step runs); equal on all ranks from the start.
PENDING_PASSES = "cgx_pending_passes"


def distributed_inside(opt):
    """The cgx ``DistributedOptimizer`` that ``opt`` is or wraps (through
    ``inner_optimizer``: loss-scale optimizers), else None."""
    seen = 0
    while opt is not None and seen < 8:
        if getattr(type(opt), MARKER, False):
            return opt
        opt, seen = getattr(opt, "inner_optimizer", None), seen + 1
    return None


def _path(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", ""))


def shared_model_variables(model, local_ids=frozenset()) -> list:
    """``model.variables`` but the per-rank ones (RNG state, ids in ``local_ids``)."""
    return [v for v in model.variables
            if not _path(v).endswith(RNG_STATE_SUFFIX) and id(v) not in local_ids]


def shared_optimizer_variables(optimizer, pending: bool = False) -> list:
    """``optimizer.variables`` but the gradient accumulators, and but their pass count
    unless ``pending`` (a rank joining mid-accumulation must take the others' count)."""
    skip = (ACCUMULATOR,) if pending else (ACCUMULATOR, PENDING_PASSES)
    return [v for v in optimizer.variables if not any(k in _path(v) for k in skip)]
