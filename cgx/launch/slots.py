"""The worker variables horovodrun's driver gives each rank it starts.

horovodrun (``horovod/runner/gloo_run.py``, ``create_slot_env_vars``) starts every worker
with ``HOROVOD_HOSTNAME`` and its place in the host assignment of that moment
(``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE``,
``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE``), plus ``HOROVOD_ELASTIC=1`` in an elastic
job. The assignment (``horovod/runner/util/hosts.py``, ``get_host_assignments``) numbers
ranks host by host in the hosts' order, slots in order within a host; a slot's cross
rank is its host's place among the hosts that have that slot. Scripts written for
horovodrun read these at start (an exit schedule keyed by ``HOROVOD_RANK``, a log line
naming ``HOROVOD_HOSTNAME``); after a world changes, ``hvd.rank()`` and ``hvd.size()``
give the new world, as under horovodrun, and the variables keep their starting values.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from cgx.launch.world import Launcher, WorldInfo, horovod_env


def worker_env(slot: WorldInfo) -> dict[str, str]:
    """horovodrun's worker variables for ``slot``, in an elastic job."""
    return {**horovod_env(slot), "HOROVOD_ELASTIC": "1"}


def assign(placed: Iterable[tuple[str, int]], host_order: Sequence[str]) -> dict:
    """``(host, slot) -> WorldInfo`` for the ranks ``placed`` on hosts' slots, numbered as
    horovodrun numbers them: hosts in ``host_order`` (a host not in it after those that
    are, by name), slots ascending within a host."""
    where = {h: i for i, h in enumerate(host_order)}
    ordered = sorted(set(placed), key=lambda p: (where.get(p[0], len(where)), p[0], p[1]))
    by_host: dict[str, list[int]] = {}
    for host, slot in ordered:
        by_host.setdefault(host, []).append(slot)
    hosts = list(by_host)
    out = {}
    for rank, (host, slot) in enumerate(ordered):
        local_rank = by_host[host].index(slot)
        peers = [h for h in hosts if len(by_host[h]) > local_rank]
        out[host, slot] = WorldInfo(rank=rank, size=len(ordered), local_rank=local_rank,
                                    local_size=len(by_host[host]),
                                    cross_rank=peers.index(host), cross_size=len(peers),
                                    hostname=host, launcher=Launcher.ELASTIC)
    return out


def free_slot(used: Iterable[int]) -> int:
    """The lowest slot index of a host not taken by one of its live ranks."""
    taken = set(used)
    return next(i for i in range(len(taken) + 1) if i not in taken)
