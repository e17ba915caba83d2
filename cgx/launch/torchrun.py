"""``cgxrun --gloo``: the ranks of one host started by torch.distributed.run, run in-process."""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional

from cgx.launch.addresses import is_local_host
from cgx.launch.exit_record import EXIT_RECORD_VAR, exit_code, first_recorded_failure
from cgx.launch.spec import RunSpec


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
    matches = [i for i, (h, _) in enumerate(spec.assignment()) if is_local_host(h)]
    return matches[0] if len(matches) == 1 else None


def run_torchrun(args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse, run as torchrun_run

    with tempfile.TemporaryDirectory(prefix="cgxrun-") as record_dir:
        os.environ[EXIT_RECORD_VAR] = record_dir  # cgx.runtime notes its exit start there
        i = args.index("--no-python") + 1
        args = args[:i] + [sys.executable, "-m", "cgx.launch.exit_record", record_dir,
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
            return exit_code(code) or 1
        except SignalException as e:
            return 128 + int(e.sigval)
    return 0
