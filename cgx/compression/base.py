"""The compressor interface shared by every family (casts, quantize, top-k, PowerSGD).

A superset of Horovod's ``Compressor``: ``compress(tensor) -> (payload, ctx)`` and
``decompress(payload, ctx) -> tensor`` keep working, and a cgx compressor adds

* per-tensor state keyed by ``name`` (error-feedback residuals, low-rank warm
  starts, stochastic-rounding step counters) that round-trips through
  :meth:`Compressor.state_dict` / :meth:`Compressor.load_state_dict` and pickles;
* :meth:`Compressor.allreduce`, the whole compressed reduction of one tensor over
  a :class:`cgx.comm.base.Transport`;
* ``kind`` and ``summable``, so the collectives layer can fuse payloads that a
  plain allreduce can add (none, fp16, bf16) and route the others.

The generic reduction (:meth:`Compressor.reduce_payload`) is::

    summable:      allreduce(payload, SUM)            one collective, payload-sized
                   out = decompress(payload)
    not summable:  allgather(payload bytes)           W payloads, equal sizes
                   out = sum over ranks r, in rank order, of decompress(payload_r)
    AVERAGE:       out /= W

Summing in rank order makes the result bit-identical on every rank.

Payloads are single tensors so that they travel as bytes: a non-summable
payload must have the same number of bytes on every rank for the same tensor
(it does for every family here: the sizes depend only on shape and options).
"""

from __future__ import annotations

import abc
import contextlib
import enum
import functools
import types
import zlib
from typing import Any, ClassVar, Optional, Sequence, Tuple

import torch

from cgx.comm.base import ReduceOp, Transport
from cgx.compression.policy import Policy, is_policy_name, single_call_error

STATE_FORMAT = 1  # version of the dicts returned by state_dict()


class Family(enum.Enum):
    """A compression family: what a compressor's payload is and how payloads combine.

    The one name per idea: every compressor declares its family (``Compressor.family``),
    auto's candidate levels belong to one (:mod:`cgx.policy.levels`), and the registry of
    configs (:mod:`cgx.compression.configs`) names compressors by it.
    """

    EXACT = "exact"  # the tensor itself, float32 on the wire; every ReduceOp works
    FP16 = "fp16"  # float16 on the wire; summable
    BF16 = "bf16"  # bfloat16 on the wire; summable
    SUMMABLE = "summable"  # a Horovod-style compressor's payload, summed as Horovod does
    QUANTIZE = "quantize"  # max-min bucket quantization (wire format v1): decode, then add
    TOPK = "topk"  # (indices, values) of the largest magnitudes: scatter-add
    POWERSGD = "powersgd"  # low-rank factors P, Q: its own two-allreduce algorithm

    @property
    def is_cast(self) -> bool:
        """A 16-bit float cast (fp16, bf16): one level, summable."""
        return self in (Family.FP16, Family.BF16)


# The registered summable families Compression.auto may offer: config_type -> class
# (filled by cgx.compression.configs.register for a class with auto_levels).
OFFERED_FAMILIES: dict = {}

# The family names states saved before 0.2.0 carry (``state_dict()["kind"]``).
LEGACY_KINDS = {"none": ("exact",), "lowrank": ("powersgd",),
                "cast": ("fp16", "bf16", "summable")}


def stable_tensor_id(name: Optional[str]) -> int:
    """A 32-bit id of a tensor name, equal on every rank and in every process.

    Python's ``hash()`` of a str is salted per process (PYTHONHASHSEED), so it
    cannot feed a noise key that all ranks must agree on; CRC-32 can.
    ``None`` (an unnamed tensor) has id 0.
    """
    if name is None:
        return 0
    return zlib.crc32(name.encode("utf-8"))


def check_name(name: Any) -> Optional[str]:
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name must be a str (or None), got {type(name).__name__} {name!r}; "
                        "pass the parameter's name, e.g. 'layer1.weight'")
    return name


