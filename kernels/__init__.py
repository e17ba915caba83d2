"""Triton kernels of cgx, installed as ``cgx.kernels``."""
