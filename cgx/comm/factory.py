"""Connecting the ranks: the transport factories of :func:`cgx.runtime.init`.

One function per engine (torch.distributed, MPI, Horovod), each returning a
:class:`Connection`; the node-local and cross-node sub-transports; the progress
board on the rendezvous store; and closing. Which engine is chosen, and the
order of the steps, is :func:`cgx.runtime.init`'s.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from typing import TYPE_CHECKING, Optional

from cgx.config import Config, TorchBackend, TransportKind
from cgx.errors import CGXError, ConfigError
from cgx.launch.gate import gated_store
from cgx.launch.rendezvous import install_mpi_abort_hook, make_store
from cgx.launch.world import Launcher, WorldInfo

ELASTIC_FORMING_S = 30.0  # how long an elastic world's process groups may take to form

if TYPE_CHECKING:
    import torch

    from cgx.comm.base import Transport


@dataclasses.dataclass
class Connection:
    """A connected transport and what closing it must undo."""

    transport: "Transport"
    owns_process_group: bool = False  # cgx created torch's default group: destroy it at close
    store_address: Optional[tuple[str, int]] = None  # the rendezvous store cgx started, if any


def auto_kind(world: WorldInfo, cfg: Config, log) -> TransportKind:
    """Horovod's collectives under horovodrun --gloo when Horovod works, else torch.distributed."""
    if world.launcher is Launcher.HOROVOD_GLOO:
        from cgx.comm.horovod import HorovodMissingError, import_horovod
        try:
            import_horovod()
            return TransportKind.HOROVOD
        except HorovodMissingError as e:
            log(f"horovod.torch is not usable ({e}); using torch.distributed")
    return TransportKind.TORCH

def _local_cuda(world: WorldInfo) -> "torch.device":
    """This rank's GPU: the only one visible, else the one of its local rank."""
    import torch
    n = torch.cuda.device_count()
    if n == 1:
        return torch.device("cuda", 0)  # e.g. CUDA_VISIBLE_DEVICES gives each rank its GPU
    if world.local_rank < n:
        return torch.device("cuda", world.local_rank)
    raise ConfigError(f"local rank {world.local_rank} has no GPU: {n} CUDA devices are visible "
                      f"for {world.local_size} ranks on this node; start at most {n} ranks per "
                      f"node, or use CGX_BACKEND=gloo for CPU tensors")

def torch_device_backend(world: WorldInfo, cfg: Config, device) -> tuple["torch.device", str]:
    """(device of the tensors, torch.distributed backend) from ``device`` and CGX_BACKEND."""
    import torch
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda":
            if dev.index is None:
                dev = _local_cuda(world)
            return dev, ("gloo" if cfg.backend is TorchBackend.GLOO else "nccl")
        if cfg.backend is TorchBackend.NCCL:
            raise ConfigError(f"CGX_BACKEND=nccl needs a CUDA device, but cgx.init() got "
                              f"device={str(device)!r}; pass a cuda device or use CGX_BACKEND=gloo")
        return dev, "gloo"
    if cfg.backend is TorchBackend.GLOO:
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        if cfg.backend is TorchBackend.NCCL:
            raise ConfigError("CGX_BACKEND=nccl needs CUDA, but torch.cuda.is_available() is "
                              "False here; use CGX_BACKEND=gloo (or auto)")
        return torch.device("cpu"), "gloo"
    return _local_cuda(world), "nccl"

