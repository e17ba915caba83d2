"""Run a function on N real ranks over torch.distributed Gloo (for tests).

``run_gloo(fn, world, *args)`` spawns ``world`` processes, each initializes
a Gloo process group on 127.0.0.1 with a free port, calls
``fn(rank, world, *args)`` and returns the list of per-rank return values
(anything ``torch.save`` can store). A hang fails after ``timeout`` seconds.

Ranks are forked from a server process that has imported torch (and torch._dynamo,
which the first optimizer imports, and TensorFlow with Keras where installed) once
(start method "forkserver"): a launch costs about 0.1-0.3 s instead of the 4-5 s of
importing torch and the 5 s more of TensorFlow in fresh interpreters. Each rank takes the
caller's environment and working directory as they are at the call (the server's are
those of its start).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import tempfile
import traceback

import torch
import torch.multiprocessing as mp

from ports import free_port  # noqa: F401 (the tests import it from here too)

# Imported once by the server the ranks are forked from (it starts at the first launch).
# torch._dynamo: the first torch.optim optimizer a rank creates imports it (2-3 s, more
# on a loaded machine); FSDP2 imports DTensor and dynamo too.
# TensorFlow and Keras too where installed (about 5 s of imports a Keras rank no longer pays),
# Triton before them: its LLVM loaded after TensorFlow crashes the process (see
# cgx.tensorflow._load_triton_first). The server makes no eager context and runs no op:
# a forked rank initializes TensorFlow as a fresh process would (the Keras tests show it).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo"]
if importlib.util.find_spec("tensorflow") is not None:
    _PRELOAD += ["triton", "tensorflow", "keras"]
multiprocessing.set_forkserver_preload(_PRELOAD)


def _entry(rank, world, port, outdir, caller, fn, args):
    import torch.distributed as dist

    env, cwd = caller
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save({"ok": result}, os.path.join(outdir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(outdir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's final teardown: with a DDP model on Gloo, about one
    # run in six aborted there ("terminate called without an active exception", also with
    # no cgx code involved), after the result was written. Exit handlers still run.
    import atexit
    import sys
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_gloo(fn, world: int, *args, timeout: float = 180.0) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` Gloo ranks; return their results."""
    with tempfile.TemporaryDirectory() as outdir:
        caller = (dict(os.environ), os.getcwd())
        ctx = mp.start_processes(_entry, args=(world, free_port(), outdir, caller, fn, args),
                                 nprocs=world, join=False, start_method="forkserver")
        try:
            import time
            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout} s")
        except mp.ProcessRaisedException:
            pass  # reported below with the rank's own traceback
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        paths = [os.path.join(outdir, f"{r}.pt") for r in range(world)]
        found = [torch.load(p, weights_only=False) if os.path.exists(p) else None
                 for p in paths]
        # a rank's own error first: the others may have been stopped because of it
        for r, res in enumerate(found):
            if res is not None and "error" in res:
                raise RuntimeError(f"rank {r} failed:\n{res['error']}")
        for r, res in enumerate(found):
            if res is None:
                raise RuntimeError(f"rank {r} died without a result "
                                   f"(exit code {ctx.processes[r].exitcode})")
        return [res["ok"] for res in found]
