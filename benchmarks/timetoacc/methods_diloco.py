"""Low-communication methods: DiLoCo through cgx, and PyTorch's post-local SGD.

Names:
    cgx-diloco-h<N>        cgx.torch.DiLoCo, H = N inner steps per outer step (the workload's
                           optimizer inside, Nesterov outer SGD lr 0.7 / momentum 0.9, outer
                           gradients 4-bit with error feedback)
    cgx-diloco-auto        the same, H chosen from the measured link and step time
    cgx-diloco-streaming[-h<N>]  Streaming DiLoCo: H = N (50) in 5 fragments (N if fewer),
                           each exchange overlapping the next inner step
    cgx-diloco-...-followlr  any of the three with ``OuterSGD(follow_inner_lr=True)``: the
                           outer momentum decays with the inner learning rate's schedule
    cgx-localsgd[-streaming][-h<N>]  cgx.torch.DiLoCo with ``outer_optimizer=None``: the
                           ranks' parameter change averaged every N (50) steps through the same
                           4-bit exchange and applied as it is (local SGD; post-local SGD's,
                           compressed); ``-streaming``: in fragments as cgx-diloco-streaming
    torch-postlocal-sgd[-h<N>]  torch.distributed's PostLocalSGDOptimizer with a
                           PeriodicModelAverager (parameters averaged exactly every N = 50
                           steps, no outer optimizer)
    torchft-diloco[-streaming][-h<N>]  torchft's DiLoCo and Streaming DiLoCo, H = N (50),
                           the same outer optimizer, fp32 (benchmarks/timetoacc/methods_torchft.py)

cgx counts its own bytes (``hvd.stats()``); post-local SGD and torchft are counted as one
ring allreduce of every parameter (float32) per averaging. :func:`build` returns the fields
of ``methods.Setup`` (this module is imported by ``methods``, never the reverse).
"""

from __future__ import annotations

import re

from benchmarks.timetoacc import methods_torchft
from benchmarks.timetoacc.counters import cgx_counters, init_cgx, ring_bytes

DILOCO_METHODS = ("cgx-diloco-h50", "cgx-diloco-auto", "cgx-diloco-streaming", "cgx-localsgd",
                  "torch-postlocal-sgd", "torchft-diloco", "torchft-diloco-streaming")
_H = r"[1-9][0-9]*"
_STREAMING_H = r"(?:[2-9]|[1-9][0-9]+)"  # a fragment's exchange overlaps 1 step: H >= 2
_NAME = re.compile(rf"^(?:cgx-diloco-(?:h(?P<h>{_H})|(?P<auto>auto)"
                   rf"|(?P<stream>streaming)(?:-h(?P<sh>{_STREAMING_H}))?)"
                   r"(?P<follow>-followlr)?"
                   rf"|cgx-localsgd(?:(?P<lstream>-streaming)(?:-h(?P<lsh>{_STREAMING_H}))?"
                   rf"|(?:-h(?P<lh>{_H}))?)"
                   rf"|torch-postlocal-sgd(?:-h(?P<ph>{_H}))?)$")
AVERAGING_PERIOD = 50  # steps between averagings of both local SGD methods (no -h<N>)
STREAMING_SYNC_EVERY = 50  # cgx-diloco-streaming's H (no -h<N>)


def _streaming(sync_every: int) -> dict:
    """Streaming's settings: torchft's streaming runs' fragments (fewer when H is smaller)
    and delay, so that the two compare like for like."""
    frag, delay = methods_torchft.STREAMING["fragments"], methods_torchft.STREAMING["delay"]
    return {"sync_every": sync_every, "fragments": min(frag, sync_every), "delay": delay}


def handles(name: str) -> bool:
    """Is ``name`` one of this module's methods?"""
    return _NAME.match(name) is not None or methods_torchft.handles(name)


def build(name: str, model, make_optimizer, world: int) -> dict:
    if methods_torchft.handles(name):
        return methods_torchft.build(name, model, make_optimizer, world)
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"not a low-communication method: {name!r}")
    if name.startswith("torch-postlocal-sgd"):
        return _postlocal(model, make_optimizer, world, int(m.group("ph") or AVERAGING_PERIOD))
    hvd = init_cgx(model)
    if m.group("lstream"):
        kwargs = {**_streaming(int(m.group("lsh") or AVERAGING_PERIOD)), "outer_optimizer": None}
    elif name.startswith("cgx-localsgd"):
        kwargs = {"sync_every": int(m.group("lh") or AVERAGING_PERIOD), "outer_optimizer": None}
    elif m.group("h"):
        kwargs = {"sync_every": int(m.group("h"))}
    elif m.group("auto"):
        kwargs = {"sync_every": "auto"}
    else:
        kwargs = _streaming(int(m.group("sh") or STREAMING_SYNC_EVERY))
    if m.group("follow"):
        kwargs["outer_optimizer"] = hvd.OuterSGD(follow_inner_lr=True)
    opt = hvd.DiLoCo(model, make_optimizer(model.parameters()), **kwargs)
    accounted, compression_seconds = cgx_counters(hvd)

    def plan():
        c = opt.choice
        return None if c is None else (f"H={c.sync_every} from a {c.step_s * 1e3:.1f} ms step "
                                       f"and a {sum(c.fragment_s):.3f} s exchange per round")

    c = opt.config
    return dict(module=model, optimizer=opt, accounted_bytes=accounted,
                compression_seconds=compression_seconds, plan=plan,
                note=f"H={c.sync_every}, {c.fragments} fragment(s), delay {c.delay}"
                     + ("" if c.outer_optimizer else ", plain averaging")
                     + (", outer momentum follows the inner lr"
                        if c.outer_optimizer and c.outer_optimizer.follow_inner_lr else ""))


def _postlocal(model, make_optimizer, world: int, period: int) -> dict:
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    opt = PostLocalSGDOptimizer(make_optimizer(model.parameters()),
                                PeriodicModelAverager(period=period, warmup_steps=0))
    params = sum(p.numel() for p in model.parameters())
    # One ring allreduce of the parameters at steps 0, period, 2 period, ... (torch's rule).
    ring = ring_bytes(4 * params, world)
    return dict(module=model, optimizer=opt,
                accounted_bytes=lambda steps: ring * ((steps - 1) // period + 1 if steps else 0),
                note=f"parameters averaged every {period} steps (fp32)")
