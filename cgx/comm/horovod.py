"""Transport on Horovod's own collectives (``horovod.torch``), for runs under horovodrun.

Horovod is imported when a :class:`HorovodTransport` is created, never when
this module is imported, so ``import cgx`` works without Horovod installed.
Horovod 0.28.1 does not build as published against torch >= 2.1; this
project's ``make horovod`` (``scripts/build-horovod.sh``) builds a patched
wheel, see ``docs/horovod.md``.

How each collective maps onto Horovod (CPU tensors):

* ``alltoall``: ``hvd.alltoall`` of equal chunks (Horovod returns a new tensor,
  copied into ``output``).
* ``allgather``: ``hvd.allgather`` (concatenates along dim 0; copied into ``output``).
* ``allreduce``: in place with ``hvd.allreduce_async_``; ``AVERAGE`` is a
  ``Sum`` followed by a division here, like the other transports, so that
  every engine gives the same bits.
* ``broadcast``: in place with ``hvd.broadcast_async_``.
* ``sendrecv``: Horovod has no point-to-point op; it is an ``hvd.alltoall``
  whose ``splits`` give all bytes to ``dst`` and none to anyone else. It is
  therefore a collective: every rank of the group calls it at the same step
  (ring algorithms do).
* ``split``: ``hvd.add_process_set`` (needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``)
  or a process set already registered with ``hvd.init(process_sets=...)``.

Horovod matches concurrently outstanding ops across ranks by name, so every op
gets a name from a per-transport counter; callers create transports and issue
collectives in the same order on every rank (the Transport rule), so the names
agree.
"""

from __future__ import annotations

import importlib.util
import itertools
from typing import Callable, Optional, Sequence

import torch

from cgx.comm.base import ReduceOp, Transport, Work, scale_
from cgx.errors import CGXError, CollectiveMismatchError, MissingDependencyError

# Element types horovod.torch 0.28.1 registers per collective (CPU tensors).
_MOVE_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                          torch.float16, torch.float32, torch.float64})
_REDUCE_DTYPES = frozenset({torch.int32, torch.int64, torch.float16, torch.float32, torch.float64})
# Reduced in a wider type Horovod has, then cast back (exact upcast).
_REDUCE_VIA = {torch.bfloat16: torch.float32}

# Transports created so far per process-set id: part of the op names, so two
# transports on one set (a split that returns the whole group) never clash.
_TRANSPORTS_PER_SET: dict = {}

_BUILD_HINT = ("Build and install it for this environment with `make horovod` "
               "(or scripts/build-horovod.sh PYTHON ~/.cache/cgx/wheels); see docs/horovod.md.")


class HorovodMissingError(MissingDependencyError):
    """Horovod is not installed, or its PyTorch extension does not load.

    Horovod is not a pip extra of cgx (0.28.1 needs a patched build), so the
    message points at the build script instead of ``pip install``.
    """

    def __init__(self, detail: str):
        ImportError.__init__(
            self, f"cgx's Horovod transport needs the Python package 'horovod' (0.28.1 with its "
                  f"PyTorch extension): {detail}. {_BUILD_HINT}")
        self.name = "horovod"


def import_horovod():
    """Import and return ``horovod.torch``, or raise :class:`HorovodMissingError`."""
    if importlib.util.find_spec("horovod") is None:
        raise HorovodMissingError("it is not installed")
    try:
        import horovod.torch as hvd
    except ImportError as e:
        # Typically "undefined symbol": the wheel was built against another torch.
        raise HorovodMissingError(
            f"it is installed but 'import horovod.torch' failed ({e}); it was probably built "
            f"against another torch ({torch.__version__} is installed)") from e
    return hvd


class _HorovodWork(Work):
    """An outstanding Horovod handle; ``then(result)`` runs once after it completes."""

    def __init__(self, hvd, handle, then: Optional[Callable[[object], None]] = None):
        self._hvd, self._handle, self._then = hvd, handle, then
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        result = self._hvd.synchronize(self._handle)
        self._done = True
        if self._then is not None:
            self._then(result)

    def is_completed(self) -> bool:
        # poll() only says Horovod finished; ``then`` (a copy) still runs in wait().
        return self._done or self._hvd.poll(self._handle)


def _check_dtype(tensor: torch.Tensor, allowed: frozenset, what: str) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in allowed))
        raise TypeError(f"Horovod's {what} does not take {tensor.dtype} tensors; "
                        f"expected one of: {names}")


def _check_same_dtype(what: str, output: torch.Tensor, input: torch.Tensor) -> None:
    if output.dtype != input.dtype:
        raise TypeError(f"HorovodTransport.{what} needs input and output of one dtype; got "
                        f"{input.dtype} and {output.dtype}")


