"""Run a Python snippet or file on N real ranks and collect each rank's JSON report.

Launchers: ``torchrun`` (``python -m torch.distributed.run --standalone``),
``mpirun`` (Open MPI, as root and oversubscribed as needed), ``cgxrun-gloo``,
``cgxrun-mpi`` (the ``cgxrun`` console script), ``horovodrun`` (give
``--gloo``/``--mpi`` in ``launcher_args``), and ``env``: plain processes
given per-rank environments by ``rank_env(rank)`` (to imitate a launcher, e.g.
horovodrun's variables).

The rank side calls ``report(obj)`` (JSON-serializable); snippets get it
imported for them, files do ``from distutil import report`` (this directory is
put on ``PYTHONPATH``). Example::

    res = run_ranks('''
        import cgx
        cgx.init()
        report({"rank": cgx.rank(), "size": cgx.size()})
    ''', nprocs=2, launcher="torchrun")
    outs = res.check()          # raises with the output tail unless all ranks reported
    assert [o["rank"] for o in outs] == [0, 1]

A run that exceeds ``timeout`` is killed (its whole process group) and shows
``timed_out=True``: a hang fails the test instead of blocking CI.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

TESTS_DIR = Path(__file__).resolve().parent
LAUNCHERS = ("torchrun", "mpirun", "cgxrun-gloo", "cgxrun-mpi", "horovodrun", "env")
OUT_VAR = "CGX_TEST_OUT"
# Launcher variables holding the global rank, in cgx's precedence order.
_RANK_VARS = ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")


def report(obj: Any) -> None:
    """Rank side: write ``obj`` as this rank's JSON result (last call wins)."""
    rank = next((os.environ[v] for v in _RANK_VARS if os.environ.get(v)), "0")
    out = Path(os.environ[OUT_VAR]) / f"rank{int(rank)}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.replace(out)


@dataclasses.dataclass
class RankRun:
    """Outcome of :func:`run_ranks`."""

    returncode: int
    stdout: str
    stderr: str
    outputs: list  # per rank: its report, or None
    command: list
    duration_s: float
    timed_out: bool

    def tail(self, n: int = 4000) -> str:
        return (f"command: {' '.join(map(str, self.command))}\nreturncode: {self.returncode}"
                f"{' (timed out)' if self.timed_out else ''}\n--- stdout ---\n"
                f"{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}")

    def check(self) -> list:
        """Every rank's report; AssertionError (with the output tail) otherwise."""
        if self.timed_out or self.returncode != 0 or any(o is None for o in self.outputs):
            missing = [r for r, o in enumerate(self.outputs) if o is None]
            raise AssertionError(f"ranks failed (no report from {missing})\n{self.tail()}")
        return self.outputs


def cgxrun_command() -> list[str]:
    """The ``cgxrun`` console script next to this interpreter (else ``python -m cgx.launch.cli``)."""
    script = Path(sys.executable).parent / "cgxrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "cgx.launch.cli"]


