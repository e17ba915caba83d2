"""Deprecated import path: max-min quantization is :mod:`cgx.quant.codec` (kept one release)."""

from cgx.quant.codec import *  # noqa: F401,F403
