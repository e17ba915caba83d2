"""Transport on MPI through mpi4py (buffer-protocol calls, no pickling).

Tensors are handed to MPI as NumPy views of their CPU memory, so a contiguous
CPU tensor moves without a copy. Other tensors are staged: a contiguous host
copy goes to MPI and the result is copied back when the call (or, with
``async_op=True``, ``Work.wait()``) finishes. CUDA tensors therefore work but
travel through host memory; for GPUs prefer the torch/NCCL transport.

Collectives map one to one: ``Alltoall``, ``Allgather``, ``Allreduce``,
``Bcast``, ``Sendrecv`` (``Isend``/``Irecv`` when async), and the MPI-3
nonblocking ``Ialltoall``, ``Iallgather``, ``Iallreduce``, ``Ibcast`` for
``async_op=True``; ``split`` is ``Comm.Split``. ``alltoall``, ``allgather``,
``broadcast`` and ``sendrecv`` move raw bytes, so every dtype works (bf16 too).

Reductions: MPI has no 16-bit float type or operation, so float16 and bfloat16
tensors are reduced in a float32 copy and rounded back once (AVERAGE divides
before rounding). The result is at least as accurate as summing in 16 bits,
but it sends twice the bytes; compressed collectives send bytes through
``alltoall``/``allgather`` and do not pay this. AVERAGE is SUM followed by a
division (floor division for integers), as on cgx's other transports.

Notes:
    * Open MPI has no progress thread: a nonblocking collective advances
      inside MPI calls, so ``Work.is_completed()`` (``MPI_Testall``) also
      drives it.
    * MPI-3 counts are C ints: one call moves at most 2 GiB per peer.
    * Calls from several threads need MPI_THREAD_MULTIPLE (what mpi4py asks
      for by default); check ``MPI.Query_thread()`` if your MPI gives less.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from cgx.comm.base import ReduceOp, Transport, Work, scale_
from cgx.errors import MissingDependencyError

_TAG = 0x6367  # tag of sendrecv messages ("cg")
# MPI has no 16-bit float type or operation: reduced in a float32 copy.
_REDUCE_VIA = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def import_mpi():
    """Import and return ``mpi4py.MPI`` (initializes MPI on first import)."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise MissingDependencyError("mpi4py", "mpi",
                                     "cgx's MPI transport (CGX_TRANSPORT=mpi)") from None
    return MPI


class _MPIWork(Work):
    """Outstanding MPI requests; ``then()`` runs once after they complete.

    Holds references to the buffers MPI reads and writes, so that they stay
    alive while the requests are in flight.
    """

    def __init__(self, MPI, requests: list, keep: tuple = (),
                 then: Optional[Callable[[], None]] = None):
        self._MPI, self._requests, self._keep, self._then = MPI, requests, keep, then
        self._finished = False  # MPI requests done
        self._done = False  # ``then`` ran too

    def wait(self) -> None:
        if self._done:
            return
        if not self._finished:
            self._MPI.Request.Waitall(self._requests)
            self._finished = True
        self._done = True
        self._keep = ()
        if self._then is not None:
            self._then()

    def is_completed(self) -> bool:
        if not self._finished and self._MPI.Request.Testall(self._requests):
            self._finished = True
        # A pending ``then`` (a copy back) is quick; wait() still has to run it.
        return self._finished


