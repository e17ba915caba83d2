"""cgxrun (cgx.launch.cli): flags, command construction, and real launches.

Parsing and command construction are tested without launching anything; the
multiproc tests start 2 ranks through ``cgxrun --gloo`` and ``cgxrun --mpi``
and check the world view, exported variables, and that a failing rank's exit
code comes back while its sibling is stopped.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from cgx.config import ENV_VARS
from cgx.launch import cli as run
from cgx.launch import exit_record, mpirun, torchrun
from cgx.launch.spec import Host, UsageError
from cgx.launch.cli import parse_args
from distutil import WORLD_SNIPPET, check_world, cgxrun_command, free_port, have_mpirun, run_ranks

LAUNCH_TIMEOUT_S = 180


# -- parsing ---------------------------------------------------------------------------------

def test_parse_basic_and_program_arguments():
    spec = parse_args(["-np", "2", "python", "train.py", "--lr", "0.1", "-np", "9"])
    assert spec.num_proc == 2 and spec.mode == "gloo"
    assert spec.command == ("python", "train.py", "--lr", "0.1", "-np", "9")


def test_parse_double_dash():
    spec = parse_args(["--num-proc", "3", "--mpi", "--", "python", "x.py", "--", "y"])
    assert spec.mode == "mpi" and spec.command == ("python", "x.py", "--", "y")


def test_parse_all_flags():
    spec = parse_args(["-np", "3", "-H", "a:2,b", "--gloo", "--fusion-threshold-mb", "32",
                       "--timeline-filename", "/tmp/t.json", "--verbose", "--start-timeout", "30",
                       "--network-interface", "eth0", "--node-rank", "1", "--master-port", "1234",
                       "--mpi-args", "--mca btl tcp,self", "prog"])
    assert spec.hosts == (Host("a", 2), Host("b", 1))
    assert (spec.fusion_threshold_mb, spec.timeline_filename, spec.verbose) == (32.0,
                                                                               "/tmp/t.json", True)
    assert (spec.start_timeout, spec.network_interface) == (30.0, "eth0")
    assert (spec.node_rank, spec.master_port) == (1, 1234)
    assert spec.mpi_args == ("--mca", "btl", "tcp,self")


def test_assignment_fills_slots_in_order():
    spec = parse_args(["-np", "3", "-H", "a:2,b:2,c:4", "prog"])
    assert spec.assignment() == [("a", 2), ("b", 1)]
    assert parse_args(["-np", "2", "prog"]).assignment() == [("localhost", 2)]


@pytest.mark.parametrize("argv,match", [
    (["python", "x.py"], r"-np/--num-proc is required"),
    (["-np", "0", "prog"], r"-np 0 must be at least 1"),
    (["-np", "two", "prog"], r"argument -np/--num-proc: invalid int value: 'two'"),
    (["-np", "2"], r"no program given"),
    (["-np", "2", "--"], r"no program given"),
    (["-np", "5", "-H", "a:2,b:2", "prog"], r"-np 5 needs 5 slots but -H a:2,b:2 gives 4; "
                                             r"add hosts or slots, or lower -np"),
    (["-np", "1", "-H", "a:x", "prog"], r"-H entry 'a:x': slots must be a positive whole number"),
    (["-np", "1", "-H", "a:0", "prog"], r"-H entry 'a:0': slots must be a positive"),
    (["-np", "1", "-H", ":2", "prog"], r"-H entry ':2' is not HOST or HOST:SLOTS"),
    (["-np", "1", "-H", "a:", "prog"], r"-H entry 'a:' is not HOST or HOST:SLOTS"),
    (["-np", "1", "-H", "a:1,a:2", "prog"], r"-H lists host 'a' twice"),
    (["-np", "1", "--fusion-threshold-mb", "0", "prog"], r"--fusion-threshold-mb 0 is out of "
                                                         r"range; expected a size in MB"),
    (["-np", "1", "--fusion-threshold-mb", "5000", "prog"], r"--fusion-threshold-mb 5000"),
    (["-np", "1", "--start-timeout", "-1", "prog"], r"--start-timeout -1 must be a positive"),
    (["-np", "1", "--master-port", "0", "prog"], r"--master-port 0 is not a TCP port"),
    (["-np", "1", "--network-interface", "", "prog"], r"--network-interface is empty"),
    (["-np", "1", "--gloo", "--mpi", "prog"], r"argument --mpi: not allowed with argument --gloo"),
    (["-np", "1", "--bogus", "prog"], r"unrecognized arguments: --bogus|see cgxrun --help"),
    (["-np", "2", "--mpi", "--node-rank", "0", "prog"], r"--node-rank is for --gloo runs"),
    (["-np", "2", "-H", "a:1,b:1", "--node-rank", "2", "prog"],
     r"--node-rank 2 is out of range: .* uses 2 host\(s\), so 0..1"),
])
def test_bad_flags(argv, match):
    with pytest.raises(UsageError, match=match):
        parse_args(argv)


def test_bad_flags_exit_2_with_message(capsys):
    assert run.main(["-np", "0", "python"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cgxrun: error: -np 0 must be at least 1")


def test_bad_flags_exit_2_from_the_console_script():
    out = subprocess.run(cgxrun_command() + ["-np", "3", "-H", "a:1", "python"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "cgxrun: error: -np 3 needs 3 slots but -H a:1 gives 1" in out.stderr


def test_help_env(capsys):
    assert run.main(["--help-env"]) == 0
    out = capsys.readouterr().out
    for name in ENV_VARS:
        assert name in out
    assert "--fusion-threshold-mb   CGX_FUSION_BUFFER_SIZE_MB" in out


def test_help_env_after_the_program_belongs_to_the_program(capsys):
    assert run.main(["-np", "1", "--dry-run", sys.executable, "x.py", "--help-env"]) == 0
    assert "--help-env" in capsys.readouterr().err  # in the printed command, not handled


# -- checks before launching ---------------------------------------------------------------------

@pytest.mark.parametrize("prog,match", [
    ("no-such-program-xyz", r"program 'no-such-program-xyz' was not found on PATH"),
    ("./missing.py", r"program './missing.py' does not exist; check the path; run Python "
                     r"scripts through the interpreter, e.g. cgxrun -np 2 python ./missing.py"),
])
def test_missing_program(prog, match, capsys):
    assert run.main(["-np", "2", prog]) == 2
    assert capsys.readouterr().err.startswith("cgxrun: error: ")
    with pytest.raises(UsageError, match=match):
        run.check_program([prog], os.environ)


def test_program_not_executable(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    with pytest.raises(UsageError, match=r"is not executable; chmod \+x it; run Python scripts"):
        run.check_program([str(script)], os.environ)


def test_mpirun_missing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun here
    assert run.main(["-np", "2", "--mpi", sys.executable, "x.py"]) == 2
    assert "mpirun was not found on PATH: install Open MPI" in capsys.readouterr().err


def test_bad_cgx_variable_fails_before_launch(monkeypatch, capsys):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "12")
    assert run.main(["-np", "2", "--dry-run", sys.executable, "x.py"]) == 2
    assert "CGX_COMPRESSION_QUANTIZATION_BITS=12 is out of range" in capsys.readouterr().err


# -- what the ranks get -------------------------------------------------------------------------

def test_worker_env(monkeypatch):
    monkeypatch.setattr(run, "_stderr_is_tty", lambda: False)
    spec = parse_args(["-np", "2", "--fusion-threshold-mb", "8.5", "--timeline-filename", "t.json",
                       "--verbose", "--start-timeout", "45", "--network-interface", "eth0, eth1",
                       "prog"])
    env = run.worker_env(spec, {})
    assert env == {"CGX_FUSION_BUFFER_SIZE_MB": "8.5", "CGX_TIMELINE": "t.json",
                   "CGX_VERBOSE": "1", "CGX_START_TIMEOUT_S": "45",
                   "GLOO_SOCKET_IFNAME": "eth0,eth1", "NCCL_SOCKET_IFNAME": "eth0,eth1",
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                   "CGXRUN_TAG_OUTPUT": "1", "CGXRUN_TTY": "0"}
    # The user's own settings win; one rank per host needs no thread limit.
    env = run.worker_env(parse_args(["-np", "2", "prog"]), {"OMP_NUM_THREADS": "4",
                                                           "PYTHONUNBUFFERED": "0"})
    assert env == {"CGXRUN_TAG_OUTPUT": "1", "CGXRUN_TTY": "0"}
    monkeypatch.setattr(run, "_stderr_is_tty", lambda: True)
    env = run.worker_env(parse_args(["-np", "2", "--no-tag-output", "--output-filename", "logs",
                                     "prog"]), {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "0"})
    assert env == {"CGXRUN_TAG_OUTPUT": "0", "CGXRUN_TTY": "1",
                   "CGXRUN_OUTPUT_DIR": os.path.abspath("logs")}
    assert "OMP_NUM_THREADS" not in run.worker_env(parse_args(["-np", "1", "prog"]), {})


def test_torchrun_args_single_host():
    spec = parse_args(["-np", "4", "--start-timeout", "30", "python", "t.py"])
    # the store on loopback only, on a port the OS picks (cgx-static binds it)
    assert torchrun.torchrun_args(spec) == [
        "--nnodes", "1", "--node-rank", "0", "--nproc-per-node", "4", "--rdzv-backend",
        "cgx-static", "--rdzv-endpoint", "127.0.0.1:0", "--rdzv-conf", "rank=0,timeout=30",
        "--no-python", "python", "t.py"]


def test_torchrun_args_per_host():
    spec = parse_args(["-np", "3", "-H", "a:2,b:2", "--master-port", "1234", "prog", "x"])
    assert torchrun.torchrun_args(spec, 1) == [
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--rdzv-backend",
        "cgx-static", "--rdzv-endpoint", "a:1234", "--rdzv-conf", "rank=1", "--no-python",
        "prog", "x"]


def test_multi_host_gloo_without_this_host_prints_per_host_commands(capsys):
    assert run.main(["-np", "2", "-H", "host-a.invalid:1,host-b.invalid:1", "--dry-run",
                     sys.executable, "t.py"]) == 2
    err = capsys.readouterr().err
    assert "Run on each host:" in err and "or use --mpi" in err
    assert "on host-a.invalid: cgxrun -np 2 -H host-a.invalid:1,host-b.invalid:1 --node-rank 0" \
        in err
    assert "--node-rank 1 -- " in err


def test_multi_host_gloo_finds_this_host(capsys):
    spec = parse_args(["-np", "2", "-H", "host-a.invalid:1,localhost:1", "prog"])
    assert torchrun.local_node(spec) == 1
    assert run.main(["-np", "2", "-H", "host-a.invalid:1,localhost:1", "--dry-run",
                     sys.executable, "t.py"]) == 0
    assert "--node-rank 1 --nproc-per-node 1" in capsys.readouterr().err
    # Listed twice (two local names): ambiguous, --node-rank must say which.
    assert torchrun.local_node(parse_args(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "p"])) is None


def _spec(*argv):
    return parse_args([*argv])


@pytest.mark.parametrize("argv,root,cores,want", [
    (["-np", "2", "python", "t.py"], False, 8,
     "mpirun -np 2 --bind-to none --map-by slot --tag-output -x CGX_A python -m mpi4py t.py"),
    (["-np", "4", "python", "t.py"], True, 2,
     "mpirun -np 4 --bind-to none --map-by slot --allow-run-as-root --oversubscribe "
     "--tag-output -x CGX_A "
     "python -m mpi4py t.py"),
    (["-np", "4", "-H", "a:2,b:2", "--network-interface", "eth0", "--mpi-args", "--mca x y",
      "./prog", "arg"], False, 2,
     "mpirun -np 4 -H a:2,b:2 --bind-to none --map-by slot --mca btl_tcp_if_include eth0 "
     "--mca oob_tcp_if_include eth0 --tag-output -x CGX_A --mca x y ./prog arg"),
])
def test_mpirun_command_open_mpi(argv, root, cores, want):
    cmd = mpirun.mpirun_command(_spec(*argv), ["CGX_A"], cores=cores, is_root=root)
    assert shlex.join(cmd) == want


def test_mpirun_command_hydra():
    spec = _spec("-np", "4", "-H", "a:2,b:2", "--network-interface", "ib0,eth0", "python", "t.py")
    cmd = mpirun.mpirun_command(spec, ["CGX_A", "PATH"], flavor="hydra", use_mpi4py=False)
    assert shlex.join(cmd) == ("mpirun -n 4 -hosts a:2,b:2 -iface ib0 -genvlist CGX_A,PATH "
                               "-prepend-rank python t.py")


@pytest.mark.parametrize("cmd,want", [
    ("python t.py a", "python -m mpi4py t.py a"),
    ("/usr/bin/python3.11 -u -W ignore t.py", "/usr/bin/python3.11 -u -W ignore -m mpi4py t.py"),
    ("python -m pkg.mod x", "python -m mpi4py -m pkg.mod x"),
    ("python -c 'print(1)'", "python -m mpi4py -c 'print(1)'"),
    ("python -m mpi4py t.py", "python -m mpi4py t.py"),
    ("python", "python"),
    ("python -i t.py", "python -i t.py"),
    ("./train.sh python t.py", "./train.sh python t.py"),
])
def test_mpi4py_command(cmd, want):
    assert shlex.join(mpirun.mpi4py_command(shlex.split(cmd))) == want


def test_exported_names():
    names = mpirun.exported_names({"CGX_X": "1", "PATH": "/bin", "HOME": "/root", "NCCL_DEBUG": "1",
                                "SECRET": "s"}, {"OMP_NUM_THREADS": "1"})
    assert names == ["CGX_X", "NCCL_DEBUG", "OMP_NUM_THREADS", "PATH"]


@pytest.mark.skipif(not have_mpirun(), reason="mpirun is not installed")
def test_dry_run_mpi(capsys):
    assert run.main(["-np", "2", "--mpi", "--dry-run", "--fusion-threshold-mb", "8",
                     sys.executable, "t.py"]) == 0
    err = capsys.readouterr().err
    assert "CGX_FUSION_BUFFER_SIZE_MB=8" in err and "-x CGX_FUSION_BUFFER_SIZE_MB" in err
    assert "-m mpi4py t.py" in err


def test_physical_cores():
    assert 1 <= mpirun.physical_cores() <= (os.cpu_count() or 1)


# -- the exit recorder (supervision of torch.distributed.run's workers) ---------------------------

def test_first_recorded_failure(tmp_path):
    assert exit_record.first_recorded_failure(str(tmp_path)) is None
    (tmp_path / "rank0").write_text("2000 1")
    (tmp_path / "rank1").write_text("1000 3")
    (tmp_path / "rank2").write_text("garbage")
    assert exit_record.first_recorded_failure(str(tmp_path)) == (1, 3)


def test_record_exit_keeps_code_and_signal(tmp_path):
    rec = [sys.executable, "-m", "cgx.launch.exit_record", str(tmp_path), "--", sys.executable,
           "-c"]
    env = {**os.environ, "RANK": "5"}
    out = subprocess.run(rec + ["import sys; sys.exit(3)"], env=env, timeout=60)
    assert out.returncode == 3
    assert (tmp_path / "rank5").read_text().split()[1] == "3"
    out = subprocess.run(rec + ["import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
                         env=env, timeout=60)
    assert out.returncode == -signal.SIGKILL
    out = subprocess.run(rec + ["pass"], env={**os.environ, "RANK": "6"}, timeout=60)
    assert out.returncode == 0 and not (tmp_path / "rank6").exists()


# -- real launches ------------------------------------------------------------------------------

@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,reported", [
    ("cgxrun-gloo", "torchrun"),
    pytest.param("cgxrun-mpi", "open_mpi",
                 marks=pytest.mark.skipif(not have_mpirun(), reason="mpirun is not installed")),
])
def test_cgxrun_two_ranks(launcher, reported, tmp_path):
    timeline = str(tmp_path / "tl.json")
    res = run_ranks(WORLD_SNIPPET, launcher=launcher, timeout=LAUNCH_TIMEOUT_S,
                    launcher_args=["--fusion-threshold-mb", "8", "--timeline-filename", timeline])
    outs = res.check()
    check_world(outs, reported)
    for o in outs:
        assert o["config"] == {"fusion_mb": 8.0, "verbose": False, "timeline": timeline}


@pytest.mark.multiproc
def test_cgxrun_gloo_two_hosts(tmp_path):
    """Two cgxrun processes, one per "host" of -H (both this machine, told apart by --node-rank)."""
    port = str(free_port())
    hosts = "127.0.0.1:1,localhost:1"
    procs = []
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    script = tmp_path / "w.py"
    script.write_text(f"from distutil import report\n{WORLD_SNIPPET}")
    env.update(CGX_TEST_OUT=str(tmp_path), PYTHONPATH=os.path.dirname(__file__))
    for node in (0, 1):
        procs.append(subprocess.Popen(
            cgxrun_command() + ["-np", "2", "-H", hosts, "--node-rank", str(node),
                                "--master-port", port, "--start-timeout", "120",
                                sys.executable, str(script)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
    try:
        logs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    import json
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    check_world(outs, "torchrun", local_size=1)  # 2 nodes of 1 rank (GROUP_RANK/WORLD_SIZE)


FAILING_RANK = """
import os, sys, time, torch, cgx
cgx.init()
if cgx.rank() == 1:
    time.sleep(1)
    sys.exit(3)
