"""Deprecated import path: the exchange lives in :mod:`cgx.exchange` (one release)."""

from cgx.exchange import (FIRST_BUCKET_BYTES, GradientPlan, GradMode,  # noqa: F401
                          ready_order_buckets, unique_names)
from cgx.exchange.plan import STATE_FORMAT  # noqa: F401
