"""Ranks agree on what a collective is before it runs, like Horovod's coordinator, cheaply.

Without a check, ranks that pass different shapes, dtypes or roots under one
name end in a transport error ("Connection reset by peer") or, worse, a silent
wrong result. Here every rank reduces a 64-bit digest of the collective's
:class:`Signature` (kind, name, op, shapes, dtypes, compression, ...) with one
16-byte MAX allreduce of ``[d, -d]``: equal digests everywhere cost nothing more.
Only when they differ do the ranks exchange the signatures themselves, and
every rank raises the same :class:`~cgx.errors.CollectiveMismatchError`
naming the collective, the fields that differ, and each rank's value.

Where the check runs: before each functional collective (allreduce,
allgather, broadcast, ...); once per step for ``DistributedOptimizer``, folded
into the step's status exchange that exists anyway (the digest covers the
whole bucket layout); once per bucket for the DDP hook; and once at
``init()`` for the settings that must match (:func:`agree_config`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Optional, Sequence

import torch

from cgx.comm.base import ReduceOp, Transport
from cgx.errors import CollectiveMismatchError, ConfigError


@dataclasses.dataclass(frozen=True)
class Signature:
    """What a collective is, as (field, value) pairs compared across ranks.

    Attributes:
        kind: "allreduce", "allgather", "broadcast", "optimizer step", ...
        name: the collective's name (the same on every rank when the code is).
        fields: ((field, printable value), ...).
    """

    kind: str
    name: str
    fields: tuple

    def digest(self) -> int:
        """62-bit digest (so that ``-d`` fits an int64)."""
        h = hashlib.blake2b(repr((self.kind, self.name, self.fields)).encode(), digest_size=8)
        return int.from_bytes(h.digest(), "little") >> 2


def signature(kind: str, name: str, **fields: Any) -> Signature:
    """A :class:`Signature` whose values are printed once (shapes as tuples, dtypes short)."""
    return Signature(kind, str(name), tuple((k, _show(v)) for k, v in fields.items()))


def tensor_fields(tensors: Sequence[torch.Tensor], skip_first_dim: bool = False) -> dict:
    """``shapes`` and ``dtypes`` of a tensor list (dim 0 left out when it may differ)."""
    shapes = [tuple(t.shape[1:]) if skip_first_dim and t.dim() else tuple(t.shape)
              for t in tensors]
    return {"shapes" if not skip_first_dim else "shapes after dim 0":
            shapes if len(shapes) != 1 else shapes[0],
            "dtypes" if len(tensors) != 1 else "dtype":
            [_show(t.dtype) for t in tensors] if len(tensors) != 1 else _show(tensors[0].dtype)}


def _show(v: Any) -> str:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, ReduceOp):
        return v.name.title()
    if isinstance(v, torch.Size):
        return str(tuple(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_show(x) for x in v) + "]" if isinstance(v, list) else \
            "(" + ", ".join(_show(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    return str(v)


def agree(transport: Transport, sig: Signature, *, recoverable: bool = True) -> None:
    """Return when every rank holds the same ``sig``; else raise on every rank.

    Args:
        transport: the group (every rank calls this at the same point).
        sig: this rank's signature.
        recoverable: False when work queued after this collective depends on it
            (the optimizer's buckets): the error then fails cgx's engine for good.

    Raises:
        CollectiveMismatchError: naming the collective, the differing fields and
            each rank's values; the same message on every rank.
    """
    if transport.size == 1:
        return
    d = sig.digest()
    t = torch.tensor([d, -d], dtype=torch.int64, device=transport.device)
    transport.allreduce(t, ReduceOp.MAX)
    hi, lo = int(t[0]), -int(t[1])
    if hi == d and lo == d:
        return
    sigs = transport.allgather_object(sig)
    raise CollectiveMismatchError(describe(sigs), recoverable=recoverable)


def describe(sigs: Sequence[Optional[Signature]]) -> str:
    """One message for every rank: which collective, which fields differ, each rank's value."""
    ranks = [r for r, s in enumerate(sigs) if s is not None]
    first = sigs[ranks[0]]
    kinds = {(s.kind, s.name) for s in sigs if s is not None}
    if len(kinds) > 1:
        where = "; ".join(f"rank {r}: {s.kind} '{s.name}'" for r, s in enumerate(sigs)
                          if s is not None)
        return (f"ranks issued different collectives at the same point ({where}); every rank "
                "must issue the same collectives, with the same names, in the same order")
    lines = []
    fields = dict(first.fields)
    for key in fields:
        values = {r: dict(sigs[r].fields).get(key) for r in ranks}
        if len(set(values.values())) > 1:
            lines.append(f"{key}: " + ", ".join(f"rank {r} has {v}" for r, v in values.items()))
    if not lines:
        # Equal signatures, unequal digests: the check's own exchange was matched with
        # another collective issued on the same group at the same time.
        return (f"ranks hold the same {first.kind} '{first.name}' (" +
                ", ".join(f"{k}={v}" for k, v in first.fields) + "), but their check "
                "received other data: another collective ran on the same process group at "
                "the same time (from another thread, or in a different order on some "
                "ranks); give cgx a process group that nothing else uses")
    return (f"ranks disagree on {first.kind} '{first.name}': " + "; ".join(lines) +
            ". Pass the same arguments on every rank")


# Config fields that decide what travels and how it is laid out: they must match.
_SHARED_CONFIG_FIELDS = ("bits", "bucket_size", "minimal_size", "rounding", "skip_1d",
                         "error_feedback", "seed", "fusion_buffer_mb", "inner_reduction",
                         "cross_reduction", "hierarchical", "pipeline_chunk_mb",
                         "check_consistency", "compression", "auto_alpha", "auto_window",
                         "auto_adjust_every", "stats_every")

_CONFIG_VARS = {"bits": "CGX_COMPRESSION_QUANTIZATION_BITS",
                "bucket_size": "CGX_COMPRESSION_BUCKET_SIZE",
                "minimal_size": "CGX_COMPRESSION_MINIMAL_SIZE",
                "rounding": "CGX_COMPRESSION_ROUNDING", "skip_1d": "CGX_COMPRESSION_SKIP_1D",
                "error_feedback": "CGX_COMPRESSION_ERROR_FEEDBACK", "seed": "CGX_SEED",
                "fusion_buffer_mb": "CGX_FUSION_BUFFER_SIZE_MB",
                "inner_reduction": "CGX_INNER_REDUCTION_TYPE",
                "cross_reduction": "CGX_CROSS_REDUCTION_TYPE",
                "hierarchical": "CGX_HIERARCHICAL", "pipeline_chunk_mb": "CGX_PIPELINE_CHUNK_MB",
                "check_consistency": "CGX_CHECK_CONSISTENCY", "compression": "CGX_COMPRESSION",
                "auto_alpha": "CGX_AUTO_ALPHA", "auto_window": "CGX_AUTO_WINDOW",
                "auto_adjust_every": "CGX_AUTO_ADJUST_EVERY", "stats_every": "CGX_STATS_EVERY"}


def agree_config(transport: Transport, config) -> None:
    """At ``init()``: the settings that shape the wire must be the same on every rank.

    Raises:
        ConfigError: naming the variable and each rank's value, on every rank.
    """
    values = tuple((f, _show(getattr(config, f))) for f in _SHARED_CONFIG_FIELDS)
    try:
        agree(transport, Signature("config", "cgx.init", values))
    except CollectiveMismatchError:
        sigs = transport.allgather_object(dict(values))
        diffs = []
        for f in _SHARED_CONFIG_FIELDS:
            vals = [s[f] for s in sigs]
            if len(set(vals)) > 1:
                diffs.append(f"{_CONFIG_VARS[f]}: " + ", ".join(
                    f"rank {r} has {v}" for r, v in enumerate(vals)))
        raise ConfigError("ranks started with different cgx settings (" + "; ".join(diffs) +
                          "); set the same CGX_* variables for every rank") from None
