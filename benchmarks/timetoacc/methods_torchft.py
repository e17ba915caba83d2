"""torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, the pinned ``torchft`` 0.2.0) as a method.

Name: ``torchft-diloco[-h<N>]``: H = N (50) inner steps of the workload's optimizer, then the
averaged parameter change (fp32, one bucketed Gloo allreduce) applied by torch's SGD with
Nesterov momentum (lr 0.7, momentum 0.9: the paper's, cgx's defaults). torchft quantizes
outer gradients only on CUDA, so its exchange here is fp32.

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

_NAME = re.compile(r"^torchft-diloco(?:-h(?P<h>[1-9][0-9]*))?$")
SYNC_EVERY = 50
OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
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
    inner = make_optimizer(model.parameters())
    outer = torch.optim.SGD(model.parameters(), **OUTER)
    diloco = DiLoCo(manager, [model], inner, outer, sync_every=period, use_bucketization=True)
    diloco.__enter__()
    params = sum(p.numel() for p in model.parameters())
    ring = 2 * (world - 1) / world * 4 * params  # one fp32 ring allreduce per round

    keep = [store]  # this rank's group store lives as long as its manager

    def close():
        diloco.__exit__(None, None, None)
        manager.shutdown()
        keep.clear()
        if server is not None:
            server.shutdown()

    return dict(module=model, optimizer=inner, close=close,
                accounted_bytes=lambda steps: ring * (steps // period),
                note=f"H={period}, Nesterov outer SGD (lr 0.7, momentum 0.9), fp32 outer "
                     "gradients in one bucket")
