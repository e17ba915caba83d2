"""Candidate compression levels per layer, with their exact wire sizes."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence

from cgx.compression.quantization import QuantSpec
from cgx.config import Rounding

DEFAULT_BITS = (2, 3, 4, 5, 6, 8)
DEFAULT_BUCKETS = (128, 512, 1024, 4096)


class Family(enum.Enum):
    """Compressor families a layer may pick from."""

    EXACT = "exact"  # uncompressed float32
    QUANTIZE = "quantize"  # max-min bucket quantization (bits, bucket size)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compression level of one family.

    Attributes:
        family: :class:`Family`.
        bits, bucket_size: the quantization level (QUANTIZE only).
    """

    family: Family
    bits: int = 0
    bucket_size: int = 0

    def spec(self, rounding: Rounding) -> "QuantSpec | None":
        """The reducer's per-tensor spec (None: exact)."""
        if self.family is Family.EXACT:
            return None
        return QuantSpec(self.bits, self.bucket_size, rounding)

    def wire_bytes(self, numel: int) -> int:
        """Bytes of this layer's compressed payload: the compressor's own formula."""
        if self.family is Family.EXACT:
            return 4 * numel
        return QuantSpec(self.bits, self.bucket_size).nbytes(numel)

    @property
    def label(self) -> str:
        if self.family is Family.EXACT:
            return "exact"
        return f"{self.bits}-bit/{self.bucket_size}"


def parse_families(families) -> tuple[Family, ...]:
    """Family names (or :class:`Family` members) -> a tuple; errors name the allowed values."""
    if isinstance(families, (str, Family)):
        families = (families,)
    out = []
    for f in families:
        try:
            out.append(f if isinstance(f, Family) else Family(str(f).strip().lower()))
        except ValueError:
            allowed = ", ".join(m.value for m in Family if m is not Family.EXACT)
            raise ValueError(f"unknown compressor family {f!r}; expected one of: {allowed}") \
                from None
    if not out:
        raise ValueError("families is empty; name at least one family, e.g. ('quantize',)")
    return tuple(dict.fromkeys(out))


def candidates_for(shape: Sequence[int], families: Sequence[Family],
                   bits: Sequence[int] = DEFAULT_BITS,
                   buckets: Sequence[int] = DEFAULT_BUCKETS) -> list[Candidate]:
    """The candidate levels of a layer of ``shape`` (exact always included, first)."""
    numel = math.prod(shape)
    out = [Candidate(Family.EXACT)]
    if Family.QUANTIZE in families and numel > 0:
        for b in bits:
            for bucket in buckets:
                if bucket <= max(8, 2 * numel) or bucket == min(buckets):
                    out.append(Candidate(Family.QUANTIZE, int(b), int(bucket)))
    return out
