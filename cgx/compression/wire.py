"""Deprecated import path: the wire format is :mod:`cgx.quant.wire` (kept one release)."""

from cgx.quant.wire import *  # noqa: F401,F403
