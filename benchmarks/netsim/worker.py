"""Rank-side entry point of :meth:`SlowNetwork.run_function`.

``python -m benchmarks.netsim.worker package.module:function --kwargs '{...}'``
joins a torch.distributed process group from the launcher's environment
(RANK, WORLD_SIZE, MASTER_ADDR/PORT, GLOO_SOCKET_IFNAME), calls the function
and writes its return value as JSON to the path in ``CGX_NETSIM_RESULT``.
Scripts launched with :meth:`SlowNetwork.launch` may call :func:`write_result`
themselves.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from typing import Any, Callable, Optional

RESULT_ENV = "CGX_NETSIM_RESULT"
_INIT_TIMEOUT_S = 120  # a peer that never shows up fails the rank instead of hanging it


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def load(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


def link_tx_bytes() -> int:
    """Bytes this rank's host link has sent so far: the counter of the veth that
    ``GLOO_SOCKET_IFNAME`` names, TCP/IP headers included (rank side). What the simulated
    network really carried, to set beside what a method counts; a host's ranks share it."""
    with open(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def write_result(value: Any, path: Optional[str] = None) -> str:
    """Write ``value`` as JSON to ``path`` (default: ``$CGX_NETSIM_RESULT``); returns the path.

    The file appears complete or not at all (written aside, then renamed).
    """
    path = path or os.environ.get(RESULT_ENV)
    if not path:
        raise ValueError(
            f"no result path: pass path= or set {RESULT_ENV} (SlowNetwork.run_function sets it)")
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(dumps(value))
    os.replace(tmp, path)
    return path


def resolve(target: str) -> Callable[..., Any]:
    """The function named ``"package.module:function"``."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target must be 'package.module:function', got {target!r}")
    func = getattr(importlib.import_module(module_name), attr, None)
    if not callable(func):
        raise ValueError(f"{target!r}: module {module_name!r} has no function {attr!r}")
    return func


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netsim.worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="package.module:function")
    parser.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    parser.add_argument("--backend", default="gloo", help="torch.distributed backend, or 'none'")
    args = parser.parse_args(argv)
    func = resolve(args.target)
    kwargs = json.loads(args.kwargs)

    dist = None
    if args.backend != "none":
        import torch.distributed as dist

        dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S))
    try:
        value = func(**kwargs)
    finally:
        if dist is not None:
            dist.destroy_process_group()
    write_result(value)


def _leave() -> None:
    """Exit 0 without the interpreter's final teardown, which aborts now and then after a
    DDP model on Gloo ("terminate called without an active exception"; tests/spawn.py
    measured about one run in six) although the result is written. Exit handlers run."""
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    _leave()