def _check_cpu_contiguous(what: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device.type != "cpu":
            raise ValueError(f"HorovodTransport.{what}: {name} is on {t.device}; this transport "
                             f"moves CPU tensors (copy it with .cpu() first)")
        if not t.is_contiguous():
            raise ValueError(f"HorovodTransport.{what}: {name} is not contiguous; "
                             f"pass tensor.contiguous()")


class HorovodTransport(Transport):
    """Collectives of one Horovod process set, on CPU tensors.

    Args:
        process_set: a ``horovod.torch.ProcessSet`` (already registered with
            Horovod), or None for the global set of all ranks.

    Calls ``hvd.init()`` if Horovod is not initialized yet (horovodrun, in
    either ``--gloo`` or ``--mpi`` mode, provides what it needs). Ranks and
    ``root`` arguments are ranks inside the process set, like every Transport;
    they are mapped to Horovod's global ranks here where Horovod wants those.

    Example:
        >>> t = HorovodTransport()                # under `horovodrun -np 2 --gloo ...`
        >>> x = torch.full((4,), float(t.rank))
        >>> t.allreduce(x)                        # x == [1., 1., 1., 1.] on both ranks
    """

    name = "horovod"
    widened = {"allreduce": _REDUCE_VIA, "broadcast": _REDUCE_VIA}

    def __init__(self, process_set=None):
        hvd = import_horovod()
        if not hvd.is_initialized():
            hvd.init()
        self._hvd = hvd
        ps = hvd.global_process_set if process_set is None else process_set
        if getattr(ps, "process_set_id", None) is None:
            raise ValueError(f"process_set {ps} is not registered with Horovod; pass it to "
                             f"hvd.init(process_sets=[...]) or hvd.add_process_set() first")
        if not ps.included():
            raise ValueError(f"this process (Horovod rank {hvd.rank()}) is not a member of "
                             f"process_set {ps}; only members build its transport")
        self.process_set = ps
        self.rank = ps.rank()
        self.size = ps.size()
        # Global Horovod rank of each group rank (broadcast's root is global in Horovod).
        self._global_ranks = list(ps.ranks)
        self.device = torch.device("cpu")
        # Op names: "cgx.ps<set>.t<transport>.<op>.<n>". Every rank creates its
        # transports and issues its ops in the same order, so the names agree
        # across ranks; they never repeat, so they are unique while outstanding,
        # as Horovod requires.
        serial = _TRANSPORTS_PER_SET.get(ps.process_set_id, 0)
        _TRANSPORTS_PER_SET[ps.process_set_id] = serial + 1
        self._name_prefix = f"cgx.ps{ps.process_set_id}.t{serial}."
        self._ids = itertools.count()

    def _name(self, kind: str) -> str:
        return f"{self._name_prefix}{kind}.{next(self._ids)}"

    def _finish(self, handle, then, async_op: bool) -> Optional[Work]:
        work = _HorovodWork(self._hvd, handle, then)
        if async_op:
            return work
        work.wait()
        return None

    # -- collectives ----------------------------------------------------------

    def alltoall(self, output, input, async_op=False):
        _check_cpu_contiguous("alltoall", output=output, input=input)
        _check_same_dtype("alltoall", output, input)
        _check_dtype(input, _MOVE_DTYPES, "alltoall")
        if input.numel() != output.numel() or input.numel() % self.size:
            raise ValueError(f"alltoall needs input and output of the same size, a multiple of "
                             f"the group size {self.size}; got {input.numel()} and "
                             f"{output.numel()}")
        handle = self._hvd.alltoall_async(input.reshape(-1), name=self._name("alltoall"),
                                          process_set=self.process_set)

        def then(result):
            received, _splits = result
            output.view(-1).copy_(received.view(-1))

        return self._finish(handle, then, async_op)

    def allgather(self, output, input, async_op=False):
        _check_cpu_contiguous("allgather", output=output, input=input)
        _check_same_dtype("allgather", output, input)
        _check_dtype(input, _MOVE_DTYPES, "allgather")
        if output.numel() != self.size * input.numel():
            raise ValueError(f"allgather output must hold size * len(input) = "
                             f"{self.size} * {input.numel()} elements; got {output.numel()}")
        # Horovod concatenates along dim 0: flat inputs give the rank-ordered concatenation.
        handle = self._hvd.allgather_async(input.reshape(-1), name=self._name("allgather"),
                                           process_set=self.process_set)

        def then(result):
            output.view(-1).copy_(result.view(-1))

        return self._finish(handle, then, async_op)

    def allreduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        if not isinstance(op, ReduceOp):
            raise ValueError(f"unsupported reduce op {op!r}; expected a cgx ReduceOp")
        _check_cpu_contiguous("allreduce", tensor=tensor)
        hvd = self._hvd
        hvd_op = {ReduceOp.SUM: hvd.Sum, ReduceOp.AVERAGE: hvd.Sum, ReduceOp.MIN: hvd.Min,
                  ReduceOp.MAX: hvd.Max, ReduceOp.PRODUCT: hvd.Product}[op]
        via = _REDUCE_VIA.get(tensor.dtype)
        if via is None:
            _check_dtype(tensor, _REDUCE_DTYPES, "allreduce")
        buf = tensor if via is None else tensor.to(via)  # hidden cost: a converted copy
        handle = hvd.allreduce_async_(buf, name=self._name("allreduce"), op=hvd_op,
                                      process_set=self.process_set)

        def then(_result):
            if op is ReduceOp.AVERAGE:
                # Sum, then scale by cgx's one rule: the same bits on every transport.
                scale_(buf, 1.0 / self.size)
            if buf is not tensor:
                tensor.copy_(buf)

        return self._finish(handle, then, async_op)

    def broadcast(self, tensor, root, async_op=False):
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root={root} is not a rank of this group "
                             f"(size {self.size})")
        _check_cpu_contiguous("broadcast", tensor=tensor)
        via = _REDUCE_VIA.get(tensor.dtype)
        if via is None:
            _check_dtype(tensor, _MOVE_DTYPES, "broadcast")
        buf = tensor if via is None else tensor.to(via)
        handle = self._hvd.broadcast_async_(buf, root_rank=self._global_ranks[root],
                                            name=self._name("broadcast"),
                                            process_set=self.process_set)
        then = None if buf is tensor else (lambda _result: tensor.copy_(buf))
        return self._finish(handle, then, async_op)

    def sendrecv(self, send, dst, recv, src, async_op=False):
        for what, peer in (("dst", dst), ("src", src)):
            if not 0 <= peer < self.size:
                raise ValueError(f"sendrecv {what}={peer} is not a rank of this group "
                                 f"(size {self.size})")
        _check_cpu_contiguous("sendrecv", send=send, recv=recv)
        _check_dtype(send, _MOVE_DTYPES, "sendrecv (alltoall)")
        _check_same_dtype("sendrecv", recv, send)
        # Only ``dst`` gets bytes; everyone else gets an empty slice.
        splits = torch.zeros(self.size, dtype=torch.int32)
        splits[dst] = send.numel()
        handle = self._hvd.alltoall_async(send.reshape(-1), splits=splits,
                                          name=self._name("sendrecv"),
                                          process_set=self.process_set)

        def then(result):
            received, received_splits = result
            got = received_splits.tolist()
            expected = [recv.numel() if r == src else 0 for r in range(self.size)]
            if got != expected:
                raise CollectiveMismatchError(
                    f"sendrecv on rank {self.rank} expected {recv.numel()} elements from rank "
                    f"{src} only, received per rank {got}: ranks disagree on the ring")
            recv.view(-1).copy_(received)

        return self._finish(handle, then, async_op)

    def barrier(self):
        self._hvd.barrier(process_set=self.process_set)

    def split(self, groups: Sequence[Sequence[int]]) -> "HorovodTransport":
        """Sub-transport of this rank's group; every rank passes the same ``groups``.

        Horovod registers process sets collectively over all of its ranks, so
        only the transport of the global set can be split.
        """
        seen = sorted(r for g in groups for r in g)
        if seen != list(range(self.size)):
            raise ValueError(f"split groups {list(map(list, groups))} must partition ranks "
                             f"0..{self.size - 1} exactly once")
        if self.process_set.process_set_id != 0:
            raise CGXError(
                "HorovodTransport.split() works on the transport of Horovod's global process set "
                "only: Horovod registers process sets with a call on all of its ranks. Split the "
                "world transport into all the groups you need instead.")
        hvd = self._hvd
        registered = _registered_process_sets(hvd)
        mine = None
        for group in groups:
            ranks = sorted(self._global_ranks[r] for r in group)
            if ranks == sorted(self._global_ranks):
                ps = self.process_set
            else:
                ps = registered.get(tuple(ranks))
            if ps is None:
                try:
                    ps = hvd.add_process_set(ranks)  # collective over all ranks, same order
                except ValueError as e:
                    if "HOROVOD_DYNAMIC_PROCESS_SETS" not in str(e):
                        raise
                    raise CGXError(
                        f"HorovodTransport.split({[list(g) for g in groups]}) needs new Horovod "
                        f"process sets, which Horovod only adds at run time with "
                        f"HOROVOD_DYNAMIC_PROCESS_SETS=1 set for every rank (hierarchical "
                        f"compression on Horovod needs it), or pass them to "
                        f"hvd.init(process_sets=...) before cgx starts") from e
            if self.rank in group:
                mine = ps
        return HorovodTransport(mine)


def _registered_process_sets(hvd) -> dict:
    """Process sets Horovod already knows, by their sorted global ranks.

    Uses Horovod's internal id table (stable in 0.2x); an empty dict if it is not there,
    which only means that ``split`` tries ``add_process_set`` for every group.
    """
    basics = getattr(getattr(hvd, "mpi_ops", None), "_basics", None)
    table = getattr(basics, "_get_process_set_ids_and_ranks", None)
    if table is None:
        return {}
    from horovod.common.process_sets import _temp_process_set_object
    out = {}
    for ps_id, ranks in table().items():
        if ps_id == 0:
            continue
        ps = _temp_process_set_object(ps_id)
        ps.ranks = sorted(ranks)
        out[tuple(ps.ranks)] = ps
    return out
