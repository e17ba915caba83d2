"""The DDP hook under every DDP setting trainers use: results equal plain DDP's.

With ``find_unused_parameters=True`` (Hugging Face's Trainer's default for its models)
DDP's reducer runs a collective of its own on its group during backward; the hook's
exchanges run on a group of their own, so the two never interleave (before, the ranks
disagreed on a bucket, hung, or aborted in Gloo).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cgx.comm.consistency import describe, signature
import ddp_settings
from spawn import free_port, run_gloo

pytestmark = pytest.mark.multiproc


def _both(rank, world, setting):
    return (ddp_settings.train(rank, world, setting, hook=False),
            ddp_settings.train(rank, world, setting, hook=True))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("setting", [s for s in ddp_settings.SETTINGS if s != "compile"])
def test_hook_matches_plain_ddp(setting, world):
    results = run_gloo(_both, world, setting, timeout=240)
    for rank, (plain, hooked) in enumerate(results):
        for p, h in zip(plain, hooked):
            torch.testing.assert_close(h, p, rtol=0, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {setting}: {m}")
    # every rank holds the same parameters
    for p0, p1 in zip(results[0][1], results[-1][1]):
        torch.testing.assert_close(p1, p0, rtol=0, atol=1e-6)


def test_hook_under_torch_compile():
    """``torch.compile`` of the DDP model (its DDP optimizer splits the graph at bucket
    boundaries; the reducer still calls the hook)."""
    results = run_gloo(_both, 2, "compile", timeout=400)
    for plain, hooked in results:
        for p, h in zip(plain, hooked):
            torch.testing.assert_close(h, p, rtol=0, atol=1e-6)


def _mismatch(rank, world):
    import cgx.torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(torch.nn.Linear(64, 32))  # large enough to be quantized
    comp = cgx.torch.Compression.quantize(bits=4 if rank == 0 else 8)
    ddp.register_comm_hook(cgx.torch.CGXState(ddp, compression=comp), cgx.torch.cgx_hook)
    try:
        ddp(torch.randn(4, 64)).sum().backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_mismatch_names_the_field_and_both_values():
    """The error reaches the user through DDP with its own words (DDP reads the hook's
    future in C++: an exception stored as a result used to read 'Unable to cast')."""
    for msg in run_gloo(_mismatch, 2):
        assert "CollectiveMismatchError: ranks disagree on DDP bucket" in msg
        assert "specs: rank 0 has [QuantSpec(bits=4" in msg
        assert "rank 1 has [QuantSpec(bits=8" in msg
        assert "Unable to cast" not in msg


def test_equal_signatures_with_unequal_digests_say_what_happened():
    sig = signature("DDP bucket", "ddp.bucket0", names=["w"], shapes=[(2, 3)])
    msg = describe([sig, sig])
    assert msg.startswith("ranks hold the same DDP bucket 'ddp.bucket0' (names=[w]")
    assert "another collective ran on the same process group at the same time" in msg


EXIT_SCRIPT = textwrap.dedent("""
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import cgx.torch
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = DDP(net, gradient_as_bucket_view=True)
    ddp.register_comm_hook(cgx.torch.CGXState(ddp), cgx.torch.cgx_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(4):  # (the exit is under test: a few steps leave the engine busy)
        x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
        opt.zero_grad()
        with ddp.no_sync():
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    print("trained", flush=True)
    # no destroy_process_group(), no cgx shutdown: the script just ends
""")


# Starts the ranks of each run from one process that has already imported what the
# script imports (torch, DDP's torch._dynamo, cgx), so a run costs its training and its
# exit, not two interpreters' 4 s of imports. Each rank is a fork that runs the script as
# __main__ and then leaves through the interpreter's normal exit (SystemExit at top level:
# atexit handlers, thread joins, module teardown, C++ static destructors), the path on
# which the SIGABRT happened. Nothing the script builds (process group, DDP, cgx's engine
# thread) exists before the fork.
FORKING_LAUNCHER = textwrap.dedent("""
    import os, socket, sys, runpy
    import torch, torch.distributed, torch._dynamo
    from torch.nn.parallel import DistributedDataParallel
    import cgx.torch
    script, runs, outdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    for run in range(runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), LOCAL_RANK=str(rank))
                for fd, name in ((1, "out"), (2, "err")):
                    path = os.path.join(outdir, f"run{run}-rank{rank}.{name}")
                    os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
                sys.argv = [script]
                runpy.run_path(script, run_name="__main__")
                raise SystemExit(0)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        print(run, *codes, flush=True)
