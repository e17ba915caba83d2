"""``cgxrun``: start a cgx job on N ranks, with horovodrun's common flags.

Examples::

    cgxrun -np 2 python train.py                  # this machine, torch.distributed.run
    cgxrun -np 4 --mpi -H a:2,b:2 python train.py # two hosts, through mpirun
    cgxrun --help-env                             # the CGX_* variables

``cgxrun`` only starts existing launchers and exports the variables the ranks
need (``CGX_FUSION_BUFFER_SIZE_MB``, ``CGX_TIMELINE``, ``CGX_VERBOSE``, ...):

``--gloo`` (default): ``torch.distributed.run``, run inside cgxrun.
    One host: ``--nproc-per-node N``, its store on 127.0.0.1 only. Several hosts (``-H``): run
    the same ``cgxrun`` command on every host; each starts its own ranks with
    ``--nnodes/--node-rank`` and the static rendezvous (``cgx-static``: its store
    on the first host of ``-H``, port ``--master-port``). The node
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
  (``python -m cgx.launch.exit_record DIR -- prog ...``) that notes the exit
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
import os
import shlex
import shutil
import sys
from typing import Mapping, Optional, Sequence

from cgx.launch.addresses import is_local_host
from cgx.launch.exit_record import OUTPUT_DIR_VAR, RECORD_FLAG, TAG_OUTPUT_VAR, record_exit
from cgx.launch.mpirun import exported_names, has_mpi4py, mpi_flavor, mpirun_command, run_mpirun
from cgx.launch.secret import SECRET_VAR, draw as draw_secret, redact
from cgx.launch.spec import DEFAULT_MASTER_PORT, USAGE_EXIT, Host, RunSpec, UsageError
from cgx.launch.torchrun import local_node, run_torchrun, torchrun_args


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
    el = p.add_argument_group(
        "elastic jobs", "ranks may be lost and join while the job runs (hvd.elastic; "
        "docs/elastic.md). Any of these flags makes the job elastic; ranks start on this "
        "machine only")
    el.add_argument("--min-np", "--min-num-proc", dest="min_np", type=int, metavar="M",
                    help="fewest ranks the job trains with (default: -np)")
    el.add_argument("--max-np", "--max-num-proc", dest="max_np", type=int, metavar="K",
                    help="most ranks the job trains with (default: -np)")
    el.add_argument("--host-discovery-script", metavar="SCRIPT",
                    help="an executable that prints the available hosts, HOST or HOST:SLOTS "
                         "per line; run every second")
    el.add_argument("--reset-limit", type=int, metavar="N",
                    help="stop the job after N changes of world (default: no limit)")
    el.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("MIN", "MAX"),
                    help="a failed rank's host takes ranks again after a random MIN..MAX "
                         "seconds (default: never)")
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
    elastic = _elastic_spec(ns, mode)
    if elastic is not None:
        spec = dataclasses.replace(spec, elastic=elastic)
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


def _elastic_spec(ns: argparse.Namespace, mode: str):
    """The elastic flags as an :class:`~cgx.launch.spec.ElasticSpec` (None: not elastic)."""
    given = (ns.min_np, ns.max_np, ns.host_discovery_script, ns.reset_limit,
             ns.blacklist_cooldown_range)
    if all(v is None for v in given):
        return None
    from cgx.launch.elastic import check
    from cgx.launch.spec import ElasticSpec
    if mode == "mpi":
        raise UsageError("elastic jobs (--min-np/--max-np/--host-discovery-script) start "
                         "their ranks themselves; drop --mpi")
    if ns.output_filename is not None:
        raise UsageError("--output-filename is not supported in elastic jobs yet (their ranks "
                         "come and go); redirect each rank's output in the program instead")
    if ns.host_discovery_script is not None and ns.hosts is not None:
        raise UsageError("give either -H or --host-discovery-script, not both")
    if ns.host_discovery_script is not None and not os.access(ns.host_discovery_script,
                                                              os.X_OK):
        raise UsageError(f"--host-discovery-script {ns.host_discovery_script!r} is not an "
                         f"executable file; chmod +x it or give its full path")
    cool = ns.blacklist_cooldown_range
    spec = ElasticSpec(min_np=ns.min_np if ns.min_np is not None else ns.num_proc,
                       max_np=ns.max_np if ns.max_np is not None else ns.num_proc,
                       discovery_script=ns.host_discovery_script, reset_limit=ns.reset_limit,
                       cooldown=None if cool is None else (cool[0], cool[1]))
    check(spec, ns.num_proc)
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
        # Read by each worker's recorder (python -m cgx.launch.exit_record), which
        # prefixes and copies the worker's output lines.
        env[TAG_OUTPUT_VAR] = "1" if spec.tag_output else "0"
        if spec.output_filename:
            env[OUTPUT_DIR_VAR] = os.path.abspath(spec.output_filename)
    # Workers' output goes through a pipe: tell them whether a person watches
    # (progress bars are drawn only then, see cgx.console).
    from cgx.console import TTY_VAR
    env[TTY_VAR] = "1" if _stderr_is_tty() else "0"
    return env


def secret_env(spec: RunSpec, base: Mapping[str, str], say) -> dict[str, str]:
    """``CGX_JOB_SECRET`` for the ranks: the user's (``base``), else a fresh one.

    A ``--gloo`` job on several hosts runs one cgxrun per host, which cannot share a
    secret it draws: without the user's, that job runs unchecked, and ``say`` tells
    how to set one.
    """
    if base.get(SECRET_VAR):
        return {}  # the ranks inherit it; Config.from_env has checked its form
    hosts = spec.assignment()
    if spec.elastic is None and spec.mode == "gloo" and spec.hosts and (len(hosts) > 1 or
                                               not is_local_host(hosts[0][0])):
        say(f"several hosts: export the same {SECRET_VAR} on every host (e.g. "
            f"{SECRET_VAR}=$(python -c 'import secrets; print(secrets.token_hex(32))')) so "
            f"that only this job's ranks join; running without one")
        return {}
    return {SECRET_VAR: draw_secret()}


def _stderr_is_tty() -> bool:
    from cgx.console import isatty
    return isatty(sys.stderr)


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
              "  --network-interface     GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME",
              "", f"Drawn by cgxrun for each job unless set: {SECRET_VAR} (never printed)"]
    return "\n".join(lines)


def _fmt(env: Mapping[str, str], cmd: Sequence[str]) -> str:
    """``VAR=value ... command`` for printing; the job's secret is redacted."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(redact(env).items())] +
                    [shlex.quote(c) for c in cmd])


