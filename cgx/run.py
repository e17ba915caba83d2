"""``cgxrun``: start a cgx job on N ranks, with horovodrun's common flags.

Examples::

    cgxrun -np 2 python train.py                  # this machine, torch.distributed.run
    cgxrun -np 4 --mpi -H a:2,b:2 python train.py # two hosts, through mpirun
    cgxrun --help-env                             # the CGX_* variables

``cgxrun`` only starts existing launchers and exports the variables the ranks
need (``CGX_FUSION_BUFFER_SIZE_MB``, ``CGX_TIMELINE``, ``CGX_VERBOSE``, ...):

``--gloo`` (default): ``torch.distributed.run``, run inside cgxrun.
    One host: ``--standalone --nproc-per-node N``. Several hosts (``-H``): run
    the same ``cgxrun`` command on every host; each starts its own ranks with
    ``--nnodes/--node-rank/--master-addr/--master-port`` (the static
    rendezvous at the first host of ``-H``, port ``--master-port``). The node
    is found by matching this machine against ``-H``, or given with
    ``--node-rank``. Without a match cgxrun prints the per-host commands.
    (Starting remote ranks over ssh is left to ``--mpi``.)
``--mpi``: ``mpirun`` (Open MPI; MPICH/Intel MPI Hydra best effort) with
    ``-np``, ``-H``, ``-x VAR`` for each exported variable, ``--bind-to none
    --map-by slot`` (as horovodrun), ``--allow-run-as-root`` when run as root
    and ``--oversubscribe`` when N exceeds this machine's cores.

A failing rank stops the job and its exit code becomes cgxrun's:

* torch.distributed.run stops the other workers but exits 1 whatever the
  worker's code, and when a dying rank makes its peers fail too it cannot
  tell which failed first (it stamps failures to the second). cgxrun runs it
  in-process and starts each worker under a small recorder
  (``python -m cgx.run --_record-exit DIR -- prog ...``) that notes the exit
  time and code of a failed worker; cgx.runtime also notes when a rank starts
  to exit (``CGXRUN_EXIT_DIR``), before it closes connections that peers wait
  on. cgxrun returns the code of the earliest failure (128 + signal for a
  killed worker).
* mpirun stops the job at once when a rank dies or exits non-zero *before*
  MPI_Finalize, and returns that code; a rank that exits non-zero after
  finalizing (mpi4py finalizes at exit) is only reported once all others
  ended, which can be never. cgxrun therefore runs Python programs as
  ``python -m mpi4py prog ...``: an uncaught exception or ``sys.exit(n)``
  calls ``MPI_Abort(n)``, which stops every rank and makes n the exit code.

Usage errors (bad flags, too few slots, a program that is not there, no
mpirun) exit with code 2 and a message that says what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

DEFAULT_MASTER_PORT = 29500
USAGE_EXIT = 2


class UsageError(Exception):
    """A command line cgxrun cannot run; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A parsed, validated cgxrun command line."""

    num_proc: int
    command: tuple[str, ...]
    hosts: tuple[Host, ...] = ()  # empty: this machine
    mode: str = "gloo"  # "gloo" (torch.distributed.run) or "mpi" (mpirun)
    fusion_threshold_mb: Optional[float] = None
    timeline_filename: Optional[str] = None
    verbose: bool = False
    start_timeout: Optional[float] = None
    network_interface: Optional[str] = None
    node_rank: Optional[int] = None
    master_port: int = DEFAULT_MASTER_PORT
    mpi_args: tuple[str, ...] = ()
    dry_run: bool = False
    tag_output: bool = True  # prefix each line with its rank ("[1]<stdout>:")
    output_filename: Optional[str] = None  # per-rank logs: DIR/rank.<r>/{stdout,stderr}

    def assignment(self) -> list[tuple[str, int]]:
        """(host, ranks) per host: ``-H`` slots filled in order up to ``num_proc``."""
        if not self.hosts:
            return [("localhost", self.num_proc)]
        out, left = [], self.num_proc
        for h in self.hosts:
            n = min(h.slots, left)
            if n:
                out.append((h.name, n))
            left -= n
        return out


_EPILOG = """\
--gloo runs torch.distributed.run inside cgxrun. With several hosts in -H, run
the same cgxrun command on every host (each starts its own ranks; this host is
found in -H, or given with --node-rank); remote start over ssh is --mpi's job.
--mpi runs mpirun (-np, -H, -x for exported variables, --bind-to none, plus
--allow-run-as-root / --oversubscribe when needed); Python programs run as
`python -m mpi4py prog` so that a failing rank aborts the whole job.
A failed rank's exit code is cgxrun's exit code; usage errors exit with 2.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit; main() reports it the same way
        raise UsageError(f"{message} (see cgxrun --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="cgxrun",
        usage="cgxrun -np N [-H host1:slots,host2:slots] [--gloo | --mpi] [options] "
              "[--] program [args...]",
        description="Start a cgx job on N ranks (horovodrun-style flags). Ranks read their "
                    "settings from CGX_* variables; see cgxrun --help-env.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                   help="number of ranks to start")
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                   help="hosts and their slots, e.g. a:2,b:2 (slots default to 1); "
                        "default: this machine")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gloo", dest="mode", action="store_const", const="gloo",
                      help="start ranks with torch.distributed.run (default)")
    mode.add_argument("--mpi", dest="mode", action="store_const", const="mpi",
                      help="start ranks with mpirun (transport stays CGX_TRANSPORT; "
                           "set CGX_TRANSPORT=mpi to reduce over MPI too)")
    p.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                   help="fusion buffer size in MB (CGX_FUSION_BUFFER_SIZE_MB)")
    p.add_argument("--timeline-filename", metavar="PATH",
                   help="write a Chrome-trace timeline (CGX_TIMELINE)")
    p.add_argument("--verbose", action="store_true",
                   help="print the launch command; ranks log their decisions (CGX_VERBOSE=1)")
    p.add_argument("--start-timeout", type=float, metavar="SECONDS",
                   help="how long ranks wait for each other at start (CGX_START_TIMEOUT_S, "
                        "torch.distributed.run's rendezvous timeout)")
    p.add_argument("--network-interface", metavar="NIC[,NIC]",
                   help="interface(s) for traffic between hosts (GLOO_SOCKET_IFNAME, "
                        "NCCL_SOCKET_IFNAME; mpirun's btl/oob_tcp_if_include)")
    p.add_argument("--node-rank", type=int, metavar="K",
                   help="--gloo with several hosts: this machine is host K of -H (0-based)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="PORT",
                   help="--gloo with several hosts: rendezvous port on the first host "
                        f"(default {DEFAULT_MASTER_PORT})")
    p.add_argument("--mpi-args", metavar="'ARGS'", help="extra arguments for mpirun (quoted)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also write each rank's output to DIR/rank.<r>/stdout and stderr")
    p.add_argument("--no-tag-output", dest="tag_output", action="store_false",
                   help="do not prefix each output line with its rank (default: "
                        "'[<rank>]<stdout>:', as horovodrun and mpirun --tag-output)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be run, and exit")
    p.add_argument("--help-env", action="store_true",
                   help="list the environment variables cgx reads, and exit")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="program [args...]")
    return p


