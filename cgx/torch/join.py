"""``hvd.join()`` for torch: a rank out of data takes part, with zeros, in the other ranks'
optimizer steps and functional allreduces until every rank has joined.

Each ``DistributedOptimizer`` step starts with one status collective
(:func:`status_exchange`); a joined rank answers it from :func:`join_world` and shadows
the step of the optimizer named in it (``shadow_step``), found in this module's registry.
"""

from __future__ import annotations

import weakref

import torch

from cgx import runtime, session
from cgx.collectives import joining
from cgx.comm.base import ReduceOp
from cgx.comm.consistency import Signature
from cgx.errors import CGXError
from cgx.ops import answer_joined
from cgx.session import reducer_of

# registry id -> the DistributedOptimizer: whose step a joined rank shadows.
_optimizers: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(opt_id: int, optimizer) -> None:
    """Make ``optimizer`` (with its ``shadow_step``) the one a joined rank shadows for
    ``opt_id``."""
    _optimizers[opt_id] = optimizer


def status_exchange(opt_id: int, sig: "Signature | None" = None, group=None) -> int:
    """Per-step status collective: the largest optimizer id stepping now (0: everyone joined).

    It also checks, at no extra cost, that every stepping rank has the same bucket
    layout (the exchange carries the step's signature digest; a joined rank adds
    neutral values). On a difference every rank raises the same
    :class:`CollectiveMismatchError`, naming what differs. See ``cgx.collectives.joining``.
    """
    tr = reducer_of(group).transport
    sig = sig if runtime.config().check_consistency else None
    return joining.exchange(tr, opt_id, sig, recoverable=False).what


def join_world() -> int:
    """``hvd.join()``: take part in the other ranks' optimizer steps and functional allreduces
    (with zeros) until every rank has joined.

    Returns:
        The rank that joined last (the highest one if several joined at the same point).
    """
    if runtime.size() == 1:
        return 0
    shadowed = 0
    while True:
        status = session.run(lambda: joining.exchange(reducer_of(None).transport,
                                                      joining.JOINED), label="step-status")
        if status.what == joining.JOINED:
            break
        shadowed += 1
        if status.what == joining.ALLREDUCE:
            session.run(answer_joined, status.root, label="joined-allreduce")
            continue
        if status.what == joining.OTHER:
            continue  # refused on the other ranks (see cgx.ops.check)
        opt = _optimizers.get(status.what)
        if opt is None:
            raise CGXError(f"another rank is stepping DistributedOptimizer #{status.what}, "
                           "which this rank does not have; create the same optimizers on "
                           "every rank")
        opt.shadow_step()
    # The last to join found everyone joined at once: it took part in nothing.
    return session.run(_max_rank, shadowed == 0, label="join-last")


def _max_rank(candidate: bool) -> int:
    tr = session.reducer().transport
    t = torch.tensor([tr.rank if candidate else -1], dtype=torch.int64, device=tr.device)
    tr.allreduce(t, ReduceOp.MAX)
    return int(t.item())