def mpirun_base(nprocs: int) -> list[str]:
    cmd = ["mpirun", "-np", str(nprocs), "--bind-to", "none", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def have_mpirun() -> bool:
    return shutil.which("mpirun") is not None


def horovodrun_command() -> Optional[list]:
    script = Path(sys.executable).parent / "horovodrun"
    return [str(script)] if script.exists() else None


def have_horovodrun() -> bool:
    return horovodrun_command() is not None and have_mpirun()


from ports import free_port  # noqa: E402,F401 (the tests import it from here)


def run_ranks(code: Optional[str] = None, *, path: Optional[str] = None, nprocs: int = 2,
              launcher: str = "torchrun", args: Sequence[str] = (),
              env: Optional[Mapping[str, str]] = None, launcher_args: Sequence[str] = (),
              rank_env: Optional[Callable[[int], Mapping[str, str]]] = None,
              timeout: float = 60.0, keep_going: bool = False) -> RankRun:
    """Run ``code`` (a snippet) or ``path`` (a file) on ``nprocs`` ranks.

    Args:
        code: Python source; dedented, ``report`` is imported for it.
        path: a Python file to run instead.
        launcher: one of :data:`LAUNCHERS`.
        args: arguments for the program.
        env: extra environment for the launcher (and so the ranks).
        launcher_args: extra launcher flags (before the program).
        rank_env: ``env`` launcher only: the variables of each rank.
        keep_going: ``env`` launcher only: a failing rank does not stop the others.
        timeout: seconds before the whole run is killed.
    """
    if (code is None) == (path is None):
        raise ValueError("give exactly one of code= or path=")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r}; expected one of {LAUNCHERS}")
    with tempfile.TemporaryDirectory(prefix="cgx-ranks-") as tmp:
        if code is not None:
            path = os.path.join(tmp, "rank_main.py")
            Path(path).write_text("from distutil import report\n" + textwrap.dedent(code))
        outdir = os.path.join(tmp, "out")
        os.mkdir(outdir)
        full_env = dict(os.environ)
        # Ranks must not inherit a launcher's variables from the test process.
        for k in list(full_env):
            if k.startswith(("OMPI_", "PMIX_", "HOROVOD_", "SLURM_", "PMI_", "CGX_")) or k in (
                    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                del full_env[k]
        full_env.update({OUT_VAR: outdir, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                         "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(TESTS_DIR), full_env.get("PYTHONPATH")]))})
        full_env.update(env or {})
        program = [sys.executable, path, *args]
        if launcher == "torchrun":
            # torch.distributed.run runs the script with its own interpreter.
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nprocs), *launcher_args, path, *args]
        elif launcher == "mpirun":
            cmd = mpirun_base(nprocs) + list(launcher_args) + program
        elif launcher == "horovodrun":
            cmd = horovodrun_command() + ["-np", str(nprocs), *launcher_args, *program]
            # horovodrun finds mpirun and the interpreter's scripts on PATH.
            full_env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent),
                                                full_env.get("PATH", "")])
        elif launcher in ("cgxrun-gloo", "cgxrun-mpi"):
            mode = "--gloo" if launcher == "cgxrun-gloo" else "--mpi"
            cmd = cgxrun_command() + ["-np", str(nprocs), mode, *launcher_args, *program]
        else:
            cmd = program
        start = time.monotonic()
        if launcher == "env":
            rc, out, err, timed_out = _run_env_ranks(cmd, nprocs, full_env, rank_env, timeout,
                                                     keep_going)
        else:
            rc, out, err, timed_out = _run(cmd, full_env, timeout)
        duration = time.monotonic() - start
        outputs = []
        for r in range(nprocs):
            f = Path(outdir) / f"rank{r}.json"
            outputs.append(json.loads(f.read_text()) if f.exists() else None)
        return RankRun(rc, out, err, outputs, cmd, duration, timed_out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _run(cmd, env, timeout):
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err, False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        return proc.returncode, out, err, True


def _run_env_ranks(cmd, nprocs, env, rank_env, timeout, keep_going=False):
    """Start ``nprocs`` copies with per-rank variables; fail (and stop all) on the first error,
    unless ``keep_going`` (then the others run on, to see how they handle the failure)."""
    procs = []
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(nprocs)]
    for r in range(nprocs):
        e = {**env, **(rank_env(r) if rank_env else {})}
        procs.append(subprocess.Popen(cmd, env=e, stdout=logs[r][0], stderr=logs[r][1],
                                      text=True, start_new_session=True))
    deadline, timed_out, rc = time.monotonic() + timeout, False, 0
    while any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)] if not keep_going else []
        if failed or time.monotonic() > deadline:
            timed_out = not failed
            rc = failed[0].returncode if failed else -9
            for p in procs:
                _kill_group(p)
            break
        time.sleep(0.05)
    for p in procs:
        p.wait()
    rc = rc or next((p.returncode for p in procs if p.returncode), 0)
    outs, errs = [], []
    for r, (o, e) in enumerate(logs):
        o.seek(0), e.seek(0)
        outs.append(f"[rank {r}] " + o.read())
        errs.append(f"[rank {r}] " + e.read())
        o.close(), e.close()
    return rc, "\n".join(outs), "\n".join(errs), timed_out