def check_tensor(tensor: Any, who: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{who} takes a torch.Tensor, got {type(tensor).__name__}")
    return tensor


def check_float_tensor(tensor: Any, who: str) -> torch.Tensor:
    """A float tensor for compressors that cannot carry integers (quantize, top-k, PowerSGD)."""
    check_tensor(tensor, who)
    if not tensor.is_floating_point():
        raise TypeError(f"{who} compresses floating-point tensors (float32, float16, bfloat16, "
                        f"float64), got {tensor.dtype}; reduce integer tensors with "
                        "Compression.none")
    return tensor


def check_reduce_op(op: Any, family: Family) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` (strings such as ``"average"`` accepted)."""
    if isinstance(op, str):
        try:
            op = ReduceOp(op.strip().lower())
        except ValueError:
            pass
    if not isinstance(op, ReduceOp):
        allowed = ", ".join(m.value for m in ReduceOp)
        raise TypeError(f"op must be a cgx.comm.base.ReduceOp (or one of: {allowed}), got {op!r}")
    if family is not Family.EXACT and op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise ValueError(f"a {family.value} compressor reduces with SUM or AVERAGE, got {op.value}: "
                         "min/max/product of compressed values are not meaningful; "
                         "use Compression.none for this reduction")
    return op


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Float type sums are computed in: at least float32 (half sums lose bits fast)."""
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else dtype


def divide_(tensor: torch.Tensor, size: int) -> torch.Tensor:
    """``tensor / size`` for AVERAGE; integer tensors round toward zero."""
    if tensor.is_floating_point():
        return tensor.div_(size)
    return tensor.div_(size, rounding_mode="trunc")


def as_bytes(payload: torch.Tensor) -> torch.Tensor:
    """The payload's bytes as a flat uint8 tensor (a view when already contiguous)."""
    flat = payload.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def state_tensor(value: torch.Tensor) -> torch.Tensor:
    """Detached copy for state_dict(): the snapshot must not follow later updates."""
    return value.detach().clone()


def check_state(state: Any, kind: str, cls_name: str) -> dict:
    if not isinstance(state, dict):
        raise TypeError(f"{cls_name}.load_state_dict takes the dict made by state_dict(), "
                        f"got {type(state).__name__}")
    if state.get("kind") != kind and kind not in LEGACY_KINDS.get(state.get("kind"), ()):
        raise ValueError(f"{cls_name}.load_state_dict got a state of kind {state.get('kind')!r}, "
                         f"expected {kind!r}: load the state saved from the same kind of "
                         "compressor")
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"compressor state has format {state.get('format')!r}; this cgx "
                         f"reads format {STATE_FORMAT}")
    return state


class Compressor(abc.ABC):
    """Base class of cgx compressors.

    Subclasses implement :meth:`compress` and :meth:`decompress`; the other
    methods have defaults that suit stateless compressors.

    Attributes:
        family: its :class:`Family`.
        summable: True when ``sum_r payload_r`` decompresses to ``sum_r tensor_r``
            (up to rounding), so one plain allreduce of the payload reduces it.
    """

    family: ClassVar[Family]
    summable: ClassVar[bool] = False
    # The name its config carries (cgx.compression.configs); None: it cannot describe
    # itself (a user's compressor).
    config_type: ClassVar[Optional[str]] = None

    @property
    def inner(self) -> "Compressor":
        """The compressor that encodes (itself; a wrapper's: the one it wraps)."""
        return self

    def to_config(self) -> dict:
        """The constructor arguments that rebuild this compressor, JSON-able (its state,
        e.g. residuals, is not part of it: see :meth:`state_dict`)."""
        raise TypeError(f"{type(self).__name__} cannot describe itself as a config; cgx's "
                        "own compressors can (Compression.quantize(...), ...)")

    @classmethod
    def from_config(cls, config: dict) -> "Compressor":
        """The compressor :meth:`to_config` described."""
        return cls(**config)

    # -- what Compression.auto may offer -----------------------------------------

    @classmethod
    def auto_levels(cls, shape: Tuple[int, ...]) -> list:
        """The levels ``Compression.auto`` may give a tensor of ``shape``, each a dict of
        this class's constructor arguments; none (the default): auto does not offer it.

        A summable family registered with :func:`cgx.compression.configs.register` that
        returns levels here (and sizes its payload in :meth:`payload_nbytes`) is offered
        by its ``config_type``: ``Compression.auto(families=("quantize", "my-family"))``.
        """
        return []

    def payload_nbytes(self, numel: int) -> int:
        """Bytes this compressor's payload of ``numel`` float32 values takes on the wire
        (what ``Compression.auto`` weighs; a family offered to auto defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must define payload_nbytes(numel) "
                                  "to be offered to Compression.auto")

    @abc.abstractmethod
    def compress(self, tensor: torch.Tensor,
                 name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        """Compress ``tensor`` (state of ``name`` is read and advanced).

        Returns:
            ``(payload, ctx)``: the tensor that travels, and what the receiver
            needs besides it to decode (shape, dtype, options); ``ctx`` never travels.
        """

    @abc.abstractmethod
    def decompress(self, payload: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decode a payload made by :meth:`compress`: same shape and dtype as its input."""

    # -- the reduction ---------------------------------------------------------

    def compress_for_reduction(self, tensor: torch.Tensor, transport: Transport,
                               name: Optional[str] = None) -> Tuple[torch.Tensor, Any]:
        """:meth:`compress` as the first half of :meth:`allreduce`.

        Subclasses override it when the world changes the encoding (fp16's
        predivide by the world size, per-rank stochastic-rounding noise). A
        summable payload returned here must not alias ``tensor``: the
        allreduce overwrites it.
        """
        return self.compress(tensor, name)

    def accumulate(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> None:
        """``out += decompress(payload, ctx)``, with ``out`` a flat accumulator.

        Families with a cheaper fused form override it (dequantize with
        ``accumulate=True``, top-k's scatter-add).
        """
        out.add_(self.decompress(payload, ctx).reshape(-1).to(out.dtype))

    def reduce_payload(self, payload: torch.Tensor, ctx: Any, transport: Transport,
                       like: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE) -> torch.Tensor:
        """Reduce this rank's ``payload`` with every other rank's (see module docstring).

        Args:
            payload, ctx: from :meth:`compress_for_reduction` (the payload may be overwritten).
            transport: the group; every rank calls with equal-size payloads.
            like: the tensor that was compressed (gives the result's shape and dtype).
            op: SUM or AVERAGE (any op for ``Compression.none``).

        Returns:
            A new tensor shaped and typed like ``like``, identical on every rank.
        """
        size = transport.size
        if self.summable:
            transport.allreduce(payload, ReduceOp.SUM if op is ReduceOp.AVERAGE else op)
            out = self.decompress(payload, ctx)
        else:
            chunk = as_bytes(payload)
            gathered = torch.empty(size * chunk.numel(), dtype=torch.uint8, device=chunk.device)
            transport.allgather(gathered, chunk)
            return self._sum_gathered(gathered.view(size, -1), payload, ctx, like, op)
        if op is ReduceOp.AVERAGE:
            out = divide_(out, size)
        return out.to(like.dtype)

    def _sum_gathered(self, per_rank: torch.Tensor, payload: torch.Tensor, ctx: Any,
                      like: torch.Tensor, op: ReduceOp) -> torch.Tensor:
        """Every rank's payload (row r of ``per_rank``: its bytes) accumulated in rank order,
        the same float sum on every rank; averaged for AVERAGE; shaped and typed like ``like``."""
        out = torch.zeros(like.numel(), dtype=accumulate_dtype(like.dtype), device=like.device)
        for r in range(per_rank.shape[0]):
            self.accumulate(per_rank[r].view(payload.dtype).view(payload.shape), ctx, out)
        if op is ReduceOp.AVERAGE:
            out = divide_(out, per_rank.shape[0])
        return out.view(like.shape).to(like.dtype)

    def allreduce(self, tensor: torch.Tensor, transport: Transport, name: Optional[str] = None,
                  op: ReduceOp = ReduceOp.AVERAGE) -> torch.Tensor:
        """Compressed reduction of one tensor over ``transport``.

        Every rank calls it with a tensor of the same shape and dtype, the
        same ``name`` and the same ``op``, in the same order as its other
        collectives. ``tensor`` is not modified.

        Args:
            tensor: the local value (e.g. a gradient).
            transport: the group to reduce over.
            name: key of this tensor's state (residual, warm start, step counter).
            op: ``ReduceOp.AVERAGE`` (default) or ``ReduceOp.SUM``.

        Returns:
            The reduced tensor (new memory), same shape and dtype as ``tensor``.

        Example::

            comp = Compression.quantize(bits=4)
            grad = comp.allreduce(grad, transport, name="fc1.weight")
        """
        check_tensor(tensor, f"{type(self).__name__}.allreduce")
        op = check_reduce_op(op, self.family)
        check_name(name)
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a cgx.comm.base.Transport, got "
                            f"{type(transport).__name__}")
        payload, ctx = self.compress_for_reduction(tensor, transport, name)
        if tensor.numel() == 0:  # same shape everywhere: nothing to exchange
            return self.decompress(payload, ctx).clone()
        return self.reduce_payload(payload, ctx, transport, tensor, op)

    def gathers(self) -> bool:
        """True when the reduction is the default one: allgather the payloads, accumulate
        them in rank order (what :meth:`allreduce_many` fuses)."""
        cls = type(self)
        return not self.summable and cls.allreduce is Compressor.allreduce and \
            cls.reduce_payload is Compressor.reduce_payload

    def allreduce_many(self, tensors: list, transport: Transport, names: list,
                       op: ReduceOp = ReduceOp.AVERAGE) -> list:
        """:meth:`allreduce` of several tensors, in as few collectives as the family allows.

        Payloads that are gathered (top-k, and any non-summable compressor that keeps
        the default reduction) travel in one allgather: each rank's payloads
        concatenated, each slot padded to 16 bytes. Every tensor is then accumulated
        in rank order exactly as :meth:`reduce_payload` does, so the results are
        bit-identical to reducing the tensors one by one. Compressors with their own
        algorithm override this (PowerSGD batches its two allreduces) or reduce one
        tensor at a time.
        """
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        if len(tensors) < 2 or not self.gathers():
            return [self.allreduce(t, transport, n, op) for t, n in zip(tensors, names)]
        for t in tensors:
            check_tensor(t, f"{type(self).__name__}.allreduce_many")
        op = check_reduce_op(op, self.family)
        for n in names:
            check_name(n)
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a cgx.comm.base.Transport, got "
                            f"{type(transport).__name__}")
        pairs = [self.compress_for_reduction(t, transport, n) for t, n in zip(tensors, names)]
        chunks = [as_bytes(p) for p, _ in pairs]
        slots = [-(-c.numel() // 16) * 16 for c in chunks]
        device = chunks[0].device
        send = torch.zeros(sum(slots), dtype=torch.uint8, device=device)
        off = 0
        for c, slot in zip(chunks, slots):
            send[off:off + c.numel()].copy_(c)
            off += slot
        size = transport.size
        gathered = torch.empty(size * send.numel(), dtype=torch.uint8, device=device)
        if send.numel():
            transport.allgather(gathered, send)
        per_rank = gathered.view(size, -1)
        outs, off = [], 0
        for (payload, ctx), t, c, slot in zip(pairs, tensors, chunks, slots):
            if t.numel() == 0:
                outs.append(self.decompress(payload, ctx).clone())
                off += slot
                continue
            outs.append(self._sum_gathered(per_rank[:, off:off + c.numel()], payload, ctx, t, op))
            off += slot
        return outs

    # -- state -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """Per-tensor state as plain tensors, ints and dicts (``torch.save``/pickle safe)."""
        return {"format": STATE_FORMAT, "kind": self.family.value}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (tensors are copied)."""
        check_state(state, self.family.value, type(self).__name__)

    def reset(self, *names: Optional[str]) -> None:
        """Forget the state of the given tensor names (of every tensor when none are given).

        Example: ``comp.reset("fc.weight")``; ``comp.reset()`` clears everything.
        """

    def per_tensor_tables(self) -> tuple[dict, ...]:
        """The dicts (tensor name -> state) this compressor keeps per tensor, residuals
        first when it keeps them; :meth:`untouched` saves and restores them."""
        return ()

    def take_residual(self, name: Optional[str]) -> Optional[torch.Tensor]:
        """Remove and return what this compressor still owes for ``name`` (its error-feedback
        residual, in the units of its input), or None when it holds nothing."""
        return None

    @contextlib.contextmanager
    def untouched(self, names: Sequence[Optional[str]]):
        """Per-tensor state of ``names`` as it was before the block; their residuals are
        held out during it (a joined rank's zeros go out as zeros and change nothing)."""
        tables = self.per_tensor_tables()
        saved = [{n: t[n] for n in names if n in t} for t in tables]
        for n in names:
            self.take_residual(n)
        try:
            yield
        finally:
            for table, kept in zip(tables, saved):
                for n in names:
                    table.pop(n, None)
                table.update(kept)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# -- Horovod's static-call style ------------------------------------------------

class default_instance_method:
    """Method that also works on the class, bound to the class's shared default instance.

    Horovod's compressors are classes with static methods, so user code calls
    ``Compression.fp16.compress(tensor)`` on the class. cgx's cast compressors
    take options (``predivide``), so they are instantiated; this descriptor
    keeps the class-level call working: on the class it binds to ``cls()``
    (created once per class), on an instance it is an ordinary method.
    """

    def __init__(self, func):
        self.__func__ = func
        functools.update_wrapper(self, func)

    def __get__(self, obj, owner=None):
        if obj is None:
            obj = class_default(owner)
        return types.MethodType(self.__func__, obj)


def class_default(cls: type) -> "Compressor":
    """The shared default instance of a compressor class (stateless classes only)."""
    inst = cls.__dict__.get("_shared_default")
    if inst is None:
        inst = cls()
        setattr(cls, "_shared_default", inst)
    return inst


class HorovodCompressor(Compressor):
    """Adapter for a Horovod-style compressor (static ``compress(t)``/``decompress(t, ctx)``).

    Horovod allreduces whatever ``compress`` returns, so the payload is
    treated as summable, exactly as Horovod does.
    """

    family = Family.SUMMABLE
    summable = True

    def __init__(self, impl: Any):
        self.impl = impl

    def compress(self, tensor, name=None):
        return self.impl.compress(tensor)

    def compress_for_reduction(self, tensor, transport, name=None):
        payload, ctx = self.impl.compress(tensor)
        if payload.data_ptr() == tensor.data_ptr():
            payload = payload.clone()  # the allreduce is in place; keep the caller's tensor
        return payload, ctx

    def decompress(self, payload, ctx):
        return self.impl.decompress(payload, ctx)

    def __repr__(self) -> str:
        return f"HorovodCompressor({self.impl!r})"


def user_compressor(obj: Any) -> Any:
    """``obj`` when it is a Horovod-style compressor of the user's own (``compress``/
    ``decompress``, not a cgx compressor, compressor class or policy), else None. The
    TensorFlow ops hand such a compressor TF tensors, as Horovod does; what is neither
    raises as :func:`as_compressor` does."""
    if isinstance(obj, (Compressor, Policy)) or (
            isinstance(obj, type) and issubclass(obj, Compressor)):
        return None
    as_compressor(obj)  # TypeError with the accepted forms, if neither
    return obj


def as_compressor(obj: Any) -> Compressor:
    """Normalize what users pass as ``compression=`` into a :class:`Compressor` instance.

    Accepts a cgx compressor instance (returned as is), a cgx compressor class
    (``Compression.fp16``: its default instance), or any Horovod-style
    compressor with ``compress``/``decompress`` (wrapped in :class:`HorovodCompressor`).
    Policies (``"auto"``, ``Compression.auto()``, ``Compression.planned()``) are not
    compressors: :func:`cgx.compression.resolve` takes them too.
    """
    if isinstance(obj, Compressor):
        return obj
    if isinstance(obj, Policy):
        raise ValueError(obj.single_call_error())
    if is_policy_name(obj):
        raise ValueError(single_call_error('compression="auto"'))
    if isinstance(obj, type) and issubclass(obj, Compressor):
        return class_default(obj)
    if callable(getattr(obj, "compress", None)) and callable(getattr(obj, "decompress", None)):
        return HorovodCompressor(obj)
    raise TypeError(f"compression must be a cgx compressor (e.g. Compression.fp16, "
                    f"Compression.quantize(bits=4)), \"auto\", or an object with "
                    f"compress/decompress, got {obj!r}")
