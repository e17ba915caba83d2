"""Cast compressors: ``none``, ``fp16``, ``bf16``.

``NoneCompressor`` and ``FP16Compressor`` are drop-in replacements for
Horovod's ``Compression.none`` / ``Compression.fp16``, including the
class-level calls ``Compression.fp16.compress(t)`` (see
:class:`cgx.compression.base.default_instance_method`). Non-float tensors pass
through unchanged, as in Horovod, so integer counters can share the same
``compression=`` setting.

Predivide. A summed fp16 payload overflows as soon as the *sum* of the ranks'
values passes 65504, even when every single value fits. So inside
:meth:`~cgx.compression.base.Compressor.allreduce` each rank divides by a
factor ``f`` before the cast and the result is multiplied back by ``f`` after
the sum::

    payload_r = cast(x_r / f)            f = world size W by default (predivide=None)
    out       = f * sum_r payload_r      SUM
    out       = (f / W) * sum_r payload_r    AVERAGE (f = W: the sum is just cast back)

The factor is applied in float32, so a half-precision AVERAGE is never scaled
up to the full sum on the way (it could overflow there).

With ``f = W``, ``|sum_r x_r / W| <= max_r |x_r|``: the reduction overflows
only if one rank's value alone would. The price is at the small end: values
below ``2**-14 * f`` become fp16 subnormals (fewer significant bits) and values
below ``2**-25 * f`` flush to zero; for gradients, which are averaged anyway,
that is the cheaper side to lose. A user ``predivide`` picks another point
(``1`` reproduces Horovod exactly; ``sqrt(W)`` splits the risk). bf16 has
float32's range, so for bf16 the predivide only matters near float32's
maximum; it is kept for symmetry. Plain :meth:`compress` (no world known) uses
``predivide`` if given, else 1.

Error (AVERAGE over W ranks, unit roundoff u = 2**-11 for fp16, 2**-8 for bf16):
each value is rounded once, and each of the W - 1 additions on the wire rounds
the partial sum, so ``|out - mean| <= W * u * max_r |x_r|`` plus the subnormal
floor above.

Non-finite policy: a cast keeps inf as inf and NaN as NaN, and the sum
propagates them. A finite value beyond the wire type's range (after the
predivide) becomes inf: wrong, but visibly so (loss scalers and finiteness
checks see it), never a finite wrong value.

All arithmetic on half types is done in float32 (``x / f``, ``f * sum``), so
nothing here relies on half-precision CPU kernels.
"""

from __future__ import annotations

import math
import numbers
from typing import ClassVar, NamedTuple, Optional

import torch

from cgx.comm.base import ReduceOp
from cgx.compression.base import (Compressor, Family, accumulate_dtype, check_name,
                                  check_tensor, default_instance_method, divide_)


class CastContext(NamedTuple):
    """ctx of a predivided payload: the original dtype and the factor to multiply back.

    Without a predivide factor the ctx is just the original ``torch.dtype``, as
    Horovod's compressors return it.
    """

    dtype: torch.dtype
    scale: float = 1.0


def _check_predivide(predivide) -> Optional[float]:
    if predivide is None:
        return None
    if isinstance(predivide, bool) or not isinstance(predivide, numbers.Real) \
            or not math.isfinite(predivide) or predivide <= 0:
        raise ValueError(f"predivide must be a finite number > 0 (or None for the world size), "
                         f"got {predivide!r}; e.g. predivide=8 divides by 8 before the cast")
    return float(predivide)


def _decode(payload: torch.Tensor, ctx, divisor: int) -> torch.Tensor:
    """``payload * scale / divisor`` in the original dtype (float math in float32 or wider)."""
    if isinstance(ctx, torch.dtype):
        ctx = CastContext(ctx, 1.0)
    dtype, scale = ctx
    if not dtype.is_floating_point:  # passed through uncompressed
        return payload if divisor == 1 else divide_(payload, divisor)
    factor = scale / divisor
    if factor == 1.0:
        return payload.to(dtype)
    return (payload.to(accumulate_dtype(dtype)) * factor).to(dtype)