# -- the world view of cgx.init() ------------------------------------------------------

# Each rank: cgx.init(), report the world view and reduce through the world, local and
# cross transports (check with check_world()).
WORLD_SNIPPET = """
import os, torch, cgx
import cgx.runtime as rt
from cgx.comm.base import ReduceOp
cgx.init()
t = rt.transport()
x = torch.full((5,), float(cgx.rank() + 1))
t.allreduce(x)
m = torch.tensor([float(cgx.rank())])
t.allreduce(m, ReduceOp.MAX)
lt, ct = rt.local_transport(), rt.cross_transport()
y = torch.ones(2)
lt.allreduce(y)
z = torch.ones(2)
ct.allreduce(z)
report({"world": cgx.world().as_dict(), "sum": x.tolist(), "max": m.item(), "name": t.name,
        "local": [lt.rank, lt.size, y.tolist()], "cross": [ct.rank, ct.size, z.tolist()],
        "obj": t.broadcast_object({"from": cgx.rank()}, root=0),
        "hosts": t.allgather_object(cgx.world().hostname),
        "config": {"fusion_mb": rt.config().fusion_buffer_mb, "verbose": rt.config().verbose,
                   "timeline": rt.config().timeline}})
"""


def check_world(outs: list, launcher: str, size: int = 2, local_size: int = 2,
                name: str = "torch-gloo") -> None:
    """Assert the reports of WORLD_SNIPPET: a consistent world and correct reductions."""
    total = sum(range(1, size + 1))
    for r, o in enumerate(outs):
        w = o["world"]
        assert (w["rank"], w["size"], w["launcher"]) == (r, size, launcher)
        assert (w["local_rank"], w["local_size"]) == (r % local_size, local_size)
        assert (w["cross_rank"], w["cross_size"]) == (r // local_size, size // local_size)
        assert o["sum"] == [float(total)] * 5 and o["max"] == size - 1
        assert o["name"] == name
        assert o["local"] == [r % local_size, local_size, [float(local_size)] * 2]
        nodes = size // local_size
        assert o["cross"] == [r // local_size, nodes, [float(nodes)] * 2]
        assert o["obj"] == {"from": 0}
    hostnames = [o["world"]["hostname"] for o in outs]
    assert all(o["hosts"] == hostnames for o in outs)  # everyone agrees on everyone


# -- horovodrun --gloo, imitated ----------------------------------------------------------

class KVServer:
    """An HTTP key-value store with horovodrun's rendezvous semantics.

    ``PUT /<scope>/<key>`` stores the body, ``GET`` returns it or 404. Use as a
    context manager; ``.port`` is the listening port on 127.0.0.1.
    """

    def __init__(self):
        import http.server
        import threading

        store, lock = {}, threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _key(self):
                parts = self.path.split("/")
                return (parts[1], parts[2]) if len(parts) == 3 else None

            def do_GET(self):
                key = self._key()
                with lock:
                    value = store.get(key) if key else None
                self.send_response(200 if value is not None else (404 if key else 400))
                self.send_header("Content-Length", str(len(value or b"")))
                self.end_headers()
                self.wfile.write(value or b"")

            def do_PUT(self):
                key = self._key()
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if key:
                    with lock:
                        store[key] = body
                self.send_response(200 if key else 400)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.store = store
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def horovod_gloo_env(port: int, local_size: int, nprocs: int,
                     hostname: str = "") -> Callable[[int], dict]:
    """``rank_env`` giving each rank what ``horovodrun --gloo`` would.

    Ranks fill nodes of ``local_size`` in order; every node is this machine but
    the variables say ``cross_size`` nodes (a multi-node job on one host).
    """
    def env(rank: int) -> dict:
        node = rank // local_size
        return {
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(nprocs),
            "HOROVOD_LOCAL_RANK": str(rank % local_size), "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(node),
            "HOROVOD_CROSS_SIZE": str(-(-nprocs // local_size)),
            "HOROVOD_HOSTNAME": hostname or f"node{node}",
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        }
    return env
