"""The status exchange that lets ranks which called ``join()`` follow the others' collectives.

Horovod's ``join()``: a rank that ran out of data keeps taking part, with zeros, in the
allreduces the other ranks still issue, until every rank has joined. cgx has no
coordinator to tell a joined rank what comes next, so each collective that may meet a
joined rank starts with one status allreduce (MAX over five int64), the same call on
every rank whatever the collective:

    [what, digest, -digest, joined, root]

* ``what``: :data:`JOINED` (0) from a joined rank; from the others the same code for the
  same collective: a ``DistributedOptimizer``'s registry id (its step begins),
  :data:`ALLREDUCE` (a functional allreduce: its description follows, so that joined
  ranks reduce zeros of the same shapes) or :data:`OTHER` (another functional
  collective, refused while a rank has joined, as in Horovod).
* ``digest, -digest``: the collective's :class:`~cgx.comm.consistency.Signature` digest
  (``CGX_CHECK_CONSISTENCY``), :data:`NEUTRAL` from a joined rank or with the check off:
  the MAX of both gives the largest and the smallest digest, equal when the ranks agree.
* ``joined``: 1 from a joined rank: the MAX says whether any has joined.
* ``root``: the rank itself, -1 from a joined rank: the MAX names the rank that sends
  the description.

The first three fields fold the consistency check into the exchange (no extra call).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cgx.comm.base import ReduceOp, Transport
from cgx.comm.consistency import Signature, describe
from cgx.errors import CollectiveMismatchError

NEUTRAL = -(1 << 62)  # below every -digest: what a rank without a signature adds
JOINED = 0            # what: this rank has called join() and waits for the others
ALLREDUCE = 1 << 61   # what: a functional allreduce (optimizer ids stay far below)
OTHER = ALLREDUCE + 1  # what: any other functional collective


@dataclasses.dataclass(frozen=True)
class Status:
    """What the ranks of a group are about to do.

    Attributes:
        what: the largest code of the exchange (``JOINED`` when every rank has joined).
        joined: some rank of the group has called ``join()``.
        root: the highest rank that has not joined (-1 when all have).
    """

    what: int
    joined: bool
    root: int


def exchange(transport: Transport, what: int, sig: Optional[Signature] = None, *,
             recoverable: bool = True) -> Status:
    """The status allreduce (every rank of ``transport`` calls it at the same point).

    Args:
        what: this rank's code (module docstring).
        sig: the collective's signature, or None (joined rank, or the check is off).
        recoverable: False when queued work depends on the agreement (optimizer buckets).

    Raises:
        CollectiveMismatchError: on every rank, when the ranks' signatures differ.
    """
    d = None if sig is None else sig.digest()
    here = what == JOINED
    t = torch.tensor([what, NEUTRAL if d is None else d, NEUTRAL if d is None else -d,
                      int(here), -1 if here else transport.rank],
                     dtype=torch.int64, device=transport.device)
    transport.allreduce(t, ReduceOp.MAX)
    hi, lo = int(t[1]), -int(t[2])
    if hi != NEUTRAL and hi != lo:
        sigs = transport.allgather_object(sig)
        raise CollectiveMismatchError(describe(sigs), recoverable=recoverable)
    return Status(int(t[0]), bool(t[3]), int(t[4]))
