"""No wrong results, no silent hangs: the reliability reproductions, on real ranks.

Each test here is a scenario that once went wrong (a dropped imaginary part, a
transport error instead of a mismatch message, a 30-minute hang, residuals
poisoned by one overflow, ...) and now must give the right result or a clear
error on every rank, within seconds.
"""

import math

import pytest
import torch

from distutil import free_port, run_ranks
from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _hvd():
    import cgx.torch as hvd
    hvd.init()
    return hvd


# -- 1. correct or refused, for every dtype and op --------------------------------------

def _dtype_rules(rank, world):
    hvd = _hvd()
    out = {}
    a = torch.tensor([3 + 5j, 1 + 1j]) if rank == 0 else torch.tensor([5 + 5j, 3 + 3j])
    out["complex_avg"] = hvd.allreduce(a, op=hvd.Average).tolist()
    out["complex_sum_grouped"] = [t.tolist() for t in
                                  hvd.grouped_allreduce([a, a * 2], op=hvd.Sum)]
    b = a.clone()
    hvd.allreduce_(b, op=hvd.Average)
    out["complex_avg_inplace"] = b.tolist()
    try:
        hvd.allreduce(a, op=hvd.Max, name="complex.max")
        out["complex_max"] = "no error"
    except ValueError as e:
        out["complex_max"] = str(e)
    i = torch.tensor([3, -3, 7], dtype=torch.int32) if rank == 0 else \
        torch.tensor([4, -4, 8], dtype=torch.int32)
    out["int_avg"] = hvd.allreduce(i, op=hvd.Average).tolist()
    out["int_avg_async"] = hvd.synchronize(hvd.allreduce_async(i, op=hvd.Average)).tolist()
    out["int_avg_grouped"] = hvd.grouped_allreduce([i, i.to(torch.int64)], op=hvd.Average)[1].tolist()
    out["int_pre"] = hvd.allreduce(i, op=hvd.Sum, prescale_factor=0.5).tolist()
    out["int_post"] = hvd.allreduce(i, op=hvd.Sum, postscale_factor=0.5).tolist()
    for dt in (torch.int16, torch.uint8, torch.int8, torch.bool, torch.float16, torch.bfloat16):
        key = str(dt).replace("torch.", "")
        out[f"sum_{key}"] = hvd.allreduce(torch.ones(3, dtype=dt), op=hvd.Sum).tolist()
        out[f"bcast_{key}"] = hvd.broadcast(torch.full((3,), rank + 1).to(dt), 1).tolist()
    return out


def test_every_dtype_and_op_follows_one_rule():
    outs = run_gloo(_dtype_rules, 2)
    assert outs[0] == outs[1]
    o = outs[0]
    assert o["complex_avg"] == [4 + 5j, 2 + 2j]  # the imaginary part survives
    assert o["complex_avg_inplace"] == [4 + 5j, 2 + 2j]
    assert o["complex_sum_grouped"][1] == [16 + 20j, 8 + 8j]
    assert "complex" in o["complex_max"] and "Sum or Average" in o["complex_max"]
    # Horovod's integer rule: trunc(float64(sum) * (1/size)), toward zero.
    assert o["int_avg"] == o["int_avg_async"] == [3, -3, 7]
    assert o["int_avg_grouped"] == [3, -3, 7]
    assert o["int_pre"] == [1 + 2, -1 - 2, 3 + 4]  # trunc(x * 0.5) per rank, then summed
    assert o["int_post"] == [3, -3, 7]  # trunc(sum * 0.5)
    for key in ("int16", "uint8", "int8", "float16", "bfloat16"):
        assert o[f"sum_{key}"] == [2, 2, 2], key
        assert o[f"bcast_{key}"] == [2, 2, 2], key
    assert o["sum_bool"] == [True] * 3 and o["bcast_bool"] == [True] * 3


def test_scale_rule_unit():
    from cgx.comm.base import scale_
    assert scale_(torch.tensor([7, -7, 5], dtype=torch.int64), 0.5).tolist() == [3, -3, 2]
    assert scale_(torch.tensor([1 + 2j]), 0.5).tolist() == [0.5 + 1j]
    assert scale_(torch.tensor([True, False]), 0.5).tolist() == [True, False]
    assert scale_(torch.tensor([True]), 0.0).tolist() == [False]
    h = torch.tensor([1.0, 3.0], dtype=torch.float16)
    assert scale_(h, 1 / 3).tolist() == torch.tensor([1 / 3, 1.0], dtype=torch.float16).tolist()


# -- 2. mismatches: a clear error on every rank, and the job goes on ---------------------