def _launch(spec: RunSpec) -> int:
    base = dict(os.environ)
    say = (lambda msg: print(f"cgxrun: {msg}", file=sys.stderr, flush=True))
    extra = worker_env(spec, base)
    extra.update(secret_env(spec, base, say))  # exported by name (-x), never in a command
    env = {**base, **extra}
    try:
        from cgx.config import Config
        Config.from_env(env)  # a bad CGX_* value fails here, not on N ranks
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_program(spec.command, env)
    if spec.elastic is not None:
        return _launch_elastic(spec, env, say)
    if spec.mode == "mpi":
        mpirun = shutil.which("mpirun", path=env.get("PATH"))
        if mpirun is None:
            raise UsageError("mpirun was not found on PATH: install Open MPI (e.g. apt-get "
                             "install openmpi-bin) or MPICH, or use --gloo")
        use_mpi4py = has_mpi4py(spec.command[0], env)
        cmd = mpirun_command(spec, exported_names(env, extra), mpirun=mpirun,
                             flavor=mpi_flavor(mpirun), use_mpi4py=use_mpi4py)
        if spec.dry_run or spec.verbose:
            say(_fmt(extra, cmd))
        return 0 if spec.dry_run else run_mpirun(cmd, env)

    hosts = spec.assignment()
    node = None
    if spec.hosts and (len(hosts) > 1 or not is_local_host(hosts[0][0])):
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
    return run_torchrun(args)


def _launch_elastic(spec: RunSpec, env: Mapping[str, str], say) -> int:
    from cgx.launch.elastic import run_elastic
    if spec.dry_run or spec.verbose:
        say(f"elastic job: -np {spec.num_proc} --min-np {spec.elastic.min_np} --max-np "
            f"{spec.elastic.max_np}: {_fmt({}, spec.command)}")
    if spec.dry_run:
        return 0
    return run_elastic(spec.num_proc, spec.command, env, spec.elastic, spec.hosts,
                       spec.start_timeout, say)


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
        return record_exit(argv[1], argv[3:])  # the recorder's old spelling, still accepted
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
