"""Max-min bucket quantization as a compressor (CGX's scheme).

The encoding is :mod:`cgx.quant.codec` (wire format v1): per bucket
of ``bucket_size`` values one float32 (unit, min) pair, then ``bits``-bit codes.

Payload: a uint8 segment of ``wire.packed_nbytes(numel, bits, bucket_size)`` =
``8 * ceil(numel / bucket_size) + bits * ceil(numel / 8)`` bytes, rounded up to
a multiple of 8 (4 bits, bucket 1024: about 7.9x smaller than float32).

Stochastic rounding draws its noise from a counter-based hash keyed by
``wire.noise_key(seed, step, tensor_id, stage)``: ``step`` counts this name's
compressions, ``tensor_id`` is a CRC-32 of the name (stable across processes),
and ``stage`` is the rank inside :meth:`QuantizeCompressor.allreduce`, so each
rank's rounding noise is independent of the others' (errors average out over
ranks instead of adding up coherently) yet reproducible.

Error per value: ``< unit`` (stochastic, unbiased) or ``<= unit / 2``
(nearest), ``unit = (max - min) / (2**bits - 1)`` of its bucket. The
allreduce here gathers every rank's segment and sums the decoded values (one
quantization per value); the SRA collective in ``cgx.collectives`` replaces
it for large buffers.

Rotation (``rotate=True``): a randomized Hadamard transform of each bucket
before quantization, undone after decoding (``cgx.quant.wire``, "Rotation"),
keyed by ``wire.rotation_key(seed, step, tensor_id)``: the same on every rank,
so every rank's payload of a tensor is rotated alike. It spreads a bucket's
outliers over the bucket, so the unit (hence the error) shrinks where a few
large values set the range; the payload size is unchanged.

Non-finite policy: a bucket holding an inf or NaN encodes (unit, min) = NaN
(wire format), so its whole bucket decodes to NaN: a non-finite gradient
never turns into a finite wrong value.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, Optional

import torch

from cgx.comm.base import Transport
from cgx.quant import wire
from cgx.compression.base import (Compressor, Family, STATE_FORMAT, check_float_tensor,
                                  check_name, check_state, stable_tensor_id)
from cgx.quant.codec import FLOAT_DTYPES, QuantSpec, dequantize, quantize
from cgx.config import MAX_BITS, MIN_BITS, Rounding, validate_bucket_size
from cgx.errors import ConfigError


class QuantizeContext(NamedTuple):
    """What decompress needs besides the segment."""

    shape: torch.Size
    dtype: torch.dtype
    numel: int
    spec: QuantSpec
    rotation_key: int = 0


def parse_rounding(rounding) -> Rounding:
    """A :class:`cgx.config.Rounding` from the enum or its name (case-insensitive)."""
    if isinstance(rounding, Rounding):
        return rounding
    allowed = ", ".join(repr(m.value) for m in Rounding)
    if isinstance(rounding, str):
        try:
            return Rounding(rounding.strip().lower())
        except ValueError:
            pass
    raise ValueError(f"rounding={rounding!r} is not known; expected one of {allowed} "
                     "(or a cgx.Rounding)")


class QuantizeCompressor(Compressor):
    """Uniform max-min quantization in buckets (stateful: a step counter per name).

    Args:
        bits: bits per value, 1..8.
        bucket_size: values sharing one (unit, min) pair; a multiple of 8.
        rounding: ``Rounding.STOCHASTIC`` (unbiased) or ``Rounding.NEAREST``, or their names.
        seed: stochastic-rounding (and rotation) seed, the same on every rank.
        rotate: rotate each bucket (randomized Hadamard) before quantizing; helps at
            2-4 bits on gradients with outliers, costs a transform each way.

    Example::

        comp = QuantizeCompressor(bits=4, bucket_size=512)
        payload, ctx = comp.compress(grad, name="fc.weight")
        approx = comp.decompress(payload, ctx)
    """

    family = Family.QUANTIZE
    summable = False

    def __init__(self, bits: int = 4, bucket_size: int = 1024,
                 rounding: Rounding | str = Rounding.STOCHASTIC, seed: int = 0,
                 rotate: bool = False):
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits={bits!r} is not supported; expected an int in "
                             f"[{MIN_BITS}, {MAX_BITS}] (use Compression.none or "
                             "Compression.fp16 for no quantization)")
        try:
            validate_bucket_size(bucket_size)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
                or not 0 <= seed < 2**64:
            raise ValueError(f"seed={seed!r} must be an int in [0, 2**64), the same on every rank")
        if not isinstance(rotate, bool):
            raise ValueError(f"rotate={rotate!r} must be True or False")
        self.spec = QuantSpec(bits=bits, bucket_size=bucket_size,
                              rounding=parse_rounding(rounding), rotate=rotate)
        self.seed = int(seed)
        self._steps: dict[Optional[str], int] = {}

    @property
    def bits(self) -> int:
        return self.spec.bits

    @property
    def bucket_size(self) -> int:
        return self.spec.bucket_size

    @property
    def rounding(self) -> Rounding:
        return self.spec.rounding

    @property
    def rotate(self) -> bool:
        return self.spec.rotate

    def payload_nbytes(self, numel: int) -> int:
        """Bytes of the payload of a tensor of ``numel`` values."""
        return self.spec.nbytes(numel)

    def _encode(self, tensor: torch.Tensor, name: Optional[str], stage: int):
        check_float_tensor(tensor, type(self).__name__)
        check_name(name)
        step = self._steps.get(name, 0)
        tensor_id = stable_tensor_id(name)
        key = wire.noise_key(self.seed, step, tensor_id, stage)
        rotation_key = wire.rotation_key(self.seed, step, tensor_id) if self.rotate else 0
        flat = tensor.reshape(-1)
        if flat.dtype not in FLOAT_DTYPES:  # float64: the wire carries float32 anyway
            flat = flat.to(torch.float32)
        payload = quantize(flat.contiguous(), self.spec, key=key, rotation_key=rotation_key)
        self._steps[name] = step + 1
        return payload, QuantizeContext(tensor.shape, tensor.dtype, tensor.numel(), self.spec,
                                        rotation_key)

    def compress(self, tensor, name=None):
        return self._encode(tensor, name, stage=0)

    def compress_for_reduction(self, tensor, transport: Transport, name=None):
        return self._encode(tensor, name, stage=transport.rank)

    def decompress(self, payload, ctx: QuantizeContext):
        dtype = ctx.dtype if ctx.dtype in FLOAT_DTYPES else torch.float32
        out = dequantize(payload, ctx.numel, ctx.spec, dtype=dtype, rotation_key=ctx.rotation_key)
        return out.to(ctx.dtype).view(ctx.shape)

    def accumulate(self, payload, ctx: QuantizeContext, out):
        # Fused decode-and-add into the float32 accumulator: no temporary tensor.
        if out.dtype == torch.float32:
            dequantize(payload, ctx.numel, ctx.spec, out=out, accumulate=True,
                       rotation_key=ctx.rotation_key)
        else:
            super().accumulate(payload, ctx, out)

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "kind": self.family.value, "steps": dict(self._steps)}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self.family.value, type(self).__name__)
        self._steps = {name: int(step) for name, step in state["steps"].items()}

    def reset(self, *names: Optional[str]) -> None:
        if not names:
            self._steps.clear()
        for name in names:
            self._steps.pop(name, None)

    config_type = "quantize"

    def to_config(self) -> dict:
        return {"bits": self.bits, "bucket_size": self.bucket_size,
                "rounding": self.rounding.value, "seed": self.seed, "rotate": self.rotate}

    def __repr__(self) -> str:
        return (f"QuantizeCompressor(bits={self.bits}, bucket_size={self.bucket_size}, "
                f"rounding={self.rounding.value!r}, seed={self.seed}"
                + (", rotate=True)" if self.rotate else ")"))