""")


def _check_exit(run, rank, code, out, err):
    assert code == 0 and "trained" in out, \
        f"run {run}, rank {rank}: exit code {code}\n{err[-3000:]}"
    assert "terminate called" not in err, f"run {run}, rank {rank}:\n{err[-3000:]}"


def test_a_script_without_shutdown_exits_cleanly_every_time(tmp_path):
    """20 runs of 2 ranks (no_sync and gradient_as_bucket_view, as in the runs that ended
    with SIGABRT after training): every rank exits 0 with nothing on its standard error
    about terminate. 2 runs start each rank as its own interpreter, as a user does; 18 fork
    the ranks from FORKING_LAUNCHER (the same exit path without 4 s of imports a rank)."""
    script, launcher = tmp_path / "train.py", tmp_path / "launch.py"
    script.write_text(EXIT_SCRIPT)
    launcher.write_text(FORKING_LAUNCHER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for run in range(2):
        port = str(free_port())
        procs = [subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, text=True,
            env=dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=port, LOCAL_RANK=str(rank), PYTHONPATH=repo))
            for rank in range(2)]
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=180)
            _check_exit(run, rank, p.returncode, out, err)
    done = subprocess.run([sys.executable, str(launcher), str(script), "18", str(tmp_path)],
                          env=dict(os.environ, PYTHONPATH=repo), capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = [[int(c) for c in line.split()] for line in done.stdout.splitlines()]
    assert [c[0] for c in codes] == list(range(18)), done.stdout
    for run, *ranks in codes:
        for rank, code in enumerate(ranks):
            _check_exit(run, rank, code, (tmp_path / f"run{run}-rank{rank}.out").read_text(),
                        (tmp_path / f"run{run}-rank{rank}.err").read_text())


def _subgroup(rank, world):
    """DDP over ranks 0 and 2 of 3, two models (one engine and one twin group for both)."""
    import torch.distributed as dist
    import cgx.torch
    from cgx.torch import ddp as hook_module
    from torch.nn.parallel import DistributedDataParallel as DDP
    sub = dist.new_group([0, 2])
    if rank == 1:
        return None
    out = []
    for hook in (False, True):
        torch.manual_seed(0)
        nets = [ddp_settings.Net(), ddp_settings.Net()]
        ddps = [DDP(n, process_group=sub, bucket_cap_mb=0.002) for n in nets]
        if hook:
            for d in ddps:
                d.register_comm_hook(cgx.torch.CGXState(d, process_group=sub,
                                                        compression=cgx.torch.Compression.exact),
                                     cgx.torch.cgx_hook)
        opt = torch.optim.SGD([p for n in nets for p in n.parameters()], lr=0.1)
        for step in range(3):
            opt.zero_grad()
            x, y = ddp_settings._batch(step, rank)
            # one loss over both models: both hooks run in the same backward
            (torch.nn.functional.cross_entropy(ddps[0](x) + ddps[1](x), y)).backward()
            opt.step()
        out.append([p.detach().clone() for n in nets for p in n.parameters()])
    shared = len({id(r) for r in hook_module._hook_reducers.values()})
    return out, shared


def test_hook_on_a_sub_group_with_two_models():
    results = run_gloo(_subgroup, 3)
    assert results[1] is None
    for (plain, hooked), shared in (results[0], results[2]):
        assert shared == 1
        for p, h in zip(plain, hooked):
            torch.testing.assert_close(h, p, rtol=0, atol=1e-6)


def _join_divisor(rank, world):
    import cgx.torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(ddp_settings.Net())
    ddp.register_comm_hook(cgx.torch.CGXState(ddp), cgx.torch.cgx_hook)
    try:
        with ddp.join(divide_by_initial_world_size=False):
            x, y = ddp_settings._batch(0, rank)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return "no error"


def test_join_with_the_other_divisor_is_refused():
    for msg in run_gloo(_join_divisor, 2):
        assert "does not support divide_by_initial_world_size=False" in msg


class _HeadFirst(torch.nn.Module):
    """The head is registered first and used last: its gradients are ready first, so the
    buckets DDP rebuilds after the first iteration list the parameters in another order
    than the first iteration's (reverse registration order)."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(96, 16)
        self.body = torch.nn.Linear(16, 96)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _resumed(rank, world):
    """4 steps of 4-bit with error feedback in one go, and 2 + 2 with a fresh DDP model (a
    first iteration again, whose buckets list their parameters in another order than the
    rebuilt ones) loading the model, optimizer and hook states after step 2."""
    import copy
    import cgx.torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    def run(net, opt_state, hook_state, steps, start):
        ddp = DDP(net)
        state = cgx.torch.CGXState(ddp, compression=cgx.torch.Compression.quantize(
            bits=4, error_feedback=True))
        if hook_state is not None:
            state.load_state_dict(hook_state)
        ddp.register_comm_hook(state, cgx.torch.cgx_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        for step in range(start, start + steps):
            opt.zero_grad()
            x, y = ddp_settings._batch(step, rank)
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return copy.deepcopy(opt.state_dict()), state.state_dict()

    torch.manual_seed(0)
    whole = _HeadFirst()
    torch.manual_seed(0)
    parts = _HeadFirst()
    run(whole, None, None, 4, 0)
    opt_state, hook_state = run(parts, None, None, 2, 0)
    resumed = copy.deepcopy(parts)
    run(resumed, opt_state, hook_state, 2, 2)
    return [p.detach() for p in whole.parameters()], [p.detach() for p in resumed.parameters()]


def test_a_resumed_run_rounds_as_the_uninterrupted_one():
    for whole, resumed in run_gloo(_resumed, 2):
        for a, b in zip(whole, resumed):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
