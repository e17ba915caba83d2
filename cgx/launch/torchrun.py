"""``cgxrun --gloo``: the ranks of one host started by torch.distributed.run, run in-process."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from typing import Optional

from cgx.launch.addresses import is_local_host
from cgx.launch.exit_record import EXIT_RECORD_VAR, exit_code, first_recorded_failure
from cgx.launch.spec import RunSpec


# torch.distributed.run's static rendezvous, with its store bound to one interface
# (StaticTCPRendezvous's own store listens on all of them): registered in cgxrun's
# process, where torch.distributed.run runs.
RDZV_BACKEND = "cgx-static"
LOOPBACK = "127.0.0.1"


def torchrun_args(spec: RunSpec, node_rank: Optional[int] = None) -> list[str]:
    """Arguments of ``python -m torch.distributed.run`` for one host's ranks.

    One host: the store on 127.0.0.1, a port the OS picks. Several hosts: on the
    first host of ``-H``, port ``--master-port``.
    """
    hosts = spec.assignment()
    conf = f"rank={node_rank or 0}"
    if spec.start_timeout is not None:
        conf += f",timeout={int(spec.start_timeout)}"
    if node_rank is None:
        args = ["--nnodes", "1", "--node-rank", "0", "--nproc-per-node", str(spec.num_proc),
                "--rdzv-backend", RDZV_BACKEND, "--rdzv-endpoint", f"{LOOPBACK}:0"]
    else:
        args = ["--nnodes", str(len(hosts)), "--node-rank", str(node_rank),
                "--nproc-per-node", str(hosts[node_rank][1]), "--rdzv-backend", RDZV_BACKEND,
                "--rdzv-endpoint", f"{hosts[0][0]}:{spec.master_port}"]
    return args + ["--rdzv-conf", conf, "--no-python", *spec.command]


def _bound_rendezvous(params):
    """torch.distributed.run's handler for ``--rdzv-backend cgx-static``."""
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """The static rendezvous; node 0 serves the store on the endpoint's interface.

        A loopback endpoint is served on loopback only when all nodes are this one;
        an endpoint that resolves to loopback for a multi-host job (a host name
        mapped to 127.0.1.1) keeps torch's default, every interface, so that the
        other hosts still reach it.
        """

        def get_backend(self) -> str:
            return RDZV_BACKEND

        def next_rendezvous(self):
            if self._store is None and self.rank == 0:
                from cgx.launch.rendezvous import listening_socket
                ip = socket.gethostbyname(self.master_addr)
                if not ip.startswith("127.") or self.world_size == 1:
                    sock = listening_socket(ip, self.master_port)
                    self.master_port, fd = sock.getsockname()[1], sock.detach()
                    self._store = TCPStore(self.master_addr, self.master_port,
                                           self.world_size, True, self.timeout,
                                           multi_tenant=True, master_listen_fd=fd)
            if self._store is None:
                return super().next_rendezvous()
            return RendezvousInfo(PrefixStore(self.run_id, self._store), self.rank,
                                  self.world_size,
                                  RendezvousStoreInfo(self.master_addr, self.master_port))

    addr, port = parse_rendezvous_endpoint(params.endpoint.strip(), -1)
    timeout = int(params.config.get("timeout", 600))
    return BoundStaticRendezvous(addr, port, int(params.config.get("rank", 0)),
                                 params.max_nodes, params.run_id, timeout)


def _register_backend() -> None:
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    rendezvous_handler_registry.register(RDZV_BACKEND, _bound_rendezvous)


def local_node(spec: RunSpec) -> Optional[int]:
    """Index of this machine in ``-H`` (None: not listed, or listed more than once)."""
    matches = [i for i, (h, _) in enumerate(spec.assignment()) if is_local_host(h)]
    return matches[0] if len(matches) == 1 else None


def run_torchrun(args: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args as torchrun_parse, run as torchrun_run

    _register_backend()
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