class _CastCompressor(Compressor):
    """Shared body of the cast compressors: payload = ``tensor / f`` cast to ``wire_dtype``."""

    summable = True
    wire_dtype: ClassVar[Optional[torch.dtype]] = None  # None: no cast (Compression.none)

    def __init__(self, predivide: Optional[float] = None):
        self.predivide = _check_predivide(predivide)

    def _encode(self, tensor: torch.Tensor, factor: float, copy: bool):
        # ctx is the bare dtype, exactly Horovod's, unless a predivide factor must travel with it.
        if self.wire_dtype is None or not tensor.is_floating_point():
            return (tensor.clone() if copy else tensor), tensor.dtype
        if factor == 1.0:
            return tensor.to(self.wire_dtype, copy=copy), tensor.dtype
        scaled = tensor.to(accumulate_dtype(tensor.dtype)) / factor  # float32 math, new memory
        return scaled.to(self.wire_dtype), CastContext(tensor.dtype, factor)

    @default_instance_method
    def compress(self, tensor, name=None):
        """Horovod's ``compress``: ``(tensor cast to the wire type, ctx)``; identity for
        non-float tensors. Divides by ``predivide`` first when one was given."""
        check_tensor(tensor, f"{type(self).__name__}.compress")
        check_name(name)
        return self._encode(tensor, self.predivide or 1.0, copy=False)

    @default_instance_method
    def compress_for_reduction(self, tensor, transport, name=None):
        factor = self.predivide if self.predivide is not None else float(transport.size)
        return self._encode(tensor, factor, copy=True)

    @default_instance_method
    def decompress(self, payload, ctx):
        """Horovod's ``decompress``: back to the original dtype (times the predivide factor).

        ``ctx`` is the original ``torch.dtype`` (as in Horovod) or a :class:`CastContext`.
        """
        return _decode(payload, ctx, 1)

    def reduce_payload(self, payload, ctx, transport, like, op=ReduceOp.AVERAGE):
        # One allreduce of the payload; AVERAGE's 1/W is folded into the decode factor,
        # so a half-precision result is never scaled up to the sum first (it could overflow).
        transport.allreduce(payload, ReduceOp.SUM if op is ReduceOp.AVERAGE else op)
        return _decode(payload, ctx, transport.size if op is ReduceOp.AVERAGE else 1)

    @default_instance_method
    def allreduce(self, tensor, transport, name=None, op=ReduceOp.AVERAGE):
        """:meth:`Compressor.allreduce`, also callable on the class."""
        return Compressor.allreduce(self, tensor, transport, name, op)

    def to_config(self) -> dict:
        return {} if self.predivide is None else {"predivide": self.predivide}

    def __repr__(self) -> str:
        if self.wire_dtype is None:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}(predivide={self.predivide!r})"


class NoneCompressor(_CastCompressor):
    """No compression: the payload is the tensor itself (Horovod's ``Compression.none``).

    The only compressor that reduces with every ReduceOp (MIN, MAX, PRODUCT too).

    Example::

        payload, ctx = NoneCompressor.compress(t)   # payload is t
    """

    config_type = "none"
    family = Family.EXACT
    wire_dtype = None

    def __init__(self):
        super().__init__(None)


class ExactCompressor(NoneCompressor):
    """No compression, also where ``Compression.none`` would let the environment decide.

    ``DistributedOptimizer(compression=Compression.none)`` (Horovod's default)
    quantizes gradients as the ``CGX_*`` variables say; pass
    ``Compression.exact`` to send them exactly, whatever the environment says.
    Everywhere else it behaves like :class:`NoneCompressor`.
    """

    config_type = "exact"


class FP16Compressor(_CastCompressor):
    """float16 on the wire, half the bytes of float32 (Horovod's ``Compression.fp16``).

    Args:
        predivide: factor dividing values before the cast (see module docstring);
            None: the world size inside ``allreduce``, 1 in plain ``compress``.

    Payload: ``numel * 2`` bytes, summable.

    Example::

        payload, ctx = FP16Compressor.compress(grad)         # Horovod style
        grad = FP16Compressor(predivide=4).allreduce(grad, transport)
    """

    config_type = "fp16"
    family = Family.FP16
    wire_dtype = torch.float16


class BF16Compressor(_CastCompressor):
    """bfloat16 on the wire: float32's range, 8 significant bits.

    Args:
        predivide: as :class:`FP16Compressor`.

    Payload: ``numel * 2`` bytes, summable.
    """

    config_type = "bf16"
    family = Family.BF16
    wire_dtype = torch.bfloat16