def parse_hosts(value: str) -> tuple[Host, ...]:
    """``"a:2,b"`` -> (Host("a", 2), Host("b", 1))."""
    hosts, seen = [], set()
    for item in value.split(","):
        item = item.strip()
        name, sep, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if not name or (sep and not slots):
            raise UsageError(f"-H entry {item!r} is not HOST or HOST:SLOTS; "
                             f"write e.g. -H host1:2,host2:2")
        if not slots.isdigit() or int(slots) < 1:
            raise UsageError(f"-H entry {item!r}: slots must be a positive whole number, "
                             f"e.g. {name}:2")
        if name in seen:
            raise UsageError(f"-H lists host {name!r} twice; give each host once with its "
                             f"total slots")
        seen.add(name)
        hosts.append(Host(name, int(slots)))
    return tuple(hosts)


def parse_args(argv: Sequence[str]) -> RunSpec:
    """Parse and validate a cgxrun command line.

    Raises:
        UsageError: what is wrong and how to fix it.
    """
    return spec_from_namespace(build_parser().parse_args(list(argv)))


def spec_from_namespace(ns: argparse.Namespace) -> RunSpec:
    """Validate parsed flags into a :class:`RunSpec` (raises :class:`UsageError`)."""
    command = list(ns.command)
    if command and command[0] == "--":
        command = command[1:]
    if ns.num_proc is None:
        raise UsageError("-np/--num-proc is required: the number of ranks to start, "
                         "e.g. cgxrun -np 2 python train.py")
    if ns.num_proc < 1:
        raise UsageError(f"-np {ns.num_proc} must be at least 1")
    if not command:
        raise UsageError("no program given: put it after the options, e.g. "
                         "cgxrun -np 2 python train.py")
    hosts = parse_hosts(ns.hosts) if ns.hosts is not None else ()
    if hosts and sum(h.slots for h in hosts) < ns.num_proc:
        have = sum(h.slots for h in hosts)
        raise UsageError(f"-np {ns.num_proc} needs {ns.num_proc} slots but -H {ns.hosts} gives "
                         f"{have}; add hosts or slots, or lower -np")
    if ns.fusion_threshold_mb is not None and not 0 < ns.fusion_threshold_mb <= 4096:
        raise UsageError(f"--fusion-threshold-mb {ns.fusion_threshold_mb:g} is out of range; "
                         f"expected a size in MB in (0, 4096], e.g. 64")
    if ns.start_timeout is not None and ns.start_timeout <= 0:
        raise UsageError(f"--start-timeout {ns.start_timeout:g} must be a positive number of "
                         f"seconds, e.g. 120")
    if not 1 <= ns.master_port <= 65535:
        raise UsageError(f"--master-port {ns.master_port} is not a TCP port (1..65535)")
    if ns.network_interface is not None and not ns.network_interface.strip(", "):
        raise UsageError("--network-interface is empty; name an interface, e.g. eth0")
    mode = ns.mode or "gloo"
    spec = RunSpec(num_proc=ns.num_proc, command=tuple(command), hosts=hosts, mode=mode,
                   fusion_threshold_mb=ns.fusion_threshold_mb,
                   timeline_filename=ns.timeline_filename, verbose=ns.verbose,
                   start_timeout=ns.start_timeout, network_interface=ns.network_interface,
                   node_rank=ns.node_rank, master_port=ns.master_port,
                   mpi_args=tuple(shlex.split(ns.mpi_args or "")), dry_run=ns.dry_run,
                   tag_output=ns.tag_output, output_filename=ns.output_filename)
    if ns.node_rank is not None:
        if mode == "mpi":
            raise UsageError("--node-rank is for --gloo runs on several hosts; with --mpi, "
                             "mpirun starts the ranks of every host itself")
        nodes = len(spec.assignment())
        if not 0 <= ns.node_rank < nodes:
            raise UsageError(f"--node-rank {ns.node_rank} is out of range: -np {ns.num_proc} "
                             f"-H {ns.hosts or 'localhost'} uses {nodes} host(s), so 0.."
                             f"{nodes - 1}")
    return spec