def _host(t: torch.Tensor, copy_in: bool) -> torch.Tensor:
    """``t`` itself if MPI can use its memory, else a contiguous CPU staging copy."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t.detach()
    if copy_in:
        return t.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
    return torch.empty(t.shape, dtype=t.dtype)


def _bytes(t: torch.Tensor):
    """NumPy uint8 view of a contiguous CPU tensor's memory (any dtype)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MPITransport(Transport):
    """Collectives of one MPI communicator.

    Args:
        comm: an ``mpi4py.MPI.Comm`` (default ``MPI.COMM_WORLD``).
        device: device of the tensors callers pass (default ``cpu``). Other
            devices work through host staging copies.

    Raises:
        MissingDependencyError: mpi4py is not installed.

    Example (under ``mpirun -np 2``)::

        t = MPITransport()
        x = torch.full((4,), float(t.rank))
        t.allreduce(x)          # x == [1., 1., 1., 1.] on both ranks
    """

    name = "mpi"
    widened = {"allreduce": _REDUCE_VIA}

    def __init__(self, comm: Any = None, device: torch.device | str = "cpu"):
        MPI = import_mpi()
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.device = torch.device(device)
        self._owns_comm = False  # True for communicators made by split()
        self._reduce_dtypes = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
        }
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVERAGE: MPI.SUM, ReduceOp.MIN: MPI.MIN,
                     ReduceOp.MAX: MPI.MAX, ReduceOp.PRODUCT: MPI.PROD}

    # -- helpers ------------------------------------------------------------------

    def _finish(self, request, keep: tuple, then, async_op: bool) -> Optional[Work]:
        work = _MPIWork(self._MPI, request if isinstance(request, list) else [request], keep, then)
        if async_op:
            return work
        work.wait()
        return None

    @staticmethod
    def _copy_back(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        """``then`` that copies staged results back into the caller's tensors."""
        pairs = [(dst, src) for dst, src in pairs if src is not dst and
                 src.data_ptr() != dst.data_ptr()]
        if not pairs:
            return None

        def then():
            for dst, src in pairs:
                dst.copy_(src)
        return then

    def _check_rank(self, what: str, r: int) -> None:
        if not 0 <= r < self.size:
            raise ValueError(f"{what}={r} is not a rank of this group (size {self.size})")

    # -- collectives ----------------------------------------------------------------

    def _bytes_collective(self, blocking, nonblocking, output, input, async_op):
        """Run an MPI collective on the raw bytes of ``input`` -> ``output``."""
        src, dst = _host(input, True), _host(output, False)
        sbuf, rbuf = _bytes(src), _bytes(dst)
        bufs = ([sbuf, self._MPI.BYTE], [rbuf, self._MPI.BYTE])
        then = self._copy_back([(output, dst)])
        if async_op:
            return self._finish(nonblocking(*bufs), (src, dst, sbuf, rbuf), then, True)
        blocking(*bufs)
        if then:
            then()
        return None

    def alltoall(self, output, input, async_op=False):
        n_in, n_out = _nbytes(input), _nbytes(output)
        if n_in != n_out or n_in % self.size:
            raise ValueError(f"alltoall needs input and output of the same byte size, a multiple "
                             f"of the group size {self.size}; got {n_in} and {n_out} bytes")
        return self._bytes_collective(self.comm.Alltoall, self.comm.Ialltoall, output, input,
                                      async_op)

    def allgather(self, output, input, async_op=False):
        n_in, n_out = _nbytes(input), _nbytes(output)
        if n_out != self.size * n_in:
            raise ValueError(f"allgather output must hold size * len(input) = {self.size} * "
                             f"{n_in} bytes; got {n_out} bytes")
        return self._bytes_collective(self.comm.Allgather, self.comm.Iallgather, output, input,
                                      async_op)

    def allreduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        if not isinstance(op, ReduceOp):
            raise ValueError(f"unsupported reduce op {op!r}; expected a cgx.comm.base.ReduceOp")
        if tensor.dtype in _REDUCE_VIA:
            # MPI has no 16-bit float op: reduce an exact float32 copy, round once.
            buf = tensor.detach().to("cpu", torch.float32, memory_format=torch.contiguous_format,
                                     copy=True)
        else:
            if tensor.dtype not in self._reduce_dtypes:
                names = ", ".join(sorted(str(d).replace("torch.", "") for d in
                                         [*self._reduce_dtypes, torch.float16, torch.bfloat16]))
                raise TypeError(f"MPITransport.allreduce does not take {tensor.dtype} tensors; "
                                f"expected one of: {names}")
            buf = _host(tensor, True)
        arr = buf.reshape(-1).numpy()
        MPI = self._MPI
        mpi_type = self._reduce_dtypes[buf.dtype]

        def then():
            if op is ReduceOp.AVERAGE:
                # Sum, then scale by cgx's one rule: the same bits on every transport.
                scale_(buf, 1.0 / self.size)
            if buf.data_ptr() != tensor.data_ptr():
                tensor.copy_(buf)

        if async_op:
            req = self.comm.Iallreduce(MPI.IN_PLACE, [arr, mpi_type], self._ops[op])
            return self._finish(req, (buf, arr), then, True)
        self.comm.Allreduce(MPI.IN_PLACE, [arr, mpi_type], self._ops[op])
        then()
        return None

    def broadcast(self, tensor, root, async_op=False):
        self._check_rank("broadcast root", root)
        buf = _host(tensor, True)
        raw = _bytes(buf)
        MPI = self._MPI
        then = self._copy_back([(tensor, buf)]) if self.rank != root else None
        if async_op:
            req = self.comm.Ibcast([raw, MPI.BYTE], root=root)
            return self._finish(req, (buf, raw), then, True)
        self.comm.Bcast([raw, MPI.BYTE], root=root)
        if then:
            then()
        return None

    def sendrecv(self, send, dst, recv, src, async_op=False):
        self._check_rank("sendrecv dst", dst)
        self._check_rank("sendrecv src", src)
        sbuf, rbuf = _host(send, True), _host(recv, False)
        sraw, rraw = _bytes(sbuf), _bytes(rbuf)
        MPI = self._MPI
        then = self._copy_back([(recv, rbuf)])
        if async_op:
            # Receive first: its buffer is posted before the matching send can arrive.
            reqs = [self.comm.Irecv([rraw, MPI.BYTE], source=src, tag=_TAG),
                    self.comm.Isend([sraw, MPI.BYTE], dest=dst, tag=_TAG)]
            return self._finish(reqs, (sbuf, rbuf, sraw, rraw), then, True)
        self.comm.Sendrecv([sraw, MPI.BYTE], dest=dst, sendtag=_TAG,
                           recvbuf=[rraw, MPI.BYTE], source=src, recvtag=_TAG)
        if then:
            then()
        return None

    def barrier(self):
        self.comm.Barrier()

    def split(self, groups: Sequence[Sequence[int]]) -> "MPITransport":
        """Sub-transport of this rank's group (``Comm.Split``).

        Every rank passes the same ``groups``; a group's ranks keep the parent's order.
        """
        seen = sorted(r for g in groups for r in g)
        if seen != list(range(self.size)):
            raise ValueError(f"split groups {[list(g) for g in groups]} must partition ranks "
                             f"0..{self.size - 1} exactly once")
        color = next(i for i, g in enumerate(groups) if self.rank in g)
        # key = parent rank: group ranks follow the parent's order, as on the
        # other transports (torch.distributed sorts a new group's ranks too).
        sub = MPITransport(self.comm.Split(color, self.rank), self.device)
        sub._owns_comm = True
        return sub

    def close(self) -> None:
        """Free the communicator if ``split`` created it (MPI itself stays up)."""
        MPI = self._MPI
        if self._owns_comm and not MPI.Is_finalized() and self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self._owns_comm = False
