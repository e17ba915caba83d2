"""MPITransport (cgx.comm.mpi) on 2 real ranks under mpirun.

One mpirun launch runs this file as a script (``--worker``): each rank runs
every check below against values computed locally and reports, per check,
None (passed) or what went wrong. The pytest side has one test per check.
"""

from __future__ import annotations

import sys

import pytest
import torch

from cgx.comm.base import ReduceOp

NP = 2
LAUNCH_TIMEOUT_S = 180

OPS = [ReduceOp.SUM, ReduceOp.AVERAGE, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32]
CHECKS = (
    ["alltoall", "alltoall_bf16_bytes", "allgather", "allgather_int64", "broadcast",
     "broadcast_bf16", "sendrecv_ring", "barrier", "split_singletons", "split_reversed_group",
     "split_of_split", "async_all", "async_poll", "noncontiguous_allreduce",
     "noncontiguous_output", "empty_allreduce", "objects", "errors"]
    + [f"allreduce_{op.value}_{str(dt)[6:]}" for op in OPS for dt in DTYPES]
)


# =============================================================================
# rank side (runs under mpirun, no pytest)
# =============================================================================

def _value(r: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's allreduce input: small values exact in every tested dtype (37: irregular size)."""
    base = torch.arange(n, dtype=torch.float32) % 7 + 1
    x = base + 0.5 * r if dtype.is_floating_point else base * (r + 1)
    return x.to(dtype)


def _expected(op: ReduceOp, size: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    xs = torch.stack([_value(r, n, dtype).double() for r in range(size)])
    if op is ReduceOp.SUM:
        y = xs.sum(0)
    elif op is ReduceOp.AVERAGE:
        y = xs.sum(0) / size if dtype.is_floating_point else xs.sum(0).div(size,
                                                                           rounding_mode="floor")
    elif op is ReduceOp.MIN:
        y = xs.min(0).values
    elif op is ReduceOp.MAX:
        y = xs.max(0).values
    else:
        y = xs.prod(0)
    return y.to(dtype)


def _u8(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def _checks(t) -> dict:
    from cgx.comm.mpi import MPITransport

    r, n = t.rank, t.size
    results: dict = {}

    def check(name, fn):
        try:
            out = fn()
            results[name] = None if out in (None, True) else f"rank {r}: {out}"
        except Exception as e:  # noqa: BLE001 - reported to the pytest side
            results[name] = f"rank {r}: raised {type(e).__name__}: {e}"

    def same(got, want):
        return True if torch.equal(got, want) else f"got {got.tolist()}, want {want.tolist()}"

    # -- alltoall: chunk j of rank r holds 10*r + j (chunk of 5 bytes) --------
    def alltoall():
        inp = torch.cat([torch.full((5,), 10 * r + j, dtype=torch.uint8) for j in range(n)])
        out = torch.empty_like(inp)
        t.alltoall(out, inp)
        return same(out, torch.cat([torch.full((5,), 10 * j + r, dtype=torch.uint8)
                                    for j in range(n)]))
    check("alltoall", alltoall)

    def alltoall_bf16():
        inp = torch.tensor([r + 0.25, r + 0.5, r + 0.75, r + 1.0], dtype=torch.bfloat16)
        out = torch.empty_like(inp)
        t.alltoall(out, inp)  # 2 elements per peer, moved as bytes
        want = torch.cat([torch.tensor([j + 0.25, j + 0.5], dtype=torch.bfloat16) if r == 0 else
                          torch.tensor([j + 0.75, j + 1.0], dtype=torch.bfloat16)
                          for j in range(n)])
        return same(out, want)
    check("alltoall_bf16_bytes", alltoall_bf16)

    def allgather():
        out = torch.empty(n * 7, dtype=torch.uint8)
        t.allgather(out, torch.arange(7, dtype=torch.uint8) + 20 * r)
        return same(out, torch.cat([torch.arange(7, dtype=torch.uint8) + 20 * j
                                    for j in range(n)]))
    check("allgather", allgather)

    def allgather_int64():
        out = torch.empty(n * 3, dtype=torch.int64)
        t.allgather(out, torch.tensor([r, -r, 2**40 + r]))
        return same(out, torch.tensor([v for j in range(n) for v in (j, -j, 2**40 + j)]))
    check("allgather_int64", allgather_int64)

    # -- allreduce: every op x dtype ------------------------------------------------
    for op in OPS:
        for dt in DTYPES:
            def one(op=op, dt=dt):
                x = _value(r, 37, dt)
                t.allreduce(x, op)
                return same(x, _expected(op, n, 37, dt))
            check(f"allreduce_{op.value}_{str(dt)[6:]}", one)

    def noncontiguous_allreduce():
        big = torch.stack([_value(r, 10, torch.float32)] * 3, dim=1)  # (10, 3)
        view = big[:, 1]  # stride 3: staged through a copy and written back
        t.allreduce(view)
        return same(big[:, 1], _expected(ReduceOp.SUM, n, 10, torch.float32)) is True and \
            same(big[:, 0], _value(r, 10, torch.float32))
    check("noncontiguous_allreduce", noncontiguous_allreduce)

    def noncontiguous_output():
        out = torch.zeros(2, n * 4, dtype=torch.uint8)[:, ::2]  # (2, n*2) with stride 2
        inp = torch.full((2, 2), r + 1, dtype=torch.uint8)
        t.allgather(out.t(), inp)  # output memory is not contiguous
        want = torch.cat([torch.full((4,), j + 1, dtype=torch.uint8) for j in range(n)])
        return same(out.t().reshape(-1), want)
    check("noncontiguous_output", noncontiguous_output)

    def empty():
        x = torch.empty(0)
        t.allreduce(x)
        return x.numel() == 0
    check("empty_allreduce", empty)

    # -- broadcast, sendrecv, barrier --------------------------------------------------
    def broadcast():
        x = torch.arange(6, dtype=torch.float32) * (r + 1)
        t.broadcast(x, root=1)
        return same(x, torch.arange(6, dtype=torch.float32) * 2)
    check("broadcast", broadcast)

    def broadcast_bf16():
        x = torch.full((3,), 1.5 + r, dtype=torch.bfloat16)
        t.broadcast(x, root=0)
        return same(x, torch.full((3,), 1.5, dtype=torch.bfloat16))
    check("broadcast_bf16", broadcast_bf16)

    def ring():
        send = torch.full((9,), r + 0.5, dtype=torch.bfloat16)
        recv = torch.empty_like(send)
        t.sendrecv(send, (r + 1) % n, recv, (r - 1) % n)
        return same(recv, torch.full((9,), (r - 1) % n + 0.5, dtype=torch.bfloat16))
    check("sendrecv_ring", ring)
    check("barrier", lambda: t.barrier())

    # -- split ------------------------------------------------------------------------------
    def split_singletons():
        sub = t.split([[j] for j in range(n)])
        x = torch.tensor([float(r)])
        sub.allreduce(x)
        ok = (sub.rank, sub.size, x.item()) == (0, 1, float(r))
        sub.close()
        return ok or f"rank {sub.rank} size {sub.size} x {x.item()}"
    check("split_singletons", split_singletons)

    def split_reversed():
        sub = t.split([list(reversed(range(n)))])  # group ranks follow the parent's order
        x = torch.tensor([float(r + 1)])
        sub.allreduce(x)
        ok = (sub.rank, sub.size, x.item()) == (r, n, float(n * (n + 1) // 2))
        sub.close()
        return ok or f"rank {sub.rank} size {sub.size} x {x.item()}"
    check("split_reversed_group", split_reversed)

    def split_of_split():
        sub = t.split([list(range(n))]).split([[j] for j in range(n)])
        return isinstance(sub, MPITransport) and (sub.rank, sub.size) == (0, 1)
    check("split_of_split", split_of_split)

    # -- async -------------------------------------------------------------------------------
    def async_all():
        a_in = torch.cat([torch.full((3,), 10 * r + j, dtype=torch.uint8) for j in range(n)])
        a_out = torch.empty_like(a_in)
        g_out = torch.empty(n * 2, dtype=torch.uint8)
        g_in = torch.tensor([r, r + 100], dtype=torch.uint8)
        red = _value(r, 37, torch.float16)
        bc = torch.full((4,), float(r))
        send, recv = torch.full((4,), float(r)), torch.empty(4)
        works = [t.alltoall(a_out, a_in, async_op=True),
                 t.allgather(g_out, g_in, async_op=True),
                 t.allreduce(red, ReduceOp.AVERAGE, async_op=True),
                 t.broadcast(bc, 1, async_op=True),
                 t.sendrecv(send, (r + 1) % n, recv, (r - 1) % n, async_op=True)]
        for w in works:
            w.wait()
        w.wait()  # a second wait is a no-op
        problems = [same(a_out, torch.cat([torch.full((3,), 10 * j + r, dtype=torch.uint8)
                                           for j in range(n)])),
                    same(g_out, torch.tensor([v for j in range(n) for v in (j, j + 100)],
                                             dtype=torch.uint8)),
                    same(red, _expected(ReduceOp.AVERAGE, n, 37, torch.float16)),
                    same(bc, torch.full((4,), 1.0)),
                    same(recv, torch.full((4,), float((r - 1) % n)))]
        bad = [p for p in problems if p is not True]
        return bad[0] if bad else all(w.is_completed() for w in works)
    check("async_all", async_all)

    def async_poll():
        x = _value(r, 1000, torch.float32)
        w = t.allreduce(x, async_op=True)
        import time
        deadline = time.monotonic() + 30
        while not w.is_completed():  # MPI_Testall also drives progress
            if time.monotonic() > deadline:
                return "is_completed() never became True"
        w.wait()
        return same(x, _expected(ReduceOp.SUM, n, 1000, torch.float32))
    check("async_poll", async_poll)

    def objects():
        got = t.broadcast_object({"root": r, "list": [1, 2]}, root=1)
        everyone = t.allgather_object(("rank", r))
        return (got == {"root": 1, "list": [1, 2]} and
                everyone == [("rank", j) for j in range(n)]) or f"{got} {everyone}"
    check("objects", objects)

    def errors():
        expect = [
            (ValueError, "alltoall needs input and output of the same byte size",
             lambda: t.alltoall(_u8(4), _u8(3))),
            (ValueError, "allgather output must hold size",
             lambda: t.allgather(_u8(3), _u8(2))),
            (TypeError, "does not take torch.bool tensors",
             lambda: t.allreduce(torch.ones(2, dtype=torch.bool))),
            (ValueError, "unsupported reduce op 'sum'", lambda: t.allreduce(torch.ones(2), "sum")),
            (ValueError, "broadcast root=5 is not a rank", lambda: t.broadcast(torch.ones(1), 5)),
            (ValueError, "sendrecv dst=-1 is not a rank",
             lambda: t.sendrecv(torch.ones(1), -1, torch.ones(1), 0)),
            (ValueError, "must partition ranks", lambda: t.split([[0]])),
        ]
        for exc, text, fn in expect:
            try:
                fn()
            except exc as e:
                if text not in str(e):
                    return f"{exc.__name__} without {text!r}: {e}"
                continue
            return f"no {exc.__name__} for {text!r}"
        return True
    check("errors", errors)
    return results


def _worker() -> None:
    from distutil import report

    from cgx.comm.mpi import MPITransport
    t = MPITransport()
    results = _checks(t)
    report({"rank": t.rank, "size": t.size, "results": results})


# =============================================================================
# pytest side
# =============================================================================

@pytest.fixture(scope="module")
def rank_results():
    from distutil import have_mpirun, run_ranks
    if not have_mpirun():
        pytest.skip("mpirun is not installed")
    outs = run_ranks(path=__file__, args=["--worker"], nprocs=NP, launcher="mpirun",
                     timeout=LAUNCH_TIMEOUT_S).check()
    assert [o["rank"] for o in outs] == list(range(NP))
    assert all(o["size"] == NP for o in outs)
    return [o["results"] for o in outs]


@pytest.mark.multiproc
@pytest.mark.parametrize("name", CHECKS)
def test_mpi_transport(rank_results, name):
    for res in rank_results:
        assert name in res, f"check {name} did not run"
        assert res[name] is None, res[name]


def test_missing_mpi4py(monkeypatch):
    from cgx.comm import mpi
    from cgx.errors import MissingDependencyError
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # "import mpi4py" now fails
    with pytest.raises(MissingDependencyError, match=r"needs the Python package 'mpi4py'.*"
                                                     r"pip install 'cgx\[mpi\]'"):
        mpi.MPITransport()
    with pytest.raises(ImportError):  # still an ImportError for generic handlers
        mpi.import_mpi()


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