# -- what the ranks get ---------------------------------------------------------------

def worker_env(spec: RunSpec, base: Mapping[str, str]) -> dict[str, str]:
    """Variables cgxrun sets for the ranks (on top of ``base``, its own environment)."""
    env: dict[str, str] = {}
    if spec.fusion_threshold_mb is not None:
        env["CGX_FUSION_BUFFER_SIZE_MB"] = f"{spec.fusion_threshold_mb:g}"
    if spec.timeline_filename is not None:
        env["CGX_TIMELINE"] = spec.timeline_filename
    if spec.verbose:
        env["CGX_VERBOSE"] = "1"
    if spec.start_timeout is not None:
        env["CGX_START_TIMEOUT_S"] = f"{spec.start_timeout:g}"
    if spec.network_interface is not None:
        nics = ",".join(n.strip() for n in spec.network_interface.split(",") if n.strip())
        env["GLOO_SOCKET_IFNAME"] = nics
        env["NCCL_SOCKET_IFNAME"] = nics
    # Several ranks per host share its cores: one intra-op thread each unless the user
    # says otherwise (torch.distributed.run does the same and warns).
    if "OMP_NUM_THREADS" not in base and max(n for _, n in spec.assignment()) > 1:
        env["OMP_NUM_THREADS"] = "1"
    if "PYTHONUNBUFFERED" not in base:
        env["PYTHONUNBUFFERED"] = "1"  # rank output shows up as it is printed
    if spec.mode == "gloo":
        # Read by each worker's recorder (python -m cgx.run --_record-exit), which
        # prefixes and copies the worker's output lines.
        env[TAG_OUTPUT_VAR] = "1" if spec.tag_output else "0"
        if spec.output_filename:
            env[OUTPUT_DIR_VAR] = os.path.abspath(spec.output_filename)
    # Workers' output goes through a pipe: tell them whether a person watches
    # (progress bars are drawn only then, see cgx.console).
    from cgx.console import TTY_VAR
    env[TTY_VAR] = "1" if _stderr_is_tty() else "0"
    return env


