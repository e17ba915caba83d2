"""cgx's collectives over a torchft ``ProcessGroup``: the group of the replica groups in
this step's quorum, which torchft's ``Manager`` reconfigures when the quorum changes.

torchft's process groups are not registered with ``torch.distributed`` (they are made
again for every quorum), so this transport calls their methods directly with c10d's
option objects, where :class:`cgx.comm.torch_dist.TorchTransport` calls
``torch.distributed``'s functions.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp as C10dOp
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions,
                                                AllToAllOptions, BarrierOptions,
                                                BroadcastOptions)

from cgx.comm.base import ReduceOp, Transport, scale_
from cgx.comm.torch_dist import _TorchWork

_OPS = {ReduceOp.SUM: C10dOp.SUM, ReduceOp.AVERAGE: C10dOp.SUM, ReduceOp.MIN: C10dOp.MIN,
        ReduceOp.MAX: C10dOp.MAX, ReduceOp.PRODUCT: C10dOp.PRODUCT}
# Gloo has no int16 kernels: reduce a wider copy, move raw bytes.
_WIDEN = {torch.int16: torch.int32}


def _done(work, async_op: bool, then=None):
    w = _TorchWork([work], then=then)
    if async_op:
        return w
    w.wait()
    return None


class TorchftTransport(Transport):
    """The collectives of one torchft ``ProcessGroup`` as configured for one quorum.

    Args:
        pg: the manager's process group (``manager._pg``), configured.
        device: the tensors' device (CPU for ``ProcessGroupGloo``).
        quorum_id: the quorum it was configured for (for messages).
    """

    widened = {"allreduce": _WIDEN}

    def __init__(self, pg, device: torch.device | str = "cpu", quorum_id: int = -1):
        self.pg = pg
        # torchft's wrapper keeps the rank of its own construction (0); the group it
        # configured for this quorum has the real one
        configured = getattr(pg, "parent", pg)
        self.rank, self.size = configured.rank(), configured.size()
        self.device = torch.device(device)
        self.quorum_id = quorum_id
        self.name = f"torchft-{pg.getBackendName()}"

    def alltoall(self, output, input, async_op=False):
        work = self.pg.alltoall_base(output, input, [], [], AllToAllOptions())
        return _done(work, async_op)

    def allgather(self, output, input, async_op=False):
        parts = list(output.view(self.size, -1).unbind(0))
        flat = input.reshape(-1)
        work = self.pg.allgather([parts], [flat], AllgatherOptions())
        return _done(work, async_op)

    def allreduce(self, tensor, op=ReduceOp.SUM, async_op=False):
        if op not in _OPS:
            raise ValueError(f"unsupported reduce op {op!r}; expected a cgx ReduceOp")
        opts = AllreduceOptions()
        opts.reduceOp = _OPS[op]
        via = _WIDEN.get(tensor.dtype)
        buf = tensor if via is None else tensor.to(via)
        work = self.pg.allreduce([buf], opts)

        def then():
            if op is ReduceOp.AVERAGE:
                scale_(buf, 1.0 / self.size)
            if buf is not tensor:
                tensor.copy_(buf)

        return _done(work, async_op, then)

    def broadcast(self, tensor, root, async_op=False):
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast root={root} is not a rank of this group (size "
                             f"{self.size})")
        opts = BroadcastOptions()
        opts.rootRank = root
        buf = tensor.view(torch.uint8) if tensor.dtype in _WIDEN and tensor.is_contiguous() \
            else tensor
        return _done(self.pg.broadcast([buf], opts), async_op)

    def sendrecv(self, send, dst, recv, src, async_op=False):
        works = [self.pg.send([send], dst, 0), self.pg.recv([recv], src, 0)]
        w = _TorchWork(works)
        if async_op:
            return w
        w.wait()
        return None

    def barrier(self):
        self.pg.barrier(BarrierOptions()).wait()

    def split(self, groups):
        raise NotImplementedError("a torchft replica group's transport has no sub-groups")
