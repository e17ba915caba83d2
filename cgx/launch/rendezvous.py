"""Finding rank 0: where torch.distributed's store listens, agreed without hard-coding.

* ``MASTER_ADDR``/``MASTER_PORT`` (torchrun, or set by the user): used as given.
* mpirun (Open MPI, MPICH): rank 0 opens the store on a free port, picks the
  address the others reach it at (:func:`cgx.launch.addresses.advertised_address`) and
  broadcasts both with mpi4py.
* horovodrun ``--gloo``: the same, published through horovodrun's HTTP
  key-value server (``PUT``/``GET /cgx/master.<generation>``); the others poll.

A failure on rank 0 is published too, so the others fail with its message.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request

from cgx.config import Config
from cgx.errors import CGXError, ConfigError, MissingDependencyError
from cgx.launch.addresses import advertised_address
from cgx.launch.world import Launcher, WorldInfo

# Scope of cgx's keys on horovodrun's HTTP key-value server.
KV_SCOPE = "cgx"
_abort_hook_installed = False
_exit_failing = False  # an uncaught exception, or a non-zero exit status handed to MPI_Abort


def exit_failing() -> bool:
    """True when this process is exiting because of a failure (see install_mpi_abort_hook)."""
    return _exit_failing


def make_store(world: WorldInfo, cfg: Config, generation: int = 0):
    """A TCPStore every rank reaches: rank 0 serves it, the others connect.

    ``generation`` counts earlier init() calls of this process (the same on every
    rank); it keeps each init's key on horovodrun's server apart.
    """
    if world.size == 1:
        return _serve("127.0.0.1", 0, 1, cfg)
    if world.master_addr is not None:
        if world.rank == 0:
            return _serve(world.master_addr, world.master_port, world.size, cfg)
        return _connect(world.master_addr, world.master_port, world.size, cfg)
    if world.launcher is Launcher.HOROVOD_GLOO:
        exchange = _HTTPExchange(world, cfg, generation)
    elif world.launcher in (Launcher.OPEN_MPI, Launcher.MPICH):
        exchange = _MPIExchange(world, cfg)
    else:
        raise ConfigError(f"rank 0's address is unknown: {world.launcher.value} launched "
                          f"{world.size} ranks without MASTER_ADDR/MASTER_PORT; set both "
                          f"(the host of rank 0 and a free port)")
    server = None

    def serve() -> tuple[str, int]:
        nonlocal server
        addr = advertised_address(os.environ, all_local=exchange.all_local,
                                  peers=exchange.peers)
        server = _serve(addr, 0, world.size, cfg)  # port 0: the OS picks a free port
        return addr, server.port

    addr, port = exchange.run(serve)
    return server if world.rank == 0 else _connect(addr, port, world.size, cfg)


def _connect(addr: str, port: int, world_size: int, cfg: Config):
    import torch.distributed as dist
    # Connecting waits at most the start timeout; later store operations (NCCL
    # exchanges its ids at the first collective) get the collective timeout.
    store = dist.TCPStore(addr, port, world_size, False,
                          timeout=datetime.timedelta(seconds=cfg.start_timeout_s))
    store.set_timeout(datetime.timedelta(seconds=cfg.timeout_s))
    return store


def listening_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on ``addr``'s interface only (port 0: the OS picks one).

    Handed to ``TCPStore(master_listen_fd=...)``: given only a host name, torch's store
    server listens on every interface (``*:port``, both backends, torch 2.13), also for
    127.0.0.1 (docs/security.md).
    """
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    ip = addr if family == socket.AF_INET6 else socket.gethostbyname(addr)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def _serve(addr: str, port: int, world_size: int, cfg: Config):
    import torch.distributed as dist
    try:
        sock = listening_socket(addr, port)
        port, fd = sock.getsockname()[1], sock.detach()  # the store closes fd once it has it
        try:
            return dist.TCPStore(addr, port, world_size, True,
                                 timeout=datetime.timedelta(seconds=cfg.timeout_s),
                                 wait_for_workers=False, master_listen_fd=fd)
        except BaseException:
            os.close(fd)
            raise
    except (RuntimeError, OSError) as e:
        raise CGXError(f"rank 0 could not serve its store at {addr}:{port} ({e}); if the port is "
                       f"taken set MASTER_PORT to a free one, if the address is wrong set "
                       f"GLOO_SOCKET_IFNAME (cgxrun --network-interface) or MASTER_ADDR") from e


