"""Fused C CPU path of quantization (``cgx._cquant``), loaded with ctypes."""


def available() -> bool:
    """True when the C extension is built and loadable."""
    return False
