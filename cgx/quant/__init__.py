"""Max-min bucket quantization, the encoding under cgx's compressed collectives.

- :mod:`cgx.quant.wire`: the wire format (version 1), the one source of truth for
  the layout and the stochastic-rounding noise;
- :mod:`cgx.quant.codec`: ``QuantSpec``, ``quantize``/``dequantize``, choosing the
  backend: the Triton kernels for CUDA tensors (``cgx.kernels``), the fused C
  path on CPU (:mod:`cgx.quant.cpu`), or the plain-torch reference.

Nothing here knows compressors (``cgx.compression``) or collectives: both build on it.
"""
