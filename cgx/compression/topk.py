"""Top-k sparsification: send the k largest-magnitude values and their positions.

``k = max(1, ceil(density * numel))`` (0 for an empty tensor). The product is
rounded to 9 decimals before the ceiling so that, say, density 0.07 of 100
values keeps 7 and not 8 (in binary floating point 0.07 * 100 is
7.000000000000001). k depends only on ``numel`` and ``density``, so every rank
sends the same number of bytes and the allgather is equal-size.

Payload layout (one flat uint8 tensor, native byte order, no header)::

    bytes [0, k*I)              k indices into the flattened tensor:
                                int64 (I = 8) for float64 tensors or numel >= 2**31,
                                else int32 (I = 4)
    bytes [k*I, k*I + k*V)      the k values, in the tensor's dtype (V bytes each)

    size = k * (I + V) bytes    float32, density 0.01: 8 bytes per kept value, 50x smaller

Indices come first so both arrays start aligned and are read as zero-copy
views. Their order is whatever ``torch.topk(sorted=False)`` returns; receivers
do not rely on it.

Reduction (:meth:`TopKCompressor.allreduce`): allgather the W payloads, then
``out.index_add_(indices_r, values_r)`` for r in rank order into a float32
accumulator (divided by W for AVERAGE). The result is the mean of the W
sparsified tensors up to float32 rounding, bit-identical on every rank; its
distance to the dense mean is what each rank dropped. Top-k is biased: use it
with error feedback (``Compression.topk`` turns it on by default).

Non-finite policy: NaN and +-inf rank above every finite magnitude (NaN is
scored as +inf), so when a tensor holds any non-finite value at least one of
them is sent (all of them when there are at most k) and the reduced output is
non-finite: never a finite wrong value.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from cgx.compression.base import Compressor, Family, check_float_tensor, check_name

_INF = float("inf")


class TopKContext(NamedTuple):
    """What decompress needs besides the payload."""

    shape: torch.Size
    dtype: torch.dtype
    numel: int
    k: int
    index_dtype: torch.dtype


def check_density(density) -> float:
    if isinstance(density, bool) or not isinstance(density, numbers.Real) \
            or not math.isfinite(density) or not 0.0 < density <= 1.0:
        raise ValueError(f"density={density!r} is out of range; expected a fraction with "
                         "0 < density <= 1 (e.g. 0.01 keeps the largest 1% of each tensor)")
    return float(density)


def index_dtype_for(numel: int, dtype: torch.dtype) -> torch.dtype:
    """int32 indices unless the tensor needs int64 (huge, or float64 values for alignment)."""
    if numel >= 2**31 or dtype.itemsize == 8:
        return torch.int64
    return torch.int32


class TopKCompressor(Compressor):
    """Keep the ``k = max(1, ceil(density * numel))`` largest magnitudes of each tensor.

    Args:
        density: fraction of values kept, ``0 < density <= 1``.

    Attributes:
        densities: per-tensor overrides, by name (``cgx.policy.levels`` sets them; a
            tensor not in it keeps ``density``).

    Example::

        comp = TopKCompressor(density=0.01)
        payload, ctx = comp.compress(grad)
        sparse = comp.decompress(payload, ctx)    # zeros except the top 1%
    """

    family = Family.TOPK
    summable = False

    def __init__(self, density: float = 0.01):
        self.density = check_density(density)
        self.densities: dict = {}

    def density_of(self, name=None) -> float:
        """The density of tensor ``name`` (its override, else ``density``)."""
        return self.densities.get(name, self.density) if name is not None else self.density

    def num_selected(self, numel: int, name=None) -> int:
        """k for a tensor of ``numel`` values (named ``name``: its own density, if set)."""
        if numel == 0:
            return 0
        return min(numel, max(1, math.ceil(round(self.density_of(name) * numel, 9))))

    def payload_nbytes(self, numel: int, dtype: torch.dtype = torch.float32, name=None) -> int:
        """Bytes of the payload of a tensor of ``numel`` values of ``dtype``."""
        k = self.num_selected(numel, name)
        return k * (index_dtype_for(numel, dtype).itemsize + dtype.itemsize)

    @staticmethod
    def split(payload: torch.Tensor, ctx: TopKContext):
        """``(indices, values)`` views of a payload (see the module docstring's layout)."""
        k = ctx.k
        index_bytes = k * ctx.index_dtype.itemsize
        indices = payload[:index_bytes].view(ctx.index_dtype)
        values = payload[index_bytes:].view(ctx.dtype)
        if values.numel() != k:
            raise ValueError(f"top-k payload has {payload.numel()} bytes, expected room for "
                             f"{k} indices and values: sender and receiver disagree on the "
                             "tensor or the density")
        return indices, values

    def compress(self, tensor, name=None):
        check_float_tensor(tensor, type(self).__name__)
        check_name(name)
        flat = tensor.reshape(-1)
        numel = flat.numel()
        k = self.num_selected(numel, name)
        ctx = TopKContext(tensor.shape, tensor.dtype, numel, k,
                          index_dtype_for(numel, tensor.dtype))
        score = flat.abs().nan_to_num_(nan=_INF, posinf=_INF)  # non-finite values win
        indices = torch.topk(score, k, sorted=False).indices
        payload = torch.empty(self.payload_nbytes(numel, tensor.dtype, name), dtype=torch.uint8,
                              device=tensor.device)
        idx_view, val_view = self.split(payload, ctx)
        idx_view.copy_(indices)
        torch.index_select(flat, 0, indices, out=val_view)
        return payload, ctx

    def decompress(self, payload, ctx: TopKContext):
        indices, values = self.split(payload, ctx)
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=payload.device)
        out.index_copy_(0, indices.long(), values)
        return out.view(ctx.shape)

    def accumulate(self, payload, ctx: TopKContext, out):
        # The scatter-add of one rank's (indices, values): O(k), not O(numel).
        indices, values = self.split(payload, ctx)
        out.index_add_(0, indices.long(), values.to(out.dtype))

    config_type = "topk"

    def to_config(self) -> dict:
        return {"density": self.density}

    def __repr__(self) -> str:
        return f"TopKCompressor(density={self.density})"
