"""Deprecated import path: the quantizing compressor is :mod:`cgx.compression.quantize`
(kept one release)."""

from cgx.compression.quantize import *  # noqa: F401,F403
