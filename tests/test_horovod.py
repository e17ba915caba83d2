"""HorovodTransport under real horovodrun launches (2 ranks, --gloo and --mpi).

`make test` builds Horovod first (`make horovod`), so a Horovod that does not
import is a failure here, not a skip; set CGX_SKIP_HOROVOD_TESTS=1 to skip
these tests on purpose.

The rank side of the test is this same file run as a script
(``python tests/test_horovod.py --worker OUT_DIR``): each rank checks every
collective against values computed locally and writes a JSON report (failed
checks, launcher environment) that the pytest side asserts on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

NP = 2
# One horovodrun launch: Python + torch + Horovod start-up on 2 busy cores, then
# a few dozen small collectives. A hang fails the test instead of stalling CI.
LAUNCH_TIMEOUT_S = 240

# Environment variables each launch mode must give the ranks (cgx's launcher
# discovery relies on them; see docs/horovod.md).
EXPECTED_ENV = {
    "gloo": ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
             "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
             "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT",
             "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS"],
    "mpi": ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE"],
}


# =============================================================================
# rank side (runs under horovodrun, no pytest)
# =============================================================================

def _worker(out_dir: str) -> int:
    from cgx.comm.base import ReduceOp
    from cgx.comm.horovod import HorovodTransport
    from cgx.errors import CGXError

    t = HorovodTransport()
    r, n = t.rank, t.size
    failures: list[str] = []

    def check(what: str, ok: bool, detail: object = "") -> None:
        if not ok:
            failures.append(f"rank {r}: {what} {detail}")

    def expect_error(what: str, exc: type, fn) -> None:
        try:
            fn()
        except exc:
            return
        except Exception as e:  # noqa: BLE001 - reported, not swallowed
            failures.append(f"rank {r}: {what} raised {type(e).__name__}: {e}, not {exc.__name__}")
            return
        failures.append(f"rank {r}: {what} did not raise {exc.__name__}")

    # alltoall: chunk j of rank r holds the byte 10*r + j (chunk of 5: not a power of 2).
    chunk = 5
    inp = torch.cat([torch.full((chunk,), 10 * r + j, dtype=torch.uint8) for j in range(n)])
    out = torch.empty_like(inp)
    t.alltoall(out, inp)
    want = torch.cat([torch.full((chunk,), 10 * j + r, dtype=torch.uint8) for j in range(n)])
    check("alltoall", torch.equal(out, want), out.tolist())

    # allgather: every rank's bytes in rank order.
    inp = torch.arange(7, dtype=torch.uint8) + 20 * r
    out = torch.empty(n * 7, dtype=torch.uint8)
    t.allgather(out, inp)
    want = torch.cat([torch.arange(7, dtype=torch.uint8) + 20 * j for j in range(n)])
    check("allgather", torch.equal(out, want), out.tolist())

    # allreduce: rank r contributes (r + 1) * base.
    base = torch.tensor([1.0, -2.0, 3.5, 0.25, 10.0])
    contrib = [(j + 1) * base for j in range(n)]
    stack = torch.stack(contrib)
    wants = {ReduceOp.SUM: stack.sum(0), ReduceOp.AVERAGE: stack.sum(0) / n,
             ReduceOp.MIN: stack.min(0).values, ReduceOp.MAX: stack.max(0).values,
             ReduceOp.PRODUCT: stack.prod(0)}
    for op, want in wants.items():
        for dtype in (torch.float32, torch.float64):
            x = contrib[r].to(dtype, copy=True)  # in place: never reduce contrib itself
            t.allreduce(x, op)
            check(f"allreduce {op.name} {dtype}", torch.equal(x, want.to(dtype)), x.tolist())
    x = torch.arange(6, dtype=torch.int64) * (r + 1)
    t.allreduce(x, ReduceOp.SUM)
    check("allreduce SUM int64", torch.equal(x, torch.arange(6) * sum(range(1, n + 1))), x.tolist())
    x = torch.full((4,), r + 2, dtype=torch.int32)
    t.allreduce(x, ReduceOp.AVERAGE)  # (2 + 3) // 2 == 2: integer average floors
    check("allreduce AVERAGE int32", torch.equal(x, torch.full((4,), sum(range(2, n + 2)) // n,
                                                              dtype=torch.int32)), x.tolist())
    x = contrib[r].to(torch.bfloat16)
    t.allreduce(x, ReduceOp.SUM)
    check("allreduce SUM bfloat16", torch.equal(x, stack.sum(0).to(torch.bfloat16)), x.tolist())

    # broadcast from each root, and the pickled-object helpers built on it.
    for root in range(n):
        x = torch.full((3,), float(r))
        t.broadcast(x, root)
        check(f"broadcast root={root}", torch.equal(x, torch.full((3,), float(root))), x.tolist())
    obj = t.broadcast_object({"plan": [1, 2, r]} if r == 1 else None, root=1)
    check("broadcast_object", obj == {"plan": [1, 2, 1]}, obj)
    objs = t.allgather_object(("rank", r, "x" * (r * 3)))
    check("allgather_object", objs == [("rank", j, "x" * (j * 3)) for j in range(n)], objs)

    # sendrecv around the ring, 11 float32s and 9 bytes.
    dst, src = (r + 1) % n, (r - 1) % n
    recv = torch.empty(11)
    t.sendrecv(torch.full((11,), float(r)), dst, recv, src)
    check("sendrecv float32", torch.equal(recv, torch.full((11,), float(src))), recv.tolist())
    recv = torch.empty(9, dtype=torch.uint8)
    t.sendrecv(torch.arange(9, dtype=torch.uint8) + r, dst, recv, src)
    check("sendrecv uint8", torch.equal(recv, torch.arange(9, dtype=torch.uint8) + src),
          recv.tolist())

    # async: several ops outstanding at once (Horovod needs distinct names), waited in order.
    a, b = torch.full((8,), float(r + 1)), torch.full((3,), float(10 * (r + 1)))
    g_in, g_out = torch.full((4,), r, dtype=torch.uint8), torch.empty(4 * n, dtype=torch.uint8)
    s_in = torch.cat([torch.full((2,), 10 * r + j, dtype=torch.uint8) for j in range(n)])
    s_out = torch.empty_like(s_in)
    bc = torch.full((5,), float(r))
    ring = torch.empty(6)
    works = [t.allreduce(a, ReduceOp.SUM, async_op=True),
             t.allreduce(b, ReduceOp.MAX, async_op=True),
             t.allgather(g_out, g_in, async_op=True),
             t.alltoall(s_out, s_in, async_op=True),
             t.broadcast(bc, 0, async_op=True),
             t.sendrecv(torch.full((6,), float(r)), dst, ring, src, async_op=True)]
    for w in works:
        w.wait()
        w.wait()  # idempotent
        check("async is_completed after wait", w.is_completed())
    check("async allreduce SUM", torch.equal(a, torch.full((8,), float(sum(range(1, n + 1))))),
          a.tolist())
    check("async allreduce MAX", torch.equal(b, torch.full((3,), 10.0 * n)), b.tolist())
    check("async allgather", torch.equal(
        g_out, torch.cat([torch.full((4,), j, dtype=torch.uint8) for j in range(n)])),
        g_out.tolist())
    check("async alltoall", torch.equal(
        s_out, torch.cat([torch.full((2,), 10 * j + r, dtype=torch.uint8) for j in range(n)])),
        s_out.tolist())
    check("async broadcast", torch.equal(bc, torch.zeros(5)), bc.tolist())
    check("async sendrecv", torch.equal(ring, torch.full((6,), float(src))), ring.tolist())
    t.barrier()

    # Input validation (raised before any rank talks to Horovod).
    expect_error("broadcast root out of range", ValueError, lambda: t.broadcast(torch.zeros(2), n))
    expect_error("alltoall uneven", ValueError,
                 lambda: t.alltoall(torch.empty(n * 3 + 1, dtype=torch.uint8),
                                    torch.empty(n * 3 + 1, dtype=torch.uint8)))
    expect_error("allgather wrong output size", ValueError,
                 lambda: t.allgather(torch.empty(3, dtype=torch.uint8),
                                     torch.empty(3, dtype=torch.uint8)))
    expect_error("allreduce uint8", TypeError,
                 lambda: t.allreduce(torch.zeros(3, dtype=torch.uint8)))
    expect_error("allreduce non-contiguous", ValueError, lambda: t.allreduce(torch.zeros(4, 4).t()))
    expect_error("allreduce bad op", ValueError, lambda: t.allreduce(torch.zeros(2), "sum"))
    expect_error("sendrecv dst out of range", ValueError,
                 lambda: t.sendrecv(torch.zeros(2), n, torch.zeros(2), 0))
    expect_error("split not a partition", ValueError, lambda: t.split([[0]]))

    # split(): singleton groups need dynamic process sets.
    if os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS") == "1":
        sub = t.split([[j] for j in range(n)])
        check("split size/rank", (sub.size, sub.rank) == (1, 0), (sub.size, sub.rank))
        x = torch.full((3,), float(r))
        sub.allreduce(x)
        sub.broadcast(x, 0)
        check("split allreduce", torch.equal(x, torch.full((3,), float(r))), x.tolist())
        whole = t.split([list(range(n))])
        x = torch.ones(2)
        whole.allreduce(x)
        check("split whole group", whole.size == n and torch.equal(x, torch.full((2,), float(n))),
              x.tolist())
        expect_error("split of a sub-transport", CGXError, lambda: sub.split([[0]]))
        again = t.split([[j] for j in range(n)])  # reuses the registered process sets
        check("split again reuses the set", again.process_set.process_set_id
              == sub.process_set.process_set_id, again.process_set)
        x = torch.full((2,), float(r))
        again.allreduce(x)
        check("split again allreduce", torch.equal(x, torch.full((2,), float(r))), x.tolist())
    else:
        try:
            t.split([[j] for j in range(n)])
            failures.append(f"rank {r}: split without HOROVOD_DYNAMIC_PROCESS_SETS did not raise")
        except CGXError as e:
            check("split error names HOROVOD_DYNAMIC_PROCESS_SETS=1",
                  "HOROVOD_DYNAMIC_PROCESS_SETS=1" in str(e), str(e))
    t.barrier()

    env = {k: v for k, v in os.environ.items()
           if k.startswith(("HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "PMIX_RANK"))
           or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT")}
    report = {"rank": r, "size": n, "failures": failures, "env": env}
    Path(out_dir, f"rank{r}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    return 1 if failures else 0


# =============================================================================
# pytest side
# =============================================================================

def _launch(horovodrun: str, mode: str, out_dir: Path, extra_env: dict) -> list[dict]:
    cmd = [horovodrun, "-np", str(NP), "-H", f"localhost:{NP}", f"--{mode}"]
    # No root workaround needed: in MPI mode horovodrun passes
    # --allow-run-as-root to Open MPI's mpirun itself.
    env = {**os.environ, **extra_env}
    cmd += [sys.executable, os.path.abspath(__file__), "--worker", str(out_dir)]
    # Own session: on timeout the whole horovodrun/mpirun/rank tree is killed.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"horovodrun --{mode} did not finish in {LAUNCH_TIMEOUT_S} s (hang?); "
                    f"output tail:\n{output[-4000:]}", pytrace=False)
    reports = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    failures = [f for rep in reports for f in rep["failures"]]
    assert proc.returncode == 0 and len(reports) == NP and not failures, (
        f"horovodrun --{mode} exited {proc.returncode}, {len(reports)}/{NP} rank reports; "
        f"failed checks: {failures}\noutput tail:\n{output[-4000:]}")
    return reports

@pytest.mark.horovod
@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_collectives_under_horovodrun(horovodrun, mode, tmp_path):
    # Gloo runs may add process sets at run time (split works); MPI runs may
    # not (split must say how to enable it).
    extra = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"} if mode == "gloo" else {}
    reports = _launch(horovodrun, mode, tmp_path, extra)
    assert sorted(rep["rank"] for rep in reports) == list(range(NP))
    for rep in reports:
        missing = [k for k in EXPECTED_ENV[mode] if k not in rep["env"]]
        assert not missing, f"horovodrun --{mode} did not set {missing}; saw {sorted(rep['env'])}"
        if mode == "gloo":
            assert rep["env"]["HOROVOD_RANK"] == str(rep["rank"])
            assert rep["env"]["HOROVOD_SIZE"] == str(NP)
        else:
            assert rep["env"]["OMPI_COMM_WORLD_RANK"] == str(rep["rank"])
            assert rep["env"]["OMPI_COMM_WORLD_SIZE"] == str(NP)
            # Launcher discovery must not expect Horovod's own variables here.
            assert "HOROVOD_RANK" not in rep["env"] and "HOROVOD_SIZE" not in rep["env"]

def test_import_does_not_import_horovod():
    code = textwrap.dedent("""
        import sys
        import cgx.comm.horovod
        assert "horovod" not in sys.modules, "cgx.comm.horovod imported horovod"
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)

def test_missing_horovod_says_how_to_build(monkeypatch):
    import importlib.util

    from cgx.comm import horovod as cgx_horovod
    from cgx.errors import MissingDependencyError

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "horovod" else real_find_spec(name, *a))
    with pytest.raises(MissingDependencyError, match=r"not installed.*make horovod"):
        cgx_horovod.HorovodTransport()

def test_broken_horovod_extension_says_how_to_rebuild(monkeypatch):
    import builtins
    import importlib.util

    from cgx.comm import horovod as cgx_horovod
    from cgx.errors import MissingDependencyError

    real_import, real_find_spec = builtins.__import__, importlib.util.find_spec

    def fake_import(name, *args, **kwargs):
        if name == "horovod.torch":
            raise ImportError("mpi_lib_v2.so: undefined symbol: _ZN3c10")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "horovod"
                        else real_find_spec(name, *a))
    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(MissingDependencyError,
                       match=r"undefined symbol.*another torch.*make horovod"):
        cgx_horovod.import_horovod()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit(f"usage: {sys.argv[0]} --worker OUT_DIR (run by horovodrun from the tests)")
    sys.exit(_worker(sys.argv[2]))
