"""The compressed collectives through each engine: torch.distributed, mpi4py, Horovod.

Ranks run the cases of ``test_collectives`` (odd sizes, mixed dtypes and bit
widths, a zero tensor, many tiny tensors, an exact tensor) with every
algorithm and rounding, check the documented error bound themselves, and
report a digest of their results. Every rank must report the same digests, and
with 2 ranks every transport must too: the algorithms are deterministic, so the
engine underneath must not change a single bit.
"""

import pytest

from distutil import have_horovodrun, have_mpirun, run_ranks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

CASES = '''
import hashlib
import torch
import cgx
from cgx.collectives import Reducer
from cgx.config import Config, ReductionType, Rounding
from test_collectives import _bound, _case_tensors, _exact, _inputs

cgx.init()
world = cgx.size()
red = Reducer(cgx.transport(), Config(pipeline_chunk_mb=0.05, seed=7))
digests, worst = {}, 0.0
for algorithm in ReductionType:
    for rounding in (Rounding.NEAREST, Rounding.STOCHASTIC):
        case = _case_tensors(rounding)
        xs = _inputs(case, cgx.rank(), 1)
        red.allreduce(xs, [s for _, _, s in case], algorithm=algorithm, name="grads")
        exact = _exact(case, world, 1, "AVERAGE", 1.0, 1.0)
        bounds = _bound(case, world, 1, 1.0, 1.0 / world, exact, algorithm)
        for x, e, b in zip(xs, exact, bounds):
            worst = max(worst, (x.double() - e).abs().max().item() / b)
        h = hashlib.sha256()
        for x in xs:
            h.update(x.float().numpy().tobytes())
        digests[f"{algorithm.value}-{rounding.value}"] = h.hexdigest()
report({"rank": cgx.rank(), "transport": cgx.transport().name, "digests": digests,
        "worst_error_over_bound": worst})
cgx.shutdown()
'''


def _check(res, nprocs, transport):
    outs = res.check()
    assert [o["rank"] for o in outs] == list(range(nprocs))
    for o in outs:
        assert o["transport"].startswith(transport), o["transport"]
        assert o["worst_error_over_bound"] <= 1.0, o
        assert o["digests"] == outs[0]["digests"], "ranks ended with different results"
    assert len(outs[0]["digests"]) == 6
    return outs[0]["digests"]


def test_mpi_transport_four_ranks():
    """SRA, ring and allgather over mpi4py (mpirun), 4 ranks."""
    if not have_mpirun():
        pytest.fail("mpirun is missing: run scripts/install-system-deps.sh (make test does)")
    res = run_ranks(CASES, nprocs=4, launcher="mpirun", env={"CGX_TRANSPORT": "mpi"},
                    timeout=300)
    _check(res, 4, "mpi")


def test_same_bits_through_every_transport():
    if not have_mpirun() or not have_horovodrun():
        pytest.fail("mpirun or horovodrun is missing: `make test` installs both")
    torch_digests = _check(run_ranks(CASES, nprocs=2, launcher="torchrun", timeout=300),
                           2, "torch-gloo")
    mpi_digests = _check(run_ranks(CASES, nprocs=2, launcher="mpirun",
                                   env={"CGX_TRANSPORT": "mpi"}, timeout=300), 2, "mpi")
    hvd_digests = _check(run_ranks(CASES, nprocs=2, launcher="horovodrun",
                                   launcher_args=("--gloo",), timeout=300), 2, "horovod")
    assert mpi_digests == torch_digests
    assert hvd_digests == torch_digests
