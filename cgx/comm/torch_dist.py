"""Transport on torch.distributed: Gloo for CPU tensors, NCCL for CUDA tensors.

The process group must already be initialized (``cgx.init()`` does it, or the
user did with ``torch.distributed.init_process_group``).
"""

from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from cgx.comm.base import ReduceOp, Transport, Work, scale_

# Gloo has no int16 kernels ("Invalid scalar type"): reduce a wider copy, move raw bytes.
_REDUCE_VIA = {torch.int16: torch.int32}

# torch 2.13 names the one-tensor collectives all_gather_single and reduce_scatter_single
# (and deprecates the old names); earlier releases have only all_gather_into_tensor and
# reduce_scatter_tensor, with the same arguments.
def one_tensor_collectives(d=dist) -> tuple:
    """(all-gather, reduce-scatter) of one tensor each way, in ``d``'s names."""
    return (getattr(d, "all_gather_single", None) or d.all_gather_into_tensor,
            getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor)


all_gather_single, reduce_scatter_single = one_tensor_collectives()

_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}


class _TorchWork(Work):
    """Wraps torch.distributed Work handles; runs ``then`` once after they finish."""

    def __init__(self, works, then=None):
        self._works = [w for w in works if w is not None]
        self._then = then
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        for w in self._works:
            w.wait()
        self._done = True
        if self._then is not None:
            self._then()

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


class TorchTransport(Transport):
    """Collectives of one torch.distributed process group.

    Args:
        group: the process group (None: the default, world group).
        device: device of the tensors this transport takes; default ``cuda``
            (current device) for NCCL groups, else ``cpu``.
        owns_group: ``close()`` destroys ``group`` (a group made for this transport).
        timeout_s: timeout of the sub-groups ``split()`` creates (None: torch's default).
    """

    widened = {"allreduce": _REDUCE_VIA}

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device | str] = None, owns_group: bool = False,
                 timeout_s: Optional[float] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("TorchTransport needs an initialized torch.distributed process "
                               "group: call cgx.init() or torch.distributed.init_process_group()")
        self.group = group
        self.timeout_s = timeout_s
        self.owns_group = owns_group and group is not None
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device())
                      if self.backend == "nccl" else torch.device("cpu"))
        self.device = torch.device(device)
        self.name = f"torch-{self.backend}"

    # -- collectives ----------------------------------------------------------

    def alltoall(self, output, input, async_op=False):
        work = dist.all_to_all_single(output, input, group=self.group, async_op=async_op)
        return _TorchWork([work]) if async_op else None

    def allgather(self, output, input, async_op=False):
        work = all_gather_single(output, input, group=self.group, async_op=async_op)
        return _TorchWork([work]) if async_op else None

    def allreduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        # Gloo has no AVG, and NCCL's AVG would differ from Gloo's sum/size in the
        # last bit: every backend sums, then scales by cgx's one rule (scale_).
        if op is ReduceOp.AVERAGE:
            top = dist.ReduceOp.SUM
        else:
            try:
                top = _OPS[op]
            except KeyError:
                raise ValueError(f"unsupported reduce op {op!r}; expected a cgx ReduceOp") \
                    from None
        via = _REDUCE_VIA.get(tensor.dtype)
        buf = tensor if via is None else tensor.to(via)  # hidden cost: a converted copy
        work = dist.all_reduce(buf, top, group=self.group, async_op=async_op)

        def then():
            if op is ReduceOp.AVERAGE:
                scale_(buf, 1.0 / self.size)
            if buf is not tensor:
                tensor.copy_(buf)

        if async_op:
            return _TorchWork([work], then=then)
        then()
        return None

    def broadcast(self, tensor, root, async_op=False):
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root={root} is not a rank of this group (size {self.size})")
        buf = tensor.view(torch.uint8) if tensor.dtype in _REDUCE_VIA and \
            tensor.is_contiguous() else tensor
        work = dist.broadcast(buf, group=self.group, group_src=root, async_op=async_op)
        return _TorchWork([work]) if async_op else None

    def sendrecv(self, send, dst, recv, src, async_op=False):
        ops = [dist.P2POp(dist.isend, send, group=self.group, group_peer=dst),
               dist.P2POp(dist.irecv, recv, group=self.group, group_peer=src)]
        work = _TorchWork(dist.batch_isend_irecv(ops))
        if async_op:
            return work
        work.wait()
        return None

    def barrier(self):
        dist.barrier(group=self.group)

    def close(self) -> None:
        """Destroy the group if this transport owns it (joins its engine threads)."""
        if self.owns_group and dist.is_initialized() and self._registered():
            dist.destroy_process_group(self.group)
        self.owns_group = False

    @classmethod
    def twin(cls, group: Optional[dist.ProcessGroup] = None,
             timeout_s: Optional[float] = None) -> "TorchTransport":
        """A transport over a new group of ``group``'s ranks (None: the world), for
        traffic that must never interleave with ``group``'s own: a collective that
        another thread issues on a shared group (DDP's reducer launching its
        unused-parameter map from backward while cgx's engine sends a bucket) is
        matched with the wrong peer call, so the ranks disagree, hang or abort.

        Every member calls this at the same point. For the world, every rank of the
        job calls it (a numbered group); for a sub-group only its members do (a group
        named by its ranks, so one twin per set of ranks and backend: callers share it).
        The transport owns the new group (``close()`` destroys it).
        """
        backend = str(dist.get_backend(group))
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        whole = len(ranks) == dist.get_world_size()
        pg = dist.new_group(ranks=ranks, timeout=timeout, backend=backend,
                            use_local_synchronization=not whole)
        return cls(pg, owns_group=True, timeout_s=timeout_s)

    def _registered(self) -> bool:
        """Is the group still known to torch.distributed (``destroy_process_group()``
        with no argument destroys every group, this one included)?"""
        from torch.distributed.distributed_c10d import _world
        return self.group is None or self.group in _world.pg_map

    def split(self, groups: Sequence[Sequence[int]]) -> "TorchTransport":
        """Sub-transport of this rank's group; every rank passes the same ``groups``."""
        seen = sorted(r for g in groups for r in g)
        if seen != list(range(self.size)):
            raise ValueError(f"split groups {list(map(list, groups))} must partition ranks "
                             f"0..{self.size - 1} exactly once")
        mine = None
        timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
        for g in groups:
            if self.group is None:
                # World group: every rank creates every subgroup, in the same order
                # (torch.distributed's requirement; names come from a shared counter).
                pg = dist.new_group(ranks=list(g), timeout=timeout)
                if self.rank in g:
                    mine = pg
            elif self.rank in g:
                # Sub-group: only members take part (non-members never call).
                global_ranks = [dist.get_global_rank(self.group, r) for r in g]
                mine = dist.new_group(ranks=global_ranks, use_local_synchronization=True,
                                      timeout=timeout)
        return TorchTransport(mine, self.device, owns_group=True, timeout_s=self.timeout_s)