class _Exchange:
    """Rank 0 runs ``serve()`` and publishes (addr, port); the others fetch it.

    A failure on rank 0 is published too, so that the others fail with its
    message instead of waiting.
    """

    all_local = False
    peers: list = []

    def __init__(self, world: WorldInfo, cfg: Config):
        self.world, self.cfg = world, cfg

    def run(self, serve) -> tuple[str, int]:
        if self.world.rank == 0:
            try:
                addr, port = serve()
            except BaseException as e:
                self.publish({"error": f"{type(e).__name__}: {e}"})
                raise
            self.publish({"addr": addr, "port": port})
            return addr, port
        got = self.fetch()
        if "error" in got:
            raise CGXError(f"rank 0 failed to set up the job: {got['error']}")
        return got["addr"], int(got["port"])

    def publish(self, record: dict) -> None:
        raise NotImplementedError

    def fetch(self) -> dict:
        raise NotImplementedError


class _MPIExchange(_Exchange):
    """Through mpi4py: gather host names, broadcast rank 0's endpoint."""

    def __init__(self, world, cfg):
        super().__init__(world, cfg)
        try:
            from mpi4py import MPI
        except ImportError:
            raise MissingDependencyError(
                "mpi4py", "mpi", f"cgx.init() under {world.launcher.value} (to share rank 0's "
                "address; or set MASTER_ADDR and MASTER_PORT)") from None
        self.comm = MPI.COMM_WORLD
        if self.comm.Get_size() != world.size or self.comm.Get_rank() != world.rank:
            raise ConfigError(f"MPI sees rank {self.comm.Get_rank()} of {self.comm.Get_size()} "
                              f"but the launcher's variables say {world.rank} of {world.size}; "
                              f"is mpi4py built against the MPI that launched this job?")
        install_mpi_abort_hook()
        hosts = self.comm.allgather(world.hostname)
        self.all_local = len(set(hosts)) == 1
        self.peers = sorted(set(hosts) - {world.hostname})[:1]

    def publish(self, record):
        self.comm.bcast(record, root=0)

    def fetch(self):
        return self.comm.bcast(None, root=0)


class _HTTPExchange(_Exchange):
    """Through horovodrun's HTTP key-value server (``PUT``/``GET /<scope>/<key>``)."""

    def __init__(self, world, cfg, generation: int = 0):
        super().__init__(world, cfg)
        self.all_local = world.cross_size == 1
        self.peers = [world.rendezvous_addr]
        self.url = (f"http://{world.rendezvous_addr}:{world.rendezvous_port}/{KV_SCOPE}/"
                    f"master.{generation}")

    def publish(self, record):
        data = json.dumps(record).encode()
        req = urllib.request.Request(self.url, data=data, method="PUT",
                                     headers={"Content-Length": str(len(data))})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as e:
            raise CGXError(f"could not publish rank 0's address at {self.url} ({e}); is "
                           f"horovodrun's rendezvous server reachable?") from e

    def fetch(self):
        deadline = time.monotonic() + self.cfg.start_timeout_s
        delay, last = 0.05, "no answer yet"
        while True:
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    return json.loads(resp.read().decode())
            except urllib.error.HTTPError as e:
                if e.code != 404:  # 404: rank 0 has not published yet
                    last = f"HTTP {e.code}"
            except (urllib.error.URLError, OSError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise CGXError(f"rank 0 did not publish its address at {self.url} within "
                               f"{self.cfg.start_timeout_s:g} s ({last}); check that rank 0 runs, "
                               f"or raise CGX_START_TIMEOUT_S")
            time.sleep(delay)
            delay = min(1.0, delay * 1.5)


def install_mpi_abort_hook() -> None:
    """Make an uncaught exception abort the MPI job (all ranks) at exit.

    mpi4py finalizes MPI at exit; Open MPI then waits for the other ranks,
    which may be blocked forever in a collective with this one. With an abort
    status set, mpi4py calls ``MPI_Abort`` instead and mpirun stops the job.
    """
    global _abort_hook_installed
    if _abort_hook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        global _exit_failing
        _exit_failing = True
        try:
            from mpi4py.run import set_abort_status
            set_abort_status(exc if isinstance(exc, (SystemExit, KeyboardInterrupt)) else 1)
        except Exception:  # noqa: BLE001 - never hide the original traceback
            pass
        previous(exc_type, exc, tb)

    sys.excepthook = hook
    _watch_abort_status()
    _abort_hook_installed = True


def _watch_abort_status() -> None:
    """Note when mpi4py is told to abort (``python -m mpi4py`` on a non-zero exit).

    mpi4py keeps the status to itself; cgx needs to know it at exit, to leave
    the process group open for MPI_Abort instead of closing it (see
    ``cgx.runtime._at_exit``).
    """
    mpi = sys.modules.get("mpi4py.MPI")
    original = getattr(mpi, "_set_abort_status", None)
    if original is None or getattr(original, "cgx_watch", False):
        return

    def watched(status):
        global _exit_failing
        if status:
            _exit_failing = True
        return original(status)

    watched.cgx_watch = True  # marks our wrapper: installed once
    try:
        mpi._set_abort_status = watched
    except (AttributeError, TypeError):  # a build whose module refuses: the hook still covers
        pass
