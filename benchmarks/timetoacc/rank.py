"""One rank of one training run (called in every rank by ``SlowNetwork.run_function``)."""

from __future__ import annotations

import copy
import math
import os
import resource
import statistics
import time
from typing import Any

from benchmarks.netsim import link_tx_bytes
from benchmarks.timetoacc import methods, workloads


def _sync(device: str) -> None:
    """Wait for the device's queued work (a step's time on a GPU ends with its kernels)."""
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def _compute_only(work, steps: int, device: str = "cpu") -> float:
    """Median seconds of a forward/backward/update on a copy of the model, no communication."""
    model = copy.deepcopy(work.model)
    opt = work.optimizer(model.parameters())
    times = []
    for s in range(steps):
        batch = work.train_batch(s)
        t0 = time.perf_counter()
        opt.zero_grad()
        work.loss_fn(model, batch).backward()
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] if len(times) > 2 else times)


def has_batch_norm(model) -> bool:
    import torch
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def reestimated(work, fresh, batches: int):
    """``fresh`` (a model of ``work``'s architecture: no hooks of any method on it) holding
    ``work.model``'s parameters, its BatchNorm statistics re-estimated from this rank's first
    ``batches`` training batches (``torch.optim.swa_utils.update_bn``, which resets them
    first, so one ``fresh`` serves every evaluation). ``work.model`` is left as it is."""
    import torch
    fresh.load_state_dict(work.model.state_dict())
    device = next(work.model.parameters()).device
    torch.optim.swa_utils.update_bn([work.train_batch(i)[0] for i in range(batches)],
                                    fresh.to(device), device=device)
    return fresh


def train(method: str, workload: str, steps: int, eval_every: int, seed: int = 0,
          tiny: bool = False, warmup: int = 3, device: str = "cpu",
          bn_batches: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps with ``method``; rank 0 evaluates every ``eval_every`` steps.

    The clock (``train_s``) runs during training steps only: evaluation and the
    barriers around it are left out. ``bn_batches`` > 0: a model with BatchNorm is evaluated
    with its statistics re-estimated from that many of rank 0's training batches (on a
    copy: training goes on with its own), ``loss_running_stats`` keeping the evaluation
    with the running ones; every method alike. ``device="cuda"``: the model on the GPU (every rank
    on the same one; the bytes go over Gloo). Returns this rank's record.
    """
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    work = workloads.make(workload, rank, world, seed, tiny=tiny)
    work.model.to(device)
    compute_s = _compute_only(work, 3 if tiny else 6, device)
    setup = methods.build(method, work.model, work.optimizer, world)
    barrier = setup.barrier or dist.barrier
    curve = []
    fresh = _bn_model(workload, rank, world, seed, tiny, bn_batches, work, setup)
    evaluate = _evaluator(work, setup, rank, world, curve, barrier, fresh, bn_batches)
    barrier()
    evaluate(0, 0.0)
    tx0 = link_tx_bytes()
    clock, times, train_losses = _train_steps(work, setup, steps, eval_every, device, evaluate)
    barrier()
    for point in curve[:-1]:  # the final evaluation's items are kept, for paired comparisons
        point.pop("item_losses", None)
    tx = link_tx_bytes() - tx0
    run = {"method": method, "workload": workload, "device": device, "rank": rank,
           "world": world, "seed": seed, "steps": steps}
    return _record(run, local, work, setup, warmup, compute_s, clock, times, train_losses, tx,
                   curve)


def _bn_model(workload: str, rank: int, world: int, seed: int, tiny: bool, bn_batches: int,
              work, setup):
    """bn_batches: one model of the architecture, re-estimated at each evaluation (else None)."""
    import torch
    if bn_batches and rank == 0 and setup.evaluate is None and has_batch_norm(work.model):
        with torch.random.fork_rng():  # building a model seeds torch's generator
            return workloads.make(workload, rank, world, seed, tiny=tiny).model
    return None


def _evaluator(work, setup, rank: int, world: int, curve: list, barrier, fresh, bn_batches: int):
    """``evaluate(step, clock)``: rank 0 appends the evaluation to ``curve``; all ranks wait."""

    def evaluate(step: int, clock: float) -> None:
        if setup.evaluate is not None:  # a sharded model: every rank takes part
            res = setup.evaluate(work.evaluate)
        elif rank == 0:
            res = work.evaluate(work.model)
            if fresh is not None:
                res = {**work.evaluate(reestimated(work, fresh, bn_batches)),
                       "loss_running_stats": res["loss"]}
        if rank == 0:
            curve.append({"step": step, "train_s": clock, "samples": step * work.samples_per_batch * world,
                          **res})
        barrier()

    return evaluate


def _train_steps(work, setup, steps: int, eval_every: int, device: str, evaluate):
    """The training loop: (seconds in training steps, each step's seconds, each step's loss)."""
    clock, times, train_losses = 0.0, [], []
    # Cosine decay to zero over the run, the same for every method: the final losses are
    # those of a finished schedule, not a snapshot of a noisy middle.
    base_lr = [g["lr"] for g in setup.optimizer.param_groups]
    for step in range(1, steps + 1):
        batch = work.train_batch(step - 1)
        for g, lr in zip(setup.optimizer.param_groups, base_lr):
            g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        t0 = time.perf_counter()
        setup.optimizer.zero_grad()
        loss = work.loss_fn(setup.module, batch)
        loss.backward()
        setup.optimizer.step()
        _sync(device)
        dt = time.perf_counter() - t0
        clock += dt
        times.append(dt)
        train_losses.append(float(loss))
        if step % eval_every == 0 or step == steps:
            evaluate(step, clock)
    return clock, times, train_losses


def _record(run: dict, local: tuple[int, int], work, setup, warmup: int, compute_s: float,
            clock: float, times: list, train_losses: list, tx: int,
            curve: list) -> dict[str, Any]:
    """This rank's record of the run (closes ``setup``); ``local``: (local rank, local size)."""
    local_rank, local_size = local
    steps, world = run["steps"], run["world"]
    accounted = setup.accounted_bytes(steps)
    compression = setup.compression_seconds()
    plan = setup.plan()
    setup.close()
    timed = times[warmup:] if len(times) > warmup else times
    step_s = statistics.mean(timed)
    return {
        **run,
        "samples_per_step": work.samples_per_batch * world,
        "samples_trained": steps * work.samples_per_batch * world,
        "params": sum(p.numel() for p in work.model.parameters()),
        "step_s": step_s, "compute_s": compute_s,
        "compression_s": compression / steps,
        "exposed_comm_s": max(0.0, step_s - compute_s - compression / steps),
        "train_s": clock, "samples_per_s": work.samples_per_batch * world / step_s,
        # The host's link is shared by its ranks: each gets its share.
        "link_bytes_per_step": tx / steps / local_size if local_rank == 0 else None,
        "accounted_bytes_per_step": accounted / steps,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "train_loss_finite": all(math.isfinite(v) for v in train_losses),
        "curve": curve, "plan": plan, "note": setup.note,
    }
