"""``cgxrun --mpi``: the mpirun command line (Open MPI, MPICH/Intel MPI Hydra) and its run.

Python programs run as ``python -m mpi4py prog``: an uncaught exception or
``sys.exit(n)`` then calls ``MPI_Abort(n)``, which stops every rank and makes n
mpirun's exit code (a rank exiting non-zero after MPI_Finalize would not).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import Mapping, Optional, Sequence

from cgx.launch.exit_record import default_signals, exit_code
from cgx.launch.spec import RunSpec


def mpi_flavor(mpirun: str) -> str:
    """``openmpi`` or ``hydra`` (MPICH, Intel MPI), from ``mpirun --version``."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if "HYDRA" in out or "MPICH" in out or "Intel(R) MPI" in out:
        return "hydra"
    return "openmpi"


def physical_cores() -> int:
    """Cores as Open MPI counts slots (physical cores, not hardware threads)."""
    cores = set()
    try:
        with open("/proc/cpuinfo") as f:
            for block in f.read().split("\n\n"):
                fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
                fields = {k.strip(): v.strip() for k, v in fields.items()}
                if "core id" in fields:
                    cores.add((fields.get("physical id"), fields["core id"]))
    except OSError:
        pass
    return len(cores) or os.cpu_count() or 1


# Interpreter options taking a value (python -W arg, -X opt).
_PY_OPTS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def mpi4py_command(command: Sequence[str]) -> list[str]:
    """``python [opts] prog args`` -> ``python [opts] -m mpi4py prog args``.

    mpi4py's runner turns an uncaught exception or ``sys.exit(n)`` into
    ``MPI_Abort(n)``. Other commands are returned unchanged.
    """
    cmd = list(command)
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(cmd[0])):
        return cmd
    i = 1
    while i < len(cmd) and cmd[i].startswith("-") and cmd[i] not in ("-m", "-c", "-"):
        if cmd[i] in ("-i", "--"):
            return cmd  # interactive or unusual: leave alone
        i += 2 if cmd[i] in _PY_OPTS_WITH_VALUE else 1
    if i >= len(cmd) or cmd[i:i + 2] == ["-m", "mpi4py"]:
        return cmd
    return cmd[:i] + ["-m", "mpi4py"] + cmd[i:]


def mpirun_command(spec: RunSpec, exported: Sequence[str], *, mpirun: str = "mpirun",
                   flavor: str = "openmpi", cores: Optional[int] = None,
                   is_root: Optional[bool] = None, use_mpi4py: bool = True) -> list[str]:
    """The mpirun command line (without environment) for ``spec``."""
    cores = physical_cores() if cores is None else cores
    is_root = (os.geteuid() == 0) if is_root is None else is_root
    hosts = ",".join(f"{h.name}:{h.slots}" for h in spec.hosts)
    program = mpi4py_command(spec.command) if use_mpi4py else list(spec.command)
    nics = spec.network_interface
    if flavor == "hydra":
        cmd = [mpirun, "-n", str(spec.num_proc)]
        if hosts:
            cmd += ["-hosts", hosts]
        if nics:
            cmd += ["-iface", nics.split(",")[0].strip()]
        if exported:
            cmd += ["-genvlist", ",".join(exported)]
        if spec.tag_output:
            cmd.append("-prepend-rank")
        if spec.output_filename:
            cmd += ["-outfile-pattern", os.path.join(os.path.abspath(spec.output_filename),
                                                     "rank.%r.stdout"),
                    "-errfile-pattern", os.path.join(os.path.abspath(spec.output_filename),
                                                     "rank.%r.stderr")]
        return cmd + list(spec.mpi_args) + program
    cmd = [mpirun, "-np", str(spec.num_proc)]
    if hosts:
        cmd += ["-H", hosts]
    cmd += ["--bind-to", "none", "--map-by", "slot"]
    if is_root:
        cmd.append("--allow-run-as-root")
    if not spec.hosts and spec.num_proc > cores:
        cmd.append("--oversubscribe")
    if nics:
        nics = ",".join(n.strip() for n in nics.split(",") if n.strip())
        cmd += ["--mca", "btl_tcp_if_include", nics, "--mca", "oob_tcp_if_include", nics]
    if spec.tag_output:
        cmd.append("--tag-output")
    if spec.output_filename:
        cmd += ["--output-filename", os.path.abspath(spec.output_filename)]
    for name in exported:
        cmd += ["-x", name]
    return cmd + list(spec.mpi_args) + program


def has_mpi4py(program: str, env: Mapping[str, str]) -> bool:
    """Whether ``program`` is a Python interpreter that can import mpi4py (a quick probe)."""
    if not re.fullmatch(r"python[0-9.]*", os.path.basename(program)):
        return False
    if shutil.which(program, path=env.get("PATH")) == sys.executable:
        return importlib.util.find_spec("mpi4py") is not None
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('mpi4py') is None)"
    try:
        return subprocess.run([program, "-c", probe], env=dict(env), timeout=60,
                              capture_output=True).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def exported_names(env: Mapping[str, str], set_here: Mapping[str, str]) -> list[str]:
    """Variables mpirun forwards to remote ranks: cgxrun's own and the job-relevant ones."""
    prefixes = ("CGX_", "HOROVOD_", "GLOO_", "NCCL_", "MASTER_", "TORCH_", "PYTHON", "OMP_")
    names = set(set_here) | {k for k in env if k.startswith(prefixes)}
    names |= {k for k in ("PATH", "LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "TRITON_INTERPRET")
              if k in env}
    return sorted(names)


def run_mpirun(cmd: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(cmd, env=env, preexec_fn=default_signals)

    def forward(signum, _frame):
        proc.send_signal(signum)  # mpirun stops the ranks on SIGINT/SIGTERM

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return exit_code(code)
