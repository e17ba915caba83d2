"""The transport interface: the few collectives cgx's algorithms need.

Compressed allreduce algorithms (``cgx.collectives``) are written once against
this interface; implementations wrap existing engines only:
torch.distributed (Gloo on CPU, NCCL on GPU), mpi4py, and Horovod.

Rules every implementation follows:

* Collectives are issued in the same order on every rank (the caller's job);
  an implementation never reorders them.
* ``alltoall`` and ``allgather`` move equal-size byte chunks (1-D uint8
  tensors); ``allreduce`` and ``broadcast`` take any dtype the engine supports.
* With ``async_op=True`` a :class:`Work` is returned and the tensors must not
  be touched until ``wait()`` returns; otherwise the call blocks and returns None.

What a rank sends is counted here, once for every implementation: each collective a
transport class defines is wrapped (``Transport.__init_subclass__``) so that the bytes
handed to it are added to the transport's totals (:meth:`Transport.sent_bytes`) and to
every :func:`count_sent` block open on the calling thread. :class:`SentBytes` defines
what each collective counts.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import enum
import functools
import pickle
import threading
from typing import Any, Iterator, Optional, Sequence

import torch


class ReduceOp(enum.Enum):
    """Reduction of :meth:`Transport.allreduce` (and of cgx's allreduce API)."""

    SUM = "sum"
    AVERAGE = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` in place by ``factor``, by Horovod's rules; returns it.

    This is the one scaling rule of every path (pre/postscale, Average's
    division by the world size, fused or not, every transport):

    * floating point: ``x * factor`` (16-bit types computed in float32, then rounded);
    * complex: both parts scaled;
    * integers: ``trunc(float64(x) * factor)``, as Horovod's ``ScaleBuffer``
      (a C conversion from double, which truncates toward zero): Average of
      ``[3]`` and ``[4]`` on 2 ranks is ``[3]``, of ``[-3]`` and ``[-4]`` is ``[-3]``;
    * bool: ``x * factor != 0``.
    """
    factor = float(factor)
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor)
    if tensor.dtype == torch.bool:
        if factor == 0.0:
            tensor.zero_()
        return tensor
    scaled = tensor.to(torch.float64).mul_(factor).trunc_()
    return tensor.copy_(scaled.to(tensor.dtype))


class Work(abc.ABC):
    """Handle of an asynchronous collective."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the collective is done (raises what it raised)."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once ``wait()`` would return at once."""


class CompletedWork(Work):
    """A Work that is already done (for engines without async ops)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


# -- what a rank sends ----------------------------------------------------------------

COLLECTIVES = ("alltoall", "allgather", "allreduce", "broadcast", "sendrecv")


@dataclasses.dataclass
class SentBytes:
    """Bytes this rank handed to transports for sending, per collective.

    ``n`` is the size of the tensor handed over, in the dtype the engine moves it in
    (a dtype the engine cannot take travels widened: see :attr:`Transport.widened`),
    and ``W`` the group's size; a group of one rank sends nothing. Per call:

    * ``alltoall(output, input)``: ``(W - 1) / W * n``, the chunks for the other
      ranks (a rank's own chunk stays);
    * ``allgather(output, input)``: ``(W - 1) * n``: every other rank needs this
      rank's input, and the engines' algorithms (a ring in Gloo and NCCL, a ring or
      recursive doubling in MPI) have each rank transmit ``W - 1`` input-sized blocks
      (its own and those it forwards), not one;
    * ``allreduce(tensor)``: ``2 * (W - 1) / W * n`` (integer division), the ring
      allreduce of Gloo, NCCL and MPI's large buffers: a reduce-scatter and an
      allgather of ``n / W``-byte chunks;
    * ``broadcast(tensor, root)``: ``(W - 1) * n`` on the root, 0 on the others (one
      copy per receiver; a tree relays some copies through other ranks, which moves
      the same total);
    * ``sendrecv(send, dst, ...)``: ``n`` of ``send``.

    ``barrier`` and ``split`` hand over no payload. Headers and the engine's own
    control messages are not counted (a network interface also carries TCP/IP
    headers). Everything else is what the caller handed over, padding included.

    Attributes:
        by_collective: bytes per collective name (keys from ``COLLECTIVES``).
    """

    by_collective: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.by_collective.values())

    def add(self, kind: str, nbytes: int) -> None:
        self.by_collective[kind] = self.by_collective.get(kind, 0) + nbytes

    def __add__(self, other: "SentBytes") -> "SentBytes":
        out = SentBytes(dict(self.by_collective))
        for k, v in other.by_collective.items():
            out.add(k, v)
        return out

    def __sub__(self, other: "SentBytes") -> "SentBytes":
        out = SentBytes(dict(self.by_collective))
        for k, v in other.by_collective.items():
            out.add(k, -v)
        return out


_local = threading.local()  # per thread: open count_sent() meters, and the call in progress
_totals_lock = threading.Lock()  # transports' totals (several threads may issue collectives)


@contextlib.contextmanager
def count_sent() -> Iterator[SentBytes]:
    """Count the bytes this thread hands to any transport inside the block.

    Blocks nest (each counts everything inside it); other threads' collectives are
    not counted.

    Example::

        with count_sent() as sent:
            transport.allgather(out, inp)
        sent.total, sent.by_collective      # (W - 1) * inp's bytes, {"allgather": ...}
    """
    meters = getattr(_local, "meters", None)
    if meters is None:
        meters = _local.meters = []
    meter = SentBytes()
    meters.append(meter)
    try:
        yield meter
    finally:
        # by identity: an equal meter (two blocks that counted the same) is another block
        del meters[next(i for i, m in enumerate(meters) if m is meter)]


def _nbytes(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def _arg(args: tuple, kwargs: dict, i: int, name: str):
    return args[i] if len(args) > i else kwargs[name]


def _bytes_to_send(transport: "Transport", kind: str, args: tuple, kwargs: dict) -> int:
    """What one call sends from this rank (see :class:`SentBytes`)."""
    W = transport.size
    if W <= 1:
        return 0
    if kind == "alltoall":
        return (W - 1) * _nbytes(_arg(args, kwargs, 1, "input")) // W
    if kind == "allgather":
        return (W - 1) * _nbytes(_arg(args, kwargs, 1, "input"))
    if kind == "allreduce":
        t = _arg(args, kwargs, 0, "tensor")
        return 2 * (W - 1) * _nbytes(t, transport.widened.get(kind, {}).get(t.dtype)) // W
    if kind == "broadcast":
        t, root = _arg(args, kwargs, 0, "tensor"), _arg(args, kwargs, 1, "root")
        wide = transport.widened.get(kind, {}).get(t.dtype)
        return (W - 1) * _nbytes(t, wide) if root == transport.rank else 0
    send, dst = _arg(args, kwargs, 0, "send"), _arg(args, kwargs, 1, "dst")
    return _nbytes(send) if dst != transport.rank else 0


def _counted(kind: str, fn):
    """``fn`` (a transport's collective), counting what each call hands over once it
    returned (a call that raised sent nothing). A collective that a transport builds
    from its own collectives is counted once, by the outer call."""
    @functools.wraps(fn)
    def call(self, *args, **kwargs):
        if getattr(_local, "inside", False):
            return fn(self, *args, **kwargs)
        _local.inside = True
        try:
            result = fn(self, *args, **kwargs)
        finally:
            _local.inside = False
        nbytes = _bytes_to_send(self, kind, args, kwargs)
        with _totals_lock:
            self.__dict__.setdefault("_sent_totals", SentBytes()).add(kind, nbytes)
        for meter in getattr(_local, "meters", ()):
            meter.add(kind, nbytes)
        return result

    call.counts_sent = True
    return call


class Transport(abc.ABC):
    """Collectives over a fixed group of ranks.

    Attributes:
        rank: this process's rank inside the group.
        size: number of ranks in the group.
        device: where tensors handed to this transport must live
            (``cpu`` for Gloo/MPI, the local ``cuda`` device for NCCL).
        name: short engine name for logs and benchmark tables.
        widened: per collective, the dtypes the engine cannot take and the wider
            dtype the transport hands it instead (``{"allreduce": {torch.int16:
            torch.int32}}``): what is sent is counted in that dtype.
    """

    rank: int
    size: int
    device: torch.device
    name: str = "transport"
    widened: dict = {}

    def __init_subclass__(cls, **kwargs):
        """Every collective a transport class defines counts what it is handed
        (see :class:`SentBytes`): written once here, for every implementation."""
        super().__init_subclass__(**kwargs)
        for kind in COLLECTIVES:
            fn = cls.__dict__.get(kind)
            if callable(fn) and not getattr(fn, "counts_sent", False):
                setattr(cls, kind, _counted(kind, fn))

    def sent_bytes(self) -> SentBytes:
        """Everything this rank handed to this transport for sending so far (a copy)."""
        with _totals_lock:
            mine = self.__dict__.get("_sent_totals")
            return SentBytes(dict(mine.by_collective) if mine is not None else {})

    @abc.abstractmethod
    def alltoall(self, output: torch.Tensor, input: torch.Tensor,
                 async_op: bool = False) -> Optional[Work]:
        """Rank r sends ``input`` chunk j to rank j and receives rank j's chunk r into ``output`` chunk j.

        ``input`` and ``output`` are 1-D uint8 of ``size * chunk`` bytes.
        """

    @abc.abstractmethod
    def allgather(self, output: torch.Tensor, input: torch.Tensor,
                  async_op: bool = False) -> Optional[Work]:
        """``output`` (``size * len(input)`` bytes) receives every rank's ``input`` in rank order."""

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM,
                  async_op: bool = False) -> Optional[Work]:
        """In-place reduction of ``tensor`` over the group."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int, async_op: bool = False) -> Optional[Work]:
        """In-place broadcast of ``tensor`` from group rank ``root``."""

    @abc.abstractmethod
    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int,
                 async_op: bool = False) -> Optional[Work]:
        """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (ring algorithms)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank of the group arrives."""

    @abc.abstractmethod
    def split(self, groups: Sequence[Sequence[int]]) -> "Transport":
        """Sub-transport of the group (of ``groups``) that contains this rank.

        ``groups`` partitions this transport's ranks; every rank must call
        ``split`` with the same ``groups`` in the same order.
        """

    # -- helpers with default implementations ---------------------------------

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """Pickle ``obj`` on ``root`` and return it on every rank."""
        data = pickle.dumps(obj) if self.rank == root else b""
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(length, root)
        buf = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == root:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf, root)
        return obj if self.rank == root else pickle.loads(buf.cpu().numpy().tobytes())

    def allgather_object(self, obj: Any) -> list:
        """Pickle ``obj`` on every rank and return the list of all ranks' objects."""
        data = pickle.dumps(obj)
        length = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        lengths = torch.empty(self.size, dtype=torch.int64, device=self.device)
        self.allgather(lengths.view(torch.uint8), length.view(torch.uint8))
        width = int(lengths.max().item())
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        allbuf = torch.empty(width * self.size, dtype=torch.uint8, device=self.device)
        self.allgather(allbuf, mine.to(self.device))
        allbuf = allbuf.cpu()
        return [pickle.loads(allbuf[i * width: i * width + int(lengths[i])].numpy().tobytes())
                for i in range(self.size)]

    def close(self) -> None:
        """Release engine resources owned by this transport (default: nothing)."""


class SingleProcessTransport(Transport):
    """The world of one rank: every collective is a copy or a no-op."""

    name = "single"

    def __init__(self, device: torch.device | str = "cpu"):
        self.rank, self.size, self.device = 0, 1, torch.device(device)

    def alltoall(self, output, input, async_op=False):
        output.copy_(input)
        return CompletedWork() if async_op else None

    def allgather(self, output, input, async_op=False):
        output.copy_(input)
        return CompletedWork() if async_op else None

    def allreduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        return CompletedWork() if async_op else None

    def broadcast(self, tensor, root, async_op=False):
        if root != 0:
            raise ValueError(f"root={root} is not a rank of a 1-rank world")
        return CompletedWork() if async_op else None

    def sendrecv(self, send, dst, recv, src, async_op=False):
        recv.copy_(send)
        return CompletedWork() if async_op else None

    def barrier(self):
        return None

    def split(self, groups):
        return self
