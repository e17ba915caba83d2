"""The gradient exchange every adapter shares: how a list of gradients travels.

- :mod:`cgx.exchange.plan`: :class:`GradientPlan` (names, shapes, step, state, the mode).
- :mod:`cgx.exchange.modes`: one object per :class:`GradMode` with its ``reduce``
  (:mod:`cgx.exchange.per_layer` for AUTO).
- :mod:`cgx.exchange.residuals`: what an exchange still owes (error feedback).
- :mod:`cgx.exchange.buckets`: fusion buckets in backward's ready order.
- :mod:`cgx.exchange.options`: the validated exchange options and tensor naming.
"""

from cgx.exchange.buckets import FIRST_BUCKET_BYTES, ready_order_buckets
from cgx.policy import GradMode
from cgx.exchange.options import ExchangeOptions, check_wrapped_once, unique_names
from cgx.exchange.plan import GradientPlan

__all__ = ["ExchangeOptions", "FIRST_BUCKET_BYTES", "GradMode", "GradientPlan",
           "check_wrapped_once", "ready_order_buckets", "unique_names"]
