"""Deprecated import path: the C quantization path is :mod:`cgx.quant.cpu` (kept one release)."""

from cgx.quant.cpu import *  # noqa: F401,F403
