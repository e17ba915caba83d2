"""``sync_every="auto"``: the smallest H whose outer exchanges hide behind H inner steps.

Each round, every fragment's outer gradient crosses the link once. With the planner's
alpha-beta model of the link (:mod:`cgx.policy.planner.costs`: the bytes SRA or an exact
allreduce puts on the wire, the quantizer's throughput), one round of exchanges takes
``sum(fragment seconds)``; H inner steps take ``H * step_s``. The smallest H with
``H * step_s >= sum(fragment seconds)`` keeps the link busy at most all the time, so
no exchange queues behind the previous round's; with ``delay >= 1`` each fragment's
exchange overlaps the inner steps instead of stalling one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

from cgx.policy.planner.costs import CostModel, OptionMaker, TensorProfile

MAX_SYNC_EVERY = 1000  # DiLoCo's results reach H = 500; beyond, quality drops
# With an outer optimizer, "auto" takes at least DiLoCo's usual H: a round of a few steps
# applies the outer Nesterov momentum on top of the inner optimizer's own, almost every
# step (measured on the project's LM at 100 Mbit/s: H = 1 ended at loss 4.29 after 600
# steps, H = 50 at 3.34). A link fast enough for H < 50 suits per-step compression
# (``DistributedOptimizer``) better.
MIN_OUTER_SYNC_EVERY = 50


@dataclasses.dataclass(frozen=True)
class RoundChoice:
    """What ``"auto"`` chose and from what.

    Attributes:
        sync_every: H.
        step_s: the inner step time it planned with (the slowest rank's median).
        fragment_s: the predicted seconds of each fragment's exchange.
        exposed_s: predicted seconds per round the inner steps wait for the link.
    """

    sync_every: int
    step_s: float
    fragment_s: tuple
    exposed_s: float


def exchange_seconds(numels: Sequence[int], specs: Sequence, model: CostModel) -> float:
    """Predicted seconds of one fused exchange of tensors of ``numels`` elements, each
    quantized by its spec (SRA) or exact (None)."""
    wire: dict = {}
    cpu = 0.0
    for n, spec in zip(numels, specs):
        maker = OptionMaker(model, bits=(spec.bits,) if spec is not None else (4,),
                            families=("exact", "sra"))
        options = maker(TensorProfile("t", int(n), 0.0),
                        bucket=spec.bucket_size if spec is not None else 1024)
        want = "exact" if spec is None or model.world == 1 else f"sra-{spec.bits}bit"
        opt = next(o for o in options if o.name == want)
        cpu += opt.compress_s + opt.decompress_s
        for kind, nbytes in opt.wire:
            wire[kind] = wire.get(kind, 0) + nbytes
    return cpu + sum(model.comm(kind, b) for kind, b in wire.items())


def choose_sync_every(fragment_s: Sequence[float], step_s: float, *, fragments: int = 1,
                      delay: int = 0, max_sync_every: int = MAX_SYNC_EVERY,
                      min_sync_every: int = 1) -> int:
    """The smallest H, at least ``fragments``, ``delay + 1`` and ``min_sync_every``, with
    ``H * step_s >= sum(fragment_s)``; at most ``max_sync_every``.

    Example::

        >>> choose_sync_every([1.2, 1.0], step_s=0.1, fragments=2)
        22
    """
    if not step_s > 0:
        raise ValueError(f"the inner step time must be > 0 s, got {step_s!r}")
    low = max(1, fragments, delay + 1, min_sync_every)
    need = math.ceil(sum(fragment_s) / step_s - 1e-9)
    return int(min(max(low, need), max(low, max_sync_every)))


def link_of(transport, world: int, assume_gbit: Optional[float]) -> CostModel:
    """The link: ``assume_gbit`` Gbit/s, or measured on ``transport`` (a collective: every
    rank calls it; small sizes, so that a slow link measures in seconds)."""
    if assume_gbit is not None or world == 1:
        return CostModel.uniform(world, float(assume_gbit or 10.0))
    from cgx.policy.planner.calibration import link_model
    return CostModel(world, link_model(transport, sizes=(1 << 12, 1 << 20), reps=2))


def choose_for(loop, step_s: float) -> RoundChoice:
    """H for an :class:`cgx.diloco.loop.OuterLoop` whose inner steps took ``step_s`` here:
    the ranks agree on the slowest step and on the link, on the engine thread."""
    from cgx import session
    import torch
    from cgx.comm.base import ReduceOp

    def measure():
        tr = session.reducer_of(loop.group).transport
        t = torch.tensor([float(step_s)], dtype=torch.float64, device=tr.device)
        if tr.size > 1:
            tr.allreduce(t, ReduceOp.MAX)
        return float(t.item()), link_of(tr, tr.size, loop.config.assume_gbit)

    slowest, model = session.run(measure, label=f"{loop.label}.calibrate")
    specs = loop.plan.specs
    frag = tuple(exchange_seconds([loop.numels[i] for i in g], [specs[i] for i in g], model)
                 for g in loop.schedule.groups)
    cfg = loop.config
    h = choose_sync_every(frag, max(slowest, 1e-6), fragments=cfg.fragments, delay=cfg.delay,
                          min_sync_every=1 if cfg.outer_optimizer is None
                          else MIN_OUTER_SYNC_EVERY)
    # delay 0: the step that starts an exchange waits for all of it; else what the
    # delay's inner steps do not cover.
    exposed = sum(max(0.0, s - cfg.delay * slowest) for s in frag)
    return RoundChoice(h, slowest, frag, exposed)
