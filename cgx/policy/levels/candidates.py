"""Candidate compression levels per layer, with their exact wire sizes.

The families (and exact float32 for layers where nothing else fits):

- quantization: bits x bucket size (the reducer's max-min quantizer, SRA);
- top-k: densities (``TopKCompressor``: indices and values, one allgather);
- PowerSGD: ranks of the low-rank factors (matrices only, where ``r (n + m) < n m``);
- 16-bit casts: float16 or bfloat16 on the wire (what DDP's fp16/bf16 hooks send), one
  level each; offered by default to the deciding mode (``objective="time"``);
- a registered summable family of the user's (``configs.register`` of a compressor class
  with ``auto_levels``): named by its ``config_type``, its levels its own, reduced by one
  allreduce of its payloads like a cast (no residuals).

A candidate's cost is what one rank sends per step (:meth:`Candidate.traffic`):
the compressor's own payload size times its collective's traffic factor (an
allreduce sends ``2 (W - 1) / W`` of its buffer, an allgather ``W - 1``
times it), so families that reduce differently compare fairly.

Which families auto offers (:func:`offered_families`) and the uniform default the error
budget is measured against (:func:`default_candidate`) are decided here too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

from cgx.compression import configs
from cgx.compression.auto_policy import AutoCompression
from cgx.compression.base import Family
from cgx.quant.codec import QuantSpec
from cgx.config import Config, Rounding

DEFAULT_BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_BUCKETS = (128, 512, 1024, 4096)
DEFAULT_DENSITIES = (0.001, 0.004, 0.01, 0.04)
DEFAULT_RANKS = (1, 2, 4, 8, 16)


CASTS = (Family.FP16, Family.BF16)  # the 16-bit cast families (one level each)
# The families a layer may be given besides exact (a user's summable compressor is not one).
CHOOSABLE = (Family.QUANTIZE, Family.TOPK, Family.POWERSGD) + CASTS


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compression level of one family.

    Attributes:
        family: :class:`Family`.
        bits, bucket_size: the quantization level (QUANTIZE only).
        density: the fraction kept (TOPK only).
        rank: the factors' columns (POWERSGD only).
        custom: a registered family's ``config_type`` (family SUMMABLE), else "".
        params: that family's constructor arguments at this level, as sorted pairs.
    """

    family: Family
    bits: int = 0
    bucket_size: int = 0
    density: float = 0.0
    rank: int = 0
    custom: str = ""
    params: tuple = ()

    @classmethod
    def of(cls, name: str, **params) -> "Candidate":
        """A level of the registered family ``name`` (its constructor arguments)."""
        return cls(Family.SUMMABLE, custom=name, params=tuple(sorted(params.items())))

    def compressor(self):
        """A registered family's compressor at this level (see :meth:`of`), made once per
        level: summable families keep no state, so the schedule and the exchange share it."""
        cls = configs.offered(self.custom)
        if cls is None:
            raise ValueError(f"compression family {self.custom!r} is not registered with "
                             "levels (cgx.compression.configs.register, auto_levels)")
        return _compressor(cls, self.params)

    @property
    def family_name(self) -> str:
        """The family's name: a registered family's ``config_type``, else the enum's."""
        return self.custom or self.family.value

    def spec(self, rounding: Rounding) -> "QuantSpec | None":
        """The reducer's per-tensor spec (None: not quantized)."""
        if self.family is not Family.QUANTIZE:
            return None
        return QuantSpec(self.bits, self.bucket_size, rounding)

    def wire_bytes(self, shape) -> int:
        """Bytes of this layer's compressed payload (float32 gradients): the compressor's
        own formula. ``shape`` may be a value count for the families that need no shape."""
        numel = shape if isinstance(shape, int) else math.prod(shape)
        if self.family is Family.EXACT:
            return 4 * numel
        if self.family in CASTS:
            return 2 * numel
        if self.family is Family.QUANTIZE:
            return QuantSpec(self.bits, self.bucket_size).nbytes(numel)
        if self.family is Family.TOPK:
            from cgx.compression.topk import TopKCompressor
            return TopKCompressor(self.density).payload_nbytes(numel)
        if self.custom:
            return int(self.compressor().payload_nbytes(numel))
        if isinstance(shape, int):
            raise ValueError("a PowerSGD candidate's size needs the tensor's shape")
        from cgx.compression.powersgd import PowerSGDCompressor
        return 4 * PowerSGDCompressor(self.rank, min_compression_rate=0.0).payload_numel(shape)

    def traffic(self, shape, world: int) -> float:
        """Bytes one rank sends per step with ``world`` ranks (at least 2 assumed)."""
        return traffic_factor(self.family, world) * self.wire_bytes(shape)

    @property
    def label(self) -> str:
        if self.family is Family.EXACT:
            return "exact"
        if self.family is Family.TOPK:
            return f"top {100 * self.density:g}%"
        if self.family is Family.POWERSGD:
            return f"rank {self.rank}"
        if self.family in CASTS:
            return self.family.value
        if self.custom:
            return self.custom + "(" + ", ".join(f"{k}={v}" for k, v in self.params) + ")"
        return f"{self.bits}-bit/{self.bucket_size}"

    def as_list(self) -> list:
        """JSON-able: ``[family, bits, bucket_size, density, rank]``, and for a registered
        family ``[..., custom, params]``."""
        out = [self.family.value, self.bits, self.bucket_size, self.density, self.rank]
        return out + [self.custom, [list(p) for p in self.params]] if self.custom else out

    @classmethod
    def from_list(cls, v: Sequence) -> "Candidate":
        """The inverse of :meth:`as_list` (a 3-long quantization entry of older states too)."""
        v = list(v) + [0.0, 0] * (len(v) == 3)
        custom, params = (str(v[5]), tuple(tuple(p) for p in v[6])) if len(v) > 5 else ("", ())
        return cls(Family(v[0]), int(v[1]), int(v[2]), float(v[3]), int(v[4]), custom, params)


