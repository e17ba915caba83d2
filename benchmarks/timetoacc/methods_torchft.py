"""torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, the pinned ``torchft`` 0.2.0) as a method.

Names:
    torchft-diloco[-h<N>]   H = N (50) inner steps of the workload's optimizer, then the
                            averaged parameter change (fp32, one bucketed Gloo allreduce)
                            applied by torch's SGD with Nesterov momentum (lr 0.7, momentum
                            0.9: the paper's, cgx's defaults)
    torchft-diloco-streaming[-h<N>]  Streaming DiLoCo: the parameters in 5 fragments
                            (cgx's partition: ``cgx.diloco.schedule.balanced_fragments``),
                            one synced every H / 5 steps, its exchange overlapping one inner
                            step (``fragment_sync_delay=1``), as ``cgx-diloco-streaming``

torchft quantizes outer gradients only on CUDA, so its exchanges here are fp32.

Each rank is a replica group of its own (group size 1), as torchft runs data-parallel
replicas: a TCPStore and a ``Manager`` per rank, rank 0 serving the lighthouse that forms the
quorum. The ranks' addresses are those the caller's ``torch.distributed`` group uses
(``MASTER_ADDR`` for rank 0; each rank's own from its host name, which resolves to its
address inside the simulated hosts and to loopback elsewhere).
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta

from benchmarks.timetoacc.counters import ring_bytes

_NAME = re.compile(r"^torchft-diloco(?P<streaming>-streaming)?(?:-h(?P<h>[1-9][0-9]*))?$")
SYNC_EVERY = 50
STREAMING = {"fragments": 5, "delay": 1}
# Rounds are long (H steps, rank 0's evaluations between them): torchft's 60 s default
# quorum timeout would end a slow run.
TIMEOUT = timedelta(minutes=10)


def handles(name: str) -> bool:
    return _NAME.match(name) is not None


def _own_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _lighthouse(world: int):
    """Rank 0 starts the lighthouse; every rank gets (the server or None, its address)."""
    import torch.distributed as dist
    server, address = None, [None]
    if dist.get_rank() == 0:
        from torchft._torchft import LighthouseServer
        server = LighthouseServer(bind="[::]:0", min_replicas=world)
        port = server.address().rsplit(":", 1)[1]
        address = [f"http://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"]
    dist.broadcast_object_list(address, 0)
    return server, address[0]


def fragments(model, count: int) -> list:
    """``count`` modules holding the model's trainable parameters (the same tensors) in
    cgx's balanced partition: torchft syncs modules, cgx parameter groups."""
    import torch
    from cgx.diloco.schedule import balanced_fragments
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    out = []
    for group in balanced_fragments([p.numel() for _, p in named], count):
        holder = torch.nn.Module()
        for i in group:
            holder.register_parameter(named[i][0].replace(".", "_"), named[i][1])
        out.append(holder)
    return out


def build(name: str, model, make_optimizer, world: int) -> dict:
    """The fields of ``methods.Setup``: the inner optimizer is what the loop steps (torchft's
    DiLoCo hooks its ``step``)."""
    m = _NAME.match(name)
    if m is None:
        raise ValueError(f"not a torchft method: {name!r}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum at INFO
    try:
        import torch
        from torch.distributed import TCPStore
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as err:
        raise RuntimeError(f"{name} needs torchft 0.2.0 ({err}); `make install` installs it "
                           "(setup.cfg's `bench` extra)") from err
    import torch.distributed as dist
    period = int(m.group("h") or SYNC_EVERY)
    server, lighthouse = _lighthouse(world)
    host = _own_address()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT), min_replica_size=world, use_async_quorum=False,
        load_state_dict=None, state_dict=None, replica_id=str(dist.get_rank()),
        store_addr=host, store_port=store.port, rank=0, world_size=1,
        lighthouse_addr=lighthouse, hostname=host, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT, init_sync=False)  # the models start equal (one seed)
    from cgx.diloco import OuterSGD
    d = OuterSGD()  # cgx's default, as torch.optim.SGD's kwargs
    outer_kwargs = {"lr": d.lr, "momentum": d.momentum, "nesterov": d.nesterov}
    streaming = bool(m.group("streaming"))
    parts = fragments(model, STREAMING["fragments"]) if streaming else [model]
    inner = make_optimizer(model.parameters())
    outer = [torch.optim.SGD(part.parameters(), **outer_kwargs) for part in parts]
    diloco = DiLoCo(manager, parts, inner, outer, sync_every=period, use_bucketization=True,
                    fragment_sync_delay=STREAMING["delay"] if streaming else 0)
    diloco.__enter__()
    sizes = [sum(p.numel() for p in part.parameters()) for part in parts]

    def accounted(steps: int) -> float:
        """One fp32 ring allreduce of a fragment every H / fragments steps, in turn."""
        syncs = steps // (period // len(parts))
        return ring_bytes(4 * sum(sizes[c % len(parts)] for c in range(syncs)), world)

    keep = [store]  # this rank's group store lives as long as its manager

    def close():
        diloco.__exit__(None, None, None)
        manager.shutdown()
        keep.clear()
        if server is not None:
            server.shutdown()

    return dict(module=model, optimizer=inner, close=close, accounted_bytes=accounted,
                note=f"H={period}, {len(parts)} fragment(s), Nesterov outer SGD (lr 0.7, "
                     "momentum 0.9), fp32 outer gradients bucketed")
