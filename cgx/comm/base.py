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
"""

from __future__ import annotations

import abc
import enum
import pickle
from typing import Any, Optional, Sequence

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


class Transport(abc.ABC):
    """Collectives over a fixed group of ranks.

    Attributes:
        rank: this process's rank inside the group.
        size: number of ranks in the group.
        device: where tensors handed to this transport must live
            (``cpu`` for Gloo/MPI, the local ``cuda`` device for NCCL).
        name: short engine name for logs and benchmark tables.
    """

    rank: int
    size: int
    device: torch.device
    name: str = "transport"

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