def _mismatches(rank, world):
    hvd = _hvd()
    from cgx.errors import CollectiveMismatchError
    out = {}
    cases = {
        "shape": lambda: hvd.allreduce(torch.ones(1000 if rank == 0 else 1024), name="grad.w"),
        "dtype": lambda: hvd.allreduce(torch.ones(8, dtype=torch.float32 if rank == 0
                                                  else torch.float64), name="grad.b"),
        "root": lambda: hvd.broadcast(torch.ones(3), root_rank=rank, name="bcast"),
        "order": lambda: hvd.allreduce(torch.ones(4), name=f"metric{rank}"),
        "op": lambda: hvd.allreduce(torch.ones(4), name="m", op=hvd.Sum if rank else hvd.Max),
        "allgather": lambda: hvd.allgather(torch.ones(2, 3 + rank), name="gather"),
        "compression": lambda: hvd.allreduce(
            torch.ones(4096), name="q", compression=hvd.Compression.quantize(bits=4 + 2 * rank)),
    }
    # An argument error found on the engine thread fails that call only, on every rank.
    try:
        hvd.alltoall(torch.ones(6, 2), splits=[1, 1], name="bad.splits")
        out["argument"] = "no error"
    except ValueError as e:
        out["argument"] = str(e)
    out["argument.after"] = hvd.allreduce(torch.ones(2), name="argument.ok").tolist()
    for key, fn in cases.items():
        try:
            fn()
            out[key] = "no error"
        except CollectiveMismatchError as e:
            out[key] = str(e)
        # The job goes on after a mismatch, as with Horovod.
        out[key + ".after"] = hvd.allreduce(torch.full((2,), float(rank)), name=key + ".ok").tolist()
    return out


def test_mismatches_raise_on_every_rank_naming_both_sides():
    outs = run_gloo(_mismatches, 2, timeout=120)
    assert outs[0] == outs[1]  # the same message on every rank
    o = outs[0]
    assert "grad.w" in o["shape"] and "rank 0 has (1000,)" in o["shape"] and \
        "rank 1 has (1024,)" in o["shape"]
    assert "grad.b" in o["dtype"] and "float32" in o["dtype"] and "float64" in o["dtype"]
    assert "root_rank: rank 0 has 0, rank 1 has 1" in o["root"]
    assert "metric0" in o["order"] and "metric1" in o["order"] and "order" in o["order"]
    assert "op: rank 0 has Max, rank 1 has Sum" in o["op"]
    assert "gather" in o["allgather"] and "(3,)" in o["allgather"] and "(4,)" in o["allgather"]
    assert "bits=4" in o["compression"] and "bits=6" in o["compression"]
    for key in ("shape", "dtype", "root", "order", "op", "allgather", "compression"):
        assert o[key + ".after"] == [0.5, 0.5], key
    assert "splits must hold 2 non-negative counts summing to the first dimension (6)" in \
        o["argument"] and o["argument.after"] == [1.0, 1.0]


def _optimizer_mismatch(rank, world):
    hvd = _hvd()
    from cgx.errors import CGXError, CollectiveMismatchError
    model = torch.nn.Linear(8, 4 + rank)  # a different model on each rank
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    model(torch.ones(2, 8)).sum().backward()
    out = {}
    try:
        opt.step()
        out["step"] = "no error"
    except CollectiveMismatchError as e:
        out["step"] = str(e)
    try:  # the buckets queued behind the check never ran: cgx stopped for good
        hvd.allreduce(torch.ones(2), name="later")
        out["later"] = "no error"
    except CGXError as e:
        out["later"] = type(e).__name__
    return out


def test_optimizer_layout_mismatch_is_named_not_a_transport_error():
    outs = run_gloo(_optimizer_mismatch, 2)
    for o in outs:
        assert "DistributedOptimizer" in o["step"] and "shapes" in o["step"] and \
            "(4, 8)" in o["step"] and "(5, 8)" in o["step"], o["step"]
        assert o["later"] == "CGXError"


def _rank_env(world, port, extra=None):
    def env(rank):
        e = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)}
        e.update((extra or {}).get(rank, {}))
        return e
    return env


def test_differing_settings_fail_at_init_on_every_rank():
    code = """
        import cgx
        from cgx.errors import ConfigError
        try:
            cgx.init()
            report({"error": None})
        except ConfigError as e:
            report({"error": str(e)})
    """
    res = run_ranks(code, nprocs=2, launcher="env", timeout=60, rank_env=_rank_env(
        2, free_port(), {1: {"CGX_COMPRESSION_QUANTIZATION_BITS": "8"}}))
    outs = res.check()
    for o in outs:
        assert o["error"] and "CGX_COMPRESSION_QUANTIZATION_BITS: rank 0 has 4, rank 1 has 8" \
            in o["error"], o


# -- 3. stalls and deaths ------------------------------------------------------------------