TAG_OUTPUT_VAR = "CGXRUN_TAG_OUTPUT"
OUTPUT_DIR_VAR = "CGXRUN_OUTPUT_DIR"


def _stderr_is_tty() -> bool:
    from cgx.console import _isatty
    return _isatty(sys.stderr)


def check_program(command: Sequence[str], env: Mapping[str, str]) -> None:
    """The program must exist and be executable (here; remote hosts are not checked)."""
    prog = command[0]
    hint = (f"; run Python scripts through the interpreter, e.g. cgxrun -np 2 python {prog}"
            if prog.endswith(".py") else "")
    if os.sep in prog:
        if not os.path.isfile(prog):
            raise UsageError(f"program {prog!r} does not exist; check the path{hint}")
        if not os.access(prog, os.X_OK):
            raise UsageError(f"program {prog!r} is not executable; chmod +x it{hint}")
    elif shutil.which(prog, path=env.get("PATH")) is None:
        raise UsageError(f"program {prog!r} was not found on PATH (or is not executable); "
                         f"give its full path{hint}")


# -- torch.distributed.run -------------------------------------------------------------

def torchrun_args(spec: RunSpec, node_rank: Optional[int] = None) -> list[str]:
    """Arguments of ``python -m torch.distributed.run`` for one host's ranks."""
    hosts = spec.assignment()
    if node_rank is None:
        args = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(spec.num_proc)]
        if spec.start_timeout is not None:
            args += ["--rdzv-conf", f"join_timeout={int(spec.start_timeout)}"]
    else:
        args = ["--nnodes", str(len(hosts)), "--node-rank", str(node_rank),
                "--nproc-per-node", str(hosts[node_rank][1]), "--rdzv-backend", "static",
                "--master-addr", hosts[0][0], "--master-port", str(spec.master_port)]
        if spec.start_timeout is not None:
            args += ["--rdzv-conf", f"timeout={int(spec.start_timeout)}"]
    return args + ["--no-python", *spec.command]


def local_node(spec: RunSpec) -> Optional[int]:
    """Index of this machine in ``-H`` (None: not listed, or listed more than once)."""
    from cgx.launcher import is_local_host
    matches = [i for i, (h, _) in enumerate(spec.assignment()) if is_local_host(h)]
    return matches[0] if len(matches) == 1 else None


RECORD_FLAG = "--_record-exit"
EXIT_RECORD_VAR = "CGXRUN_EXIT_DIR"  # read by cgx.runtime (same name there)


