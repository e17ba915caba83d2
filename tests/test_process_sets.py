"""Process sets (``hvd.ProcessSet``, ``add_process_set``, ``process_set=``): collectives over
a subset of ranks, on Gloo and MPI, compared with Horovod 0.28.1 itself on the same program."""

from __future__ import annotations

import pytest
import torch

from distutil import TESTS_DIR, run_ranks
from spawn import run_gloo

pytestmark = pytest.mark.multiproc

SCRIPT = str(TESTS_DIR / "side_by_side.py")


def _reports(launcher, impl, case, nprocs=3, env=None, launcher_args=()):
    run = run_ranks(path=SCRIPT, nprocs=nprocs, launcher=launcher, args=[impl, case],
                    env=env, launcher_args=launcher_args, timeout=240)
    return run.check()


@pytest.fixture(scope="module")
def horovod_process_sets(horovodrun):
    return _reports("horovodrun", "horovod", "process_sets", launcher_args=["--gloo"])


@pytest.mark.parametrize("launcher,env", [("cgxrun-gloo", {}),
                                          ("cgxrun-mpi", {"CGX_TRANSPORT": "mpi"})],
                         ids=["gloo", "mpi"])
def test_process_sets_match_horovod(horovod_process_sets, launcher, env):
    cgx = _reports(launcher, "cgx", "process_sets", env=env)
    for r, (mine, theirs) in enumerate(zip(cgx, horovod_process_sets)):
        assert mine == theirs, f"rank {r}: cgx {mine}\nHorovod {theirs}"
    # The reports are not trivially equal: rank 1 is outside set a and says so.
    assert cgx[1]["a_err"] == "ValueError" and cgx[0]["a_avg"] == [10.0, 11.0, 12.0, 13.0]


def test_tensorflow_process_sets_match_horovod(horovodrun):
    theirs = _reports("horovodrun", "horovod", "process_sets_tf", launcher_args=["--gloo"])
    mine = _reports("cgxrun-gloo", "cgx", "process_sets_tf")
    assert mine == theirs
    assert mine[0]["avg"] == [2.0, 4.0] and mine[1]["err"] == "InvalidArgumentError"


def _dynamic(rank, world):
    import cgx.torch as hvd
    from cgx.errors import CollectiveMismatchError

    hvd.init()
    out = {}
    odd = hvd.add_process_set([1, 2])
    out["id"], out["size"] = odd.process_set_id, odd.size()
    try:
        hvd.add_process_set(hvd.ProcessSet([2, 1]))
    except ValueError as e:
        out["dup"] = str(e)
    # Ranks that pass different sets: the same error on every rank, and the job goes on.
    try:
        hvd.add_process_set([0, 1] if rank == 0 else [0, 2])
    except CollectiveMismatchError as e:
        out["mismatch"] = str(e)
    # An optimizer over the set: its members average their gradients, rank 0 is untouched.
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    if odd.included():
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(),
                                       process_set=odd)
        x = torch.full((1, 3), float(rank))
        model(x).sum().backward()
        opt.step()
        out["weight"] = model.weight.detach().view(-1).tolist()
    out["removed"] = hvd.remove_process_set(odd)
    out["removed_again"] = hvd.remove_process_set(odd)
    out["remove_global"] = hvd.remove_process_set(hvd.global_process_set)
    try:
        hvd.allreduce(torch.ones(1), process_set=odd)
    except ValueError as e:
        out["after_remove"] = str(e)
    again = hvd.add_process_set([0, 1])
    if again.included():
        out["again"] = hvd.allreduce(torch.tensor([float(rank)]), process_set=again).item()
    out["world"] = hvd.allreduce(torch.tensor([float(rank)])).item()
    return out


def test_add_remove_optimizer_and_errors():
    outs = run_gloo(_dynamic, 3)
    for r, o in enumerate(outs):
        assert o["id"] == 1 and o["size"] == 2
        assert "duplicate process set" in o["dup"]
        assert "add_process_set" in o["mismatch"] and "ranks" in o["mismatch"], o["mismatch"]
        assert o["removed"] is True and o["removed_again"] is False
        assert o["remove_global"] is False
        assert "not registered" in o["after_remove"]
        assert o["world"] == 1.0
    # Ranks 1 and 2 averaged -x = -(1, 2)/2 per weight; rank 0 never stepped.
    assert "weight" not in outs[0]
    assert outs[1]["weight"] == outs[2]["weight"] == [-1.5, -1.5, -1.5]
    assert outs[0]["again"] == outs[1]["again"] == 0.5 and "again" not in outs[2]