STALL_CODE = """
    import os, sys, time, torch
    import cgx.torch as hvd
    hvd.init()
    r = hvd.rank()
    mode = sys.argv[1]
    out = {"rank": r}
    for step in range(4):
        if step == 2 and r == 2:
            if mode == "stall":
                time.sleep(14)  # longer than CGX_TIMEOUT_S below
            else:
                os._exit(9)
        t0 = time.time()
        try:
            hvd.allreduce(torch.ones(10), name=f"step{step}")
        except Exception as e:
            out.update(error=f"{type(e).__name__}: {e}", seconds=time.time() - t0)
            t1 = time.time()
            try:
                hvd.allreduce(torch.ones(10), name="again")
            except Exception as e2:
                out.update(later=type(e2).__name__, later_seconds=time.time() - t1)
            break
    report(out)
"""


@pytest.mark.parametrize("mode", ["stall", "kill"])
def test_stalled_or_dead_rank_is_named_within_the_timeout(mode, tmp_path):
    script = tmp_path / "stall.py"
    import textwrap
    script.write_text("from distutil import report\n" + textwrap.dedent(STALL_CODE))
    res = run_ranks(path=str(script), args=[mode], nprocs=3, launcher="env", timeout=90,
                    env={"CGX_STALL_WARNING_S": "2", "CGX_TIMEOUT_S": "8"},
                    rank_env=_rank_env(3, free_port()), keep_going=True)
    assert not res.timed_out, res.tail()
    survivors = [o for o in res.outputs[:2]]
    assert all(o is not None for o in survivors), res.tail()
    for o in survivors:
        assert o.get("error"), (o, res.tail())
        assert "rank 2" in o["error"], o["error"]
        assert o["seconds"] < 8 + 10, o  # within the timeout (+ the dead-peer grace)
        assert o["later"] == "CommunicationError" and o["later_seconds"] < 1.0, o  # failed for good
    if mode == "stall":
        assert "have not submitted 'step2'" in survivors[0]["error"]
        assert "WARNING: collective 'step2'" in res.stderr and "rank 2" in res.stderr
    else:
        assert res.outputs[2] is None


# -- 4. per-rank state stays per-rank; AMP overflows do not poison anything ---------------------

def _ef_overflow(rank, world):
    hvd = _hvd()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.quantize(bits=4, error_feedback=True))
    finite = []
    for step in range(6):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = model(torch.randn(8, 64, generator=g)).pow(2).mean()
        if step == 2 and rank == 1:
            loss = loss * float("inf")
        loss.backward()
        opt.synchronize()
        ok = all(torch.isfinite(p.grad).all() for p in model.parameters())
        finite.append(bool(ok))
        with opt.skip_synchronize():
            if ok:  # the AMP recipe: a non-finite step is skipped
                opt.step()
    res = opt._plan.residuals.residuals
    return {"finite": finite, "residuals_finite": all(bool(torch.isfinite(e).all())
                                                      for e in res.values()),
            "params": [p.detach().clone() for p in model.parameters()]}


def test_one_overflow_does_not_poison_error_feedback():
    outs = run_gloo(_ef_overflow, 2)
    for o in outs:
        assert o["finite"] == [True, True, False, True, True, True]
        assert o["residuals_finite"]
    for p, q in zip(outs[0]["params"], outs[1]["params"]):
        assert torch.equal(p, q)


def _grad_scaler(rank, world, comp):
    hvd = _hvd()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    compression = hvd.Compression.fp16 if comp == "fp16" else \
        hvd.Compression.quantize(bits=8, error_feedback=True)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    log = []
    for step in range(4):
        opt.zero_grad()
        before = [p.detach().clone() for p in model.parameters()]
        g = torch.Generator().manual_seed(step * 10 + rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=comp == "fp16"):
            loss = model(torch.randn(8, 16, generator=g)).float().pow(2).mean()
        if step == 1 and rank == 0:
            loss = loss * float("inf")  # inf gradients on this rank only
        scaler.scale(loss).backward()
        # No synchronize(): GradScaler must still see the reduced gradients.
        scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((moved, scaler.get_scale()))
    return {"log": log, "params": [p.detach() for p in model.parameters()]}


@pytest.mark.parametrize("comp", ["quantize8_ef", "fp16"])
def test_grad_scaler_skips_an_overflow_on_every_rank(comp):
    """torch AMP (autocast + GradScaler) with 8-bit + error feedback, and with Horovod's
    fp16 compression."""
    outs = run_gloo(_grad_scaler, 2, comp)
    assert outs[0]["log"] == outs[1]["log"]
    moved = [m for m, _ in outs[0]["log"]]
    assert moved == [True, False, True, True]
    scales = [s for _, s in outs[0]["log"]]
    assert scales[1] == scales[0] / 2
    for p, q in zip(outs[0]["params"], outs[1]["params"]):
        assert torch.equal(p, q)
        assert torch.isfinite(p).all()