report({"pid": os.getpid()})
cgx.runtime.transport().allreduce(torch.ones(1))  # rank 1 is gone: fails or hangs
time.sleep(600)
"""


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", [
    "cgxrun-gloo",
    pytest.param("cgxrun-mpi",
                 marks=pytest.mark.skipif(not have_mpirun(), reason="mpirun is not installed")),
])
def test_failing_rank_exit_code_and_sibling_stopped(launcher):
    start = time.monotonic()
    res = run_ranks(FAILING_RANK, launcher=launcher, timeout=LAUNCH_TIMEOUT_S)
    assert not res.timed_out, res.tail()
    assert res.returncode == 3, res.tail()
    assert not _running(res.outputs[0]["pid"])  # rank 0 was stopped, not left behind
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S


def _running(pid: int) -> bool:
    """True if ``pid`` runs (a zombie waiting for its parent to reap it has stopped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.multiproc
def test_killed_rank_gives_128_plus_signal():
    res = run_ranks("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(600)
    """, launcher="cgxrun-gloo", timeout=LAUNCH_TIMEOUT_S)
    assert not res.timed_out and res.returncode == 128 + signal.SIGKILL, res.tail()
    assert "rank 1 failed first" in res.stderr


# -- what a person sees: rank-prefixed lines, per-rank logs, default signals --------------

OUTPUT_PROG = r"""
import os, signal, sys
r = os.environ["RANK"]
print("sigint-default", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
for i in range(3):
    sys.stdout.write(f"progress {i}\r")
    sys.stdout.flush()
for i in range(300):
    print(f"line {r} {i} " + "x" * 200)
print(f"to stderr {r}", file=sys.stderr)
"""


@pytest.mark.multiproc
def test_output_lines_are_prefixed_never_mixed_and_logged(tmp_path):
    prog = tmp_path / "out.py"
    prog.write_text(OUTPUT_PROG)
    logs = tmp_path / "logs"
    cmd = [*cgxrun_command(), "-np", "2", "--output-filename", str(logs),
           sys.executable, str(prog)]
    # Started as a background job would be: SIGINT ignored. The workers must still get
    # the default disposition (so a launcher's SIGINT stops them).
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln]
    pattern = re.compile(r"^\[(\d)\]<stdout>:(line (\d) \d+ x{200}|sigint-default True)$")
    for ln in lines:
        m = pattern.match(ln)
        assert m, f"a mixed or unprefixed line: {ln[:120]!r}"
        assert m.group(3) in (None, m.group(1))  # each line under its own rank's prefix
    assert sum(ln.startswith("[0]<stdout>:line") for ln in lines) == 300
    assert sum(ln.startswith("[1]<stdout>:line") for ln in lines) == 300
    assert "\r" not in proc.stdout  # progress frames are not written into a non-terminal
    assert "[1]<stderr>:to stderr 1" in proc.stderr
    for r in (0, 1):
        out = (logs / f"rank.{r}" / "stdout").read_text()
        assert out.count(f"line {r} ") == 300 and "[" not in out.split("\n")[1]
        assert (logs / f"rank.{r}" / "stderr").read_text() == f"to stderr {r}\n"


def test_progress_bars_only_for_a_person(monkeypatch):
    from cgx import console
    monkeypatch.setenv("CGXRUN_TTY", "0")
    assert console.progress(range(3)).disable
    monkeypatch.setenv("CGXRUN_TTY", "1")
    monkeypatch.setenv("RANK", "1")
    assert console.progress(range(3)).disable  # not rank 0
    monkeypatch.setenv("RANK", "0")
    assert not console.progress(range(3)).disable


def test_the_launcher_runs_as_a_module_and_the_old_paths_are_gone():
    """``python -m cgx.launch.cli`` is ``cgxrun``; 0.2.0 removed the re-exports of 0.1.0
    (cgx.run, cgx.launcher, cgx.rendezvous, ...: see CHANGELOG.md)."""
    import importlib
    out = subprocess.run([sys.executable, "-m", "cgx.launch.cli", "--help-env"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "CGX_COMPRESSION" in out.stdout
    for old in ("cgx.run", "cgx.launcher", "cgx.rendezvous", "cgx.grad_plan",
                "cgx.collectives.functional", "cgx.compression.quantization",
                "cgx.compression.quantizer", "cgx.compression.wire", "cgx.compression.cpu"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