def connect_torch(world: WorldInfo, cfg: Config, device, explicit: bool,
                  generation: int, store=None) -> Connection:
    """A TorchTransport on the user's process group, or on one cgx creates.

    ``generation`` counts the completed inits: it names this init's rendezvous key
    (the same on every rank). ``store``: an elastic world's own store (each world
    has a fresh one, so its keys need no generation).
    """
    import torch
    import torch.distributed as dist

    from cgx.comm.torch_dist import TorchTransport

    if not dist.is_available():
        raise CGXError("this torch build has no torch.distributed; install a build with it, "
                       "or use CGX_TRANSPORT=mpi")
    if dist.is_initialized():
        # A bare "cuda" becomes this rank's GPU, as when cgx creates the group itself.
        dev = None if device is None else torch_device_backend(world, cfg, device)[0]
        return Connection(TorchTransport(_own_group(cfg), dev, owns_group=True,
                                         timeout_s=cfg.timeout_s))
    if world.size == 1 and not explicit:
        # Nothing to connect: collectives are copies. (transport="torch" still
        # creates a 1-rank group, for code that wants torch.distributed up.)
        from cgx.comm.base import SingleProcessTransport
        dev, _ = torch_device_backend(world, cfg, device)
        return Connection(SingleProcessTransport(dev))
    dev, backend = torch_device_backend(world, cfg, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    address, forming = None, cfg
    if store is not None:
        # An elastic world's ranks are all alive when its round completes: one that dies
        # while the groups form must not keep the others waiting CGX_TIMEOUT_S.
        forming = cfg.replace(timeout_s=min(cfg.timeout_s, ELASTIC_FORMING_S),
                              start_timeout_s=min(cfg.start_timeout_s, ELASTIC_FORMING_S))
        store.set_timeout(datetime.timedelta(seconds=forming.timeout_s))
        generation = 0  # ranks that joined later count their inits differently
    elif world.launcher is Launcher.TORCHRUN and world.master_addr is not None:
        # torchrun's env:// store (its agent's when TORCHELASTIC_USE_AGENT_STORE is set),
        # as init_method="env://" would open it.
        store, _, _ = next(dist.rendezvous("env://", rank=world.rank, world_size=world.size,
                                           timeout=timeout))
        store.set_timeout(timeout)
    else:
        store = make_store(world, cfg, generation)
        address = (store.host, store.port) if hasattr(store, "port") else None
    # Only the ranks that prove they know CGX_JOB_SECRET get past this (none is checked
    # without one); the group is built on the store the gate hands back.
    scope = f"{generation}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = gated_store(store, world.rank, world.size, forming, scope)
    try:
        dist.init_process_group(backend, store=store, rank=world.rank, world_size=world.size,
                                timeout=datetime.timedelta(seconds=forming.timeout_s))
    except BaseException:
        _forget_group_names()
        raise
    try:
        own = _own_group(forming)
        if forming is not cfg:  # formed: collectives get the full CGX_TIMEOUT_S again
            for group in (None, own):
                dist.distributed_c10d._set_pg_timeout(timeout, group)
        return Connection(TorchTransport(own, dev, owns_group=True, timeout_s=cfg.timeout_s),
                          owns_process_group=True, store_address=address)
    except BaseException:
        dist.destroy_process_group()
        raise

def _forget_group_names() -> None:
    """A default group that failed to form has still used up a group name (torch counts
    them and resets the count only when a formed default group is destroyed): the next
    attempt must name its groups as ranks starting afresh do, or their keys differ."""
    import torch.distributed as dist
    world = getattr(dist.distributed_c10d, "_world", None)
    if world is not None and not dist.is_initialized() and hasattr(world, "group_count"):
        world.group_count = 0


def make_board(world: WorldInfo, conn: Connection, generation: int, log):
    """A progress board on the job's rendezvous store, when there is one (else None)."""
    tr = conn.transport
    if world.size == 1 or not tr.name.startswith("torch") or world.launcher is Launcher.ELASTIC:
        return None  # (an elastic world's ranks count their inits differently)
    addr = conn.store_address
    if addr is None and os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if addr is None:
        return None
    from cgx.comm.progress import ProgressBoard
    scope = f"{generation}.{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        return ProgressBoard(addr[0], addr[1], world.rank, world.size, scope)
    except Exception as e:  # noqa: BLE001 - the board only improves messages
        log(f"no progress board ({e}); stalls will not name the missing ranks")
        return None

def _own_group(cfg: Config):
    """A process group for cgx's traffic alone, over the same ranks as the world.

    cgx reduces on a background thread; if it shared the default group with the
    user's own torch.distributed calls (DDP, a metric all_reduce), the two
    streams of collectives could interleave differently on different ranks and
    deadlock. A separate group keeps them apart. Every rank calls this once, in
    init(), so the group is created in the same order everywhere.
    """
    import torch.distributed as dist
    return dist.new_group(list(range(dist.get_world_size())),
                          timeout=datetime.timedelta(seconds=cfg.timeout_s))

def connect_mpi(world: WorldInfo, device) -> Connection:
    """An MPITransport over MPI_COMM_WORLD (ranks started by an MPI launcher)."""
    from cgx.comm.mpi import MPITransport
    tr = MPITransport(None, "cpu" if device is None else device)
    if tr.size > 1 or world.size > 1:
        install_mpi_abort_hook()
    if world.size > 1 and tr.size != world.size:
        raise ConfigError(f"CGX_TRANSPORT=mpi needs ranks started by an MPI launcher (mpirun, "
                          f"cgxrun --mpi): {world.launcher.value} started {world.size} ranks "
                          f"but MPI sees {tr.size}; use CGX_TRANSPORT=torch with this launcher")
    return Connection(tr)

def connect_horovod(device) -> Connection:
    """Horovod's own collectives as the transport (CPU tensors)."""
    from cgx.comm.horovod import HorovodTransport
    if device is not None and str(device) != "cpu":
        raise ConfigError(f"cgx's Horovod transport moves CPU tensors; got device={str(device)!r}. "
                          f"Use CGX_TRANSPORT=torch for CUDA tensors (NCCL)")
    return Connection(HorovodTransport())

def close(tr: "Transport", owns_process_group: bool) -> None:
    """Close ``tr``, and the default process group when cgx created it."""
    try:
        tr.close()
    finally:
        if owns_process_group:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()


# -- node layout ---------------------------------------------------------------------------

def sub_transports(tr: "Transport", local_groups, cross_groups):
    """(local, cross) transports; splits only when there are several nodes."""
    from cgx.comm.base import SingleProcessTransport
    if len(local_groups) == 1:
        return tr, SingleProcessTransport(tr.device)
    if all(len(g) == 1 for g in local_groups):
        return SingleProcessTransport(tr.device), tr
    # Same calls in the same order on every rank: local groups first, then cross.
    local = tr.split(local_groups)
    cross = tr.split(cross_groups)
    return local, cross