def _broadcast_keeps_residuals(rank, world):
    hvd = _hvd()
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.quantize(bits=2,
                                                                        error_feedback=True))
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()
    mine = {k: v.clone() for k, v in opt._plan.residuals.residuals.items()}
    if rank == 0:
        for group in opt.param_groups:
            group["lr"] = 0.05
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = opt._plan.residuals.residuals
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    return {"kept": all(torch.equal(mine[k], after[k]) for k in mine), "nonzero":
            all(bool(v.abs().sum() > 0) for v in mine.values()),
            "momentum": momentum, "lr": opt.param_groups[0]["lr"],
            "residual": next(iter(mine.values()))}


def test_broadcast_optimizer_state_leaves_per_rank_residuals_alone():
    outs = run_gloo(_broadcast_keeps_residuals, 2)
    for o in outs:
        assert o["kept"] and o["nonzero"] and o["lr"] == 0.05
    assert not torch.equal(outs[0]["residual"], outs[1]["residual"])  # they were different
    for a, b in zip(outs[0]["momentum"], outs[1]["momentum"]):
        assert torch.equal(a, b)  # the shared state did travel


# -- wrong updates in ordinary training code (torch) -----------------------------------------

def _freeze_then_unfreeze(rank, world):
    hvd = _hvd()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    for p in model[0].parameters():
        p.requires_grad_(False)  # staged fine-tuning: the backbone starts frozen
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.exact)
    for step in range(4):
        if step == 2:
            for p in model[0].parameters():
                p.requires_grad_(True)
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_unfrozen_parameters_are_reduced():
    outs = run_gloo(_freeze_then_unfreeze, 2)
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(4):
        for p in ref[0].parameters():
            p.requires_grad_(step >= 2)
        opt.zero_grad()
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + r))
              for r in range(2)]
        ref(torch.cat(xs)).pow(2).mean().backward()
        opt.step()
    for r in range(2):
        for p, q in zip(outs[r], ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)


def _second_optimizer(rank, world):
    hvd = _hvd()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                     named_parameters=model.named_parameters(),
                                     compression=hvd.Compression.exact)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.exact)
    del first
    for step in range(3):
        opt.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + rank)
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_second_optimizer_on_the_same_model_takes_over():
    outs = run_gloo(_second_optimizer, 2)
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(step * 10 + r))
              for r in range(2)]
        ref(torch.cat(xs)).pow(2).mean().backward()
        opt.step()
    for r in range(2):
        for p, q in zip(outs[r], ref.parameters()):
            torch.testing.assert_close(p, q.detach(), rtol=1e-5, atol=1e-6)
    assert not math.isnan(float(outs[0][0].sum()))


# -- Horovod's capability queries ----------------------------------------------------------

def _capabilities(rank, world):
    hvd = _hvd()
    return {f: getattr(hvd, f)() for f in ("mpi_built", "mpi_enabled", "gloo_built",
                                           "gloo_enabled", "nccl_built", "cuda_built",
                                           "rocm_built", "ddl_built", "ccl_built",
                                           "is_homogeneous")}


def test_horovod_capability_queries():
    import importlib.util
    o = run_gloo(_capabilities, 2)[0]
    assert o["gloo_built"] and o["gloo_enabled"] and not o["mpi_enabled"]
    assert o["mpi_built"] == (importlib.util.find_spec("mpi4py") is not None)
    assert o["cuda_built"] == (torch.version.cuda is not None)
    assert o["nccl_built"] == torch.distributed.is_nccl_available()
    assert not o["ddl_built"] and not o["ccl_built"] and not o["rocm_built"]
    assert o["is_homogeneous"]


def test_engine_that_cannot_use_its_device_fails_its_work_instead_of_hanging():
    """The worker thread makes its CUDA device current first; if that fails (no such GPU,
    a device without its index), every submission fails with a message, none waits forever."""
    from cgx.collectives.engine import Engine
    from cgx.errors import CGXError

    engine = Engine(device=torch.device("cuda", 99))
    with pytest.raises(CGXError, match="could not use cuda:99"):
        engine.submit(lambda: 1, label="probe").wait()


def test_shutdown_waits_for_the_watchdog_to_leave_its_store_call():
    """A daemon thread still inside a store call when the interpreter finalizes aborts the
    process (SIGABRT after a finished run): shutdown returns only once the watchdog, which
    posts this rank's progress to the store, has left."""
    import threading
    import time

    from cgx.collectives.engine import Engine

    class SlowBoard:
        def __init__(self):
            self.entered = threading.Event()
            self.in_flight = 0

        def publish(self, submitted, last):
            self.in_flight += 1
            self.entered.set()
            time.sleep(0.5)
            self.in_flight -= 1

    board = SlowBoard()
    engine = Engine(board=board)
    assert board.entered.wait(10), "the watchdog never posted progress"
    engine.shutdown()
    assert board.in_flight == 0
    assert not engine._watchdog.is_alive()