def _exit_code(returncode: int) -> int:
    """Shell convention: a process killed by signal s (returncode -s) -> 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def _record_exit(record_dir: str, command: list[str]) -> int:
    """Run ``command``; if it fails, write ``<time_ns> <returncode>`` to ``record_dir/<RANK>``.

    Signals are forwarded to the command, and a command killed by a signal
    kills the recorder with the same signal, so torch.distributed.run sees
    exactly what the command did.
    """
    def die_with_parent():  # the command must not outlive a recorder killed by SIGKILL
        default_signals()
        try:
            import ctypes
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    rank = os.environ.get("RANK", str(os.getpid()))
    tag = os.environ.get(TAG_OUTPUT_VAR, "0") == "1"
    log_dir = os.environ.get(OUTPUT_DIR_VAR)
    pipe = subprocess.PIPE if tag or log_dir else None
    try:
        proc = subprocess.Popen(command, preexec_fn=die_with_parent, stdout=pipe, stderr=pipe)
    except OSError as e:
        print(f"cgxrun: cannot start {command[0]!r}: {e}", file=sys.stderr)
        proc, code = None, 127
    if proc is not None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, lambda signum, _f: proc.send_signal(signum))
        pumps = []
        if pipe is not None:
            from cgx.console import LinePump
            if log_dir:
                os.makedirs(os.path.join(log_dir, f"rank.{rank}"), exist_ok=True)
            for name, src, dst in (("stdout", proc.stdout, sys.stdout),
                                   ("stderr", proc.stderr, sys.stderr)):
                log = os.path.join(log_dir, f"rank.{rank}", name) if log_dir else None
                pumps.append(LinePump(src, dst, f"[{rank}]<{name}>:" if tag else "", log))
        code = proc.wait()
        for pump in pumps:
            pump.join()
    if code != 0:
        rank = os.environ.get("RANK", str(os.getpid()))
        with open(os.path.join(record_dir, f"rank{rank}"), "w") as f:
            f.write(f"{time.time_ns()} {code}")
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)  # undo the forwarding handler
        except (OSError, ValueError):
            pass  # SIGKILL/SIGSTOP: cannot be caught anyway
        os.kill(os.getpid(), -code)
    return code


def first_recorded_failure(record_dir: str) -> Optional[tuple[int, int]]:
    """(rank, returncode) of the failed rank that went first, or None.

    A failed rank's time is when cgx's exit handler ran (``atexit.rank<R>``,
    written by cgx.runtime before it closes the rank's connections, which is
    what makes blocked peers fail), else when its process ended (``rank<R>``).
    Its code is the status its program exited with, when cgx noted one there.
    """
    def read(name):
        with open(os.path.join(record_dir, name)) as f:
            return f.read().split()

    found = []
    for name in os.listdir(record_dir):
        if not name.startswith("rank"):
            continue
        try:
            t, code = read(name)
            rank = int(name[len("rank"):])
            t, code = int(t), int(code)
        except (OSError, ValueError):
            continue
        try:
            noted = read(f"atexit.rank{rank}")
            t = min(t, int(noted[0]))
            if len(noted) > 1 and int(noted[1]) != 0:
                # The status the program exited with (sys.exit), noted before its exit
                # handlers ran: the launcher may have stopped it by a signal since.
                code = int(noted[1])
        except (OSError, ValueError, IndexError):
            pass
        found.append((t, rank, code))
    if not found:
        return None
    _, rank, code = min(found)
    return rank, code


def _run_torchrun(args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse, run as torchrun_run

    with tempfile.TemporaryDirectory(prefix="cgxrun-") as record_dir:
        os.environ[EXIT_RECORD_VAR] = record_dir  # cgx.runtime notes its exit start there
        i = args.index("--no-python") + 1
        args = args[:i] + [sys.executable, "-m", "cgx.run", RECORD_FLAG, record_dir,
                           "--"] + args[i:]
        try:
            torchrun_run(torchrun_parse(args))
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            code = failure.exitcode
            recorded = first_recorded_failure(record_dir)
            if recorded is not None:
                rank, code = recorded
            others = "; the other ranks were stopped" if len(e.failures) > 1 else ""
            print(f"cgxrun: rank {rank} failed first, with exit code {code}{others}",
                  file=sys.stderr, flush=True)
            return _exit_code(code) or 1
        except SignalException as e:
            return 128 + int(e.sigval)
    return 0


# -- mpirun ------------------------------------------------------------------------------

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


def _has_mpi4py(program: str, env: Mapping[str, str]) -> bool:
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


def default_signals() -> None:
    """In a child before exec: SIGINT/SIGTERM/SIGHUP back to their defaults.

    A job started in the background (``cgxrun ... &``, CI runners) inherits
    SIGINT as *ignored*; a Python worker would then never raise
    KeyboardInterrupt and launchers could not stop it with SIGINT.
    """
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            signal.signal(s, signal.SIG_DFL)
        except (OSError, ValueError):
            pass


def _run_mpirun(cmd: list[str], env: dict[str, str]) -> int:
    proc = subprocess.Popen(cmd, env=env, preexec_fn=default_signals)

    def forward(signum, _frame):
        proc.send_signal(signum)  # mpirun stops the ranks on SIGINT/SIGTERM

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return _exit_code(code)


# -- main --------------------------------------------------------------------------------

def help_env() -> str:
    from cgx.config import ENV_VARS
    width = max(map(len, ENV_VARS))
    lines = ["Variables cgx reads on every rank (export them before cgxrun, or set them in "
             "the job):", ""]
    lines += [f"  {name:<{width}}  {text}" for name, text in ENV_VARS.items()]
    lines += ["", "Set by cgxrun flags:", "",
              "  --fusion-threshold-mb   CGX_FUSION_BUFFER_SIZE_MB",
              "  --timeline-filename     CGX_TIMELINE",
              "  --verbose               CGX_VERBOSE=1",
              "  --start-timeout         CGX_START_TIMEOUT_S",
              "  --network-interface     GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME"]
    return "\n".join(lines)


def _fmt(env: Mapping[str, str], cmd: Sequence[str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())] +
                    [shlex.quote(c) for c in cmd])


def _launch(spec: RunSpec) -> int:
    base = dict(os.environ)
    extra = worker_env(spec, base)
    env = {**base, **extra}
    try:
        from cgx.config import Config
        Config.from_env(env)  # a bad CGX_* value fails here, not on N ranks
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_program(spec.command, env)
    say = (lambda msg: print(f"cgxrun: {msg}", file=sys.stderr, flush=True))
    if spec.mode == "mpi":
        mpirun = shutil.which("mpirun", path=env.get("PATH"))
        if mpirun is None:
            raise UsageError("mpirun was not found on PATH: install Open MPI (e.g. apt-get "
                             "install openmpi-bin) or MPICH, or use --gloo")
        use_mpi4py = _has_mpi4py(spec.command[0], env)
        cmd = mpirun_command(spec, exported_names(env, extra), mpirun=mpirun,
                             flavor=mpi_flavor(mpirun), use_mpi4py=use_mpi4py)
        if spec.dry_run or spec.verbose:
            say(_fmt(extra, cmd))
        return 0 if spec.dry_run else _run_mpirun(cmd, env)

    hosts = spec.assignment()
    node = None
    if spec.hosts and (len(hosts) > 1 or not _is_local(hosts[0][0])):
        node = spec.node_rank if spec.node_rank is not None else local_node(spec)
        if node is None:
            lines = [f"  on {h}: cgxrun {_fmt({}, _with_node_rank(sys_argv_for(spec), i))}"
                     for i, (h, _) in enumerate(hosts)]
            raise UsageError("this machine is not (exactly once) among the -H hosts, and with "
                             "--gloo cgxrun starts the ranks of one host. Run on each host:\n"
                             + "\n".join(lines) +
                             "\nor use --mpi, which starts remote ranks through mpirun")
    args = torchrun_args(spec, node)
    if spec.dry_run or spec.verbose:
        say(_fmt(extra, [sys.executable, "-m", "torch.distributed.run", *args]))
    if spec.dry_run:
        return 0
    os.environ.update(extra)  # torch.distributed.run's workers inherit cgxrun's environment
    return _run_torchrun(args)


def _is_local(host: str) -> bool:
    from cgx.launcher import is_local_host
    return is_local_host(host)


def sys_argv_for(spec: RunSpec) -> list[str]:
    """A cgxrun command line equivalent to ``spec`` (for printed per-host commands)."""
    argv = ["-np", str(spec.num_proc)]
    if spec.hosts:
        argv += ["-H", ",".join(f"{h.name}:{h.slots}" for h in spec.hosts)]
    for flag, value in (("--fusion-threshold-mb", spec.fusion_threshold_mb),
                        ("--timeline-filename", spec.timeline_filename),
                        ("--start-timeout", spec.start_timeout),
                        ("--network-interface", spec.network_interface)):
        if value is not None:
            argv += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if spec.verbose:
        argv.append("--verbose")
    if spec.master_port != DEFAULT_MASTER_PORT:
        argv += ["--master-port", str(spec.master_port)]
    return argv + ["--", *spec.command]


def _with_node_rank(argv: list[str], node: int) -> list[str]:
    i = argv.index("--")
    return argv[:i] + ["--node-rank", str(node)] + argv[i:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``cgxrun``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [RECORD_FLAG] and len(argv) > 3 and argv[2] == "--":
        return _record_exit(argv[1], argv[3:])
    try:
        ns = build_parser().parse_args(argv)
        if ns.help_env:
            print(help_env())
            return 0
        return _launch(spec_from_namespace(ns))
    except UsageError as e:
        print(f"cgxrun: error: {e}", file=sys.stderr)
        return USAGE_EXIT


if __name__ == "__main__":
    sys.exit(main())