@functools.lru_cache(maxsize=None)
def _compressor(cls: type, params: tuple):
    """One compressor per class and level (keyed by the class: a family registered anew
    under the same name gets compressors of its new class)."""
    return cls(**dict(params))


def _family(f) -> "Family | str | None":
    """A family name -> its :class:`Family`, a registered family's name, or None."""
    if isinstance(f, Family):
        return f
    if configs.offered(str(f)) is not None:
        return str(f)
    try:
        return Family(str(f).strip().lower())
    except ValueError:
        return None


def parse_families(families) -> tuple:
    """Family names (or :class:`Family` members) -> a tuple of :class:`Family` members and
    registered families' names; errors name the allowed values."""
    if isinstance(families, (str, Family)):
        families = (families,)
    out = []
    for f in families:
        fam = _family(f)
        if fam not in CHOOSABLE and not isinstance(fam, str):
            allowed = ", ".join([m.value for m in CHOOSABLE] + list(configs.offered_names()))
            raise ValueError(f"unknown compressor family {f!r}; expected one of: {allowed}")
        out.append(fam)
    if not out:
        raise ValueError("families is empty; name at least one family, e.g. ('quantize',)")
    return tuple(dict.fromkeys(out))


def candidates_for(shape: Sequence[int], families: Sequence[Family],
                   bits: Sequence[int] = DEFAULT_BITS,
                   buckets: Sequence[int] = DEFAULT_BUCKETS,
                   densities: Sequence[float] = DEFAULT_DENSITIES,
                   ranks: Sequence[int] = DEFAULT_RANKS) -> list[Candidate]:
    """The candidate levels of a layer of ``shape`` (exact always included, first).

    Levels that cannot pay off are left out: bucket sizes far beyond the layer,
    top-k densities keeping everything, PowerSGD ranks whose factors are no
    smaller than the matrix (and PowerSGD for tensors of fewer than 2 dimensions).
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    out = [Candidate(Family.EXACT)]
    if numel == 0:
        return out
    if Family.QUANTIZE in families:
        for b in bits:
            for bucket in buckets:
                if bucket <= max(8, 2 * numel) or bucket == min(buckets):
                    out.append(Candidate(Family.QUANTIZE, int(b), int(bucket)))
    if Family.TOPK in families:
        ks = set()
        for d in densities:
            c = Candidate(Family.TOPK, density=float(d))
            k = c.wire_bytes(numel)
            if k < 4 * numel and k not in ks:
                ks.add(k)
                out.append(c)
    if Family.POWERSGD in families and len(shape) >= 2:
        n, m = shape[0], numel // shape[0]
        for r in ranks:
            if int(r) <= min(n, m) and int(r) * (n + m) < n * m:
                out.append(Candidate(Family.POWERSGD, rank=int(r)))
    out += [Candidate(f) for f in CASTS if f in families]
    for name in (f for f in families if isinstance(f, str)):  # registered families
        out += [Candidate.of(name, **kw) for kw in configs.offered(name).auto_levels(shape)]
    return out


def traffic_factor(family: Family, world: int) -> float:
    """What one rank sends per payload byte with ``world`` ranks (at least 2 assumed): an
    allgather (top-k) ``W - 1`` times it, an allreduce ``2 (W - 1) / W``."""
    w = max(2, int(world))
    return (w - 1) if family is Family.TOPK else 2 * (w - 1) / w



def offered_families(families: Sequence[str], error_feedback: bool,
                     adaptive: bool = False) -> list:
    """The families auto chooses from: ``families``, less top-k and PowerSGD when there is
    no error feedback, or the optimizer is ``adaptive``, and quantization is offered.

    Without error feedback, top-k and PowerSGD are biased: they drop the same coordinates
    or directions step after step, and nothing sends them later. A step's error does not
    show that drift (an LM under AdamW ended 3.6% above fp32's loss with them, against
    4-bit's 0.1%; docs/results/auto-accuracy.md), while quantization with stochastic
    rounding is unbiased. Their residuals are classic (all of the error, sent one step
    later), which an adaptive optimizer's second moment takes badly: with
    ``error_feedback=True`` under AdamW the project's LM ended 2.0% above fp32 with them
    against 0.5% without error feedback (docs/results/adaptive-probe.md), so under an
    adaptive optimizer they are not offered beside quantization either. Named alone
    (``families=("topk",)``), they are still offered.
    """
    fams = [_family(f) for f in families]
    if (not error_feedback or adaptive) and Family.QUANTIZE in fams:
        fams = [f for f in fams if f not in (Family.TOPK, Family.POWERSGD)]
    return fams


def reference_for(shape: Sequence[int], default: Candidate) -> Candidate:
    """The reference of a planned layer of ``shape``: the uniform ``default`` where it
    applies (PowerSGD's default does not to a matrix too small for it), else exact."""
    if default in candidates_for(shape, [default.family], [default.bits],
                                 [default.bucket_size], [default.density], [default.rank]):
        return default
    return Candidate(Family.EXACT)


def default_candidate(families, config: Config, settings: AutoCompression) -> Candidate:
    """The uniform default the error budget is measured against: the configured
    quantization (``CGX_COMPRESSION_QUANTIZATION_BITS`` / ``..._BUCKET_SIZE``,
    4 bits and 1024 by default) when quantization is a choice; else top-k at 1%
    (or the middle density offered), or PowerSGD at rank 4 (or the middle rank);
    exact when exact is the only family."""
    def middle(values, preferred):
        return preferred if preferred in values else sorted(values)[len(values) // 2]
    if Family.QUANTIZE in families:
        return Candidate(Family.QUANTIZE, config.bits if 1 <= config.bits <= 8 else 4,
                         config.bucket_size)
    if Family.TOPK in families:
        return Candidate(Family.TOPK, density=middle(settings.densities, 0.01))
    if Family.POWERSGD in families:
        return Candidate(Family.POWERSGD, rank=middle(settings.ranks, 4))
    return Candidate(Family.EXACT)
