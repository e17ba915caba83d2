"""The node layout, agreed once the ranks are connected.

The launcher's :class:`~cgx.launch.world.WorldInfo` may only assume how ranks
are placed on nodes; :func:`node_layout` checks it against every rank's host
name (one allgather of :func:`layout_row`) and gives the local and cross groups.
"""

from __future__ import annotations

import dataclasses

from cgx.errors import ConfigError
from cgx.launch.world import Launcher, WorldInfo


def adopt_group(world: WorldInfo, rank: int, size: int) -> tuple[WorldInfo, bool]:
    """Check the transport's group (this ``rank`` of ``size``) against the launcher's world.

    Returns (world, adopted): adopted when no known launcher started the ranks
    and the world comes from the transport's group.
    """
    if size == world.size and rank == world.rank:
        return world, False
    if world.launcher is Launcher.SINGLE:
        # A group the user made without a launcher we know: the group is the world;
        # node_layout() measures the nodes from host names.
        return dataclasses.replace(
            world, rank=rank, size=size, local_rank=0, local_size=1, cross_rank=0,
            cross_size=1, cross_derived=True,
            notes=world.notes + ("world taken from the transport's group",)), True
    raise ConfigError(f"the transport's group has rank {rank} of {size}, but "
                      f"{world.launcher.value} started this process as rank {world.rank} of "
                      f"{world.size}; pass a transport over all ranks of the job")


def layout_from_hosts(hosts: list[str]) -> list[tuple[int, int, int]]:
    """(node index, local rank, local size) of every rank, from their host names.

    Nodes are numbered in the order of their lowest rank; local ranks follow
    global rank order on each node.
    """
    nodes: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        nodes.setdefault(h, []).append(r)
    index = {h: i for i, h in enumerate(nodes)}
    return [(index[h], nodes[h].index(r), len(nodes[h])) for r, h in enumerate(hosts)]


def layout_row(world: WorldInfo) -> tuple:
    """What each rank tells the others for :func:`node_layout` (one allgather)."""
    return (world.hostname, world.local_rank, world.local_size, world.cross_rank)


def node_layout(world: WorldInfo, rows: list, adopted: bool = False):
    """The node layout from every rank's :func:`layout_row`: (world, local groups, cross groups).

    Launcher values are kept when the launcher gave them; derived node indices
    (and, for an adopted group, everything) come from the host names.
    """
    if world.cross_derived:
        measured = layout_from_hosts([row[0] for row in rows])
        if adopted or all((m[1], m[2]) == (row[1], row[2]) for m, row in zip(measured, rows)):
            node, lrank, lsize = measured[world.rank]
            nodes = max(m[0] for m in measured) + 1
            world = dataclasses.replace(
                world, local_rank=lrank, local_size=lsize, cross_rank=node, cross_size=nodes,
                cross_derived=False,
                notes=tuple(n for n in world.notes if not n.startswith("cross_rank/cross_size"))
                + ("node layout measured from host names",))
            rows = [(h, m[1], m[2], m[0]) for (h, *_), m in zip(rows, measured)]
        else:
            world = dataclasses.replace(world, notes=world.notes + (
                "host names disagree with the launcher's local ranks: kept rank // local_size",))
    node_of = [row[3] for row in rows]
    local_groups: dict[int, list[int]] = {}
    for r, n in enumerate(node_of):
        local_groups.setdefault(n, []).append(r)
    for r, (_, lrank, lsize, node) in enumerate(rows):
        members = local_groups[node]
        if len(members) != lsize or members.index(r) != lrank:
            raise ConfigError(
                f"the launcher's node layout is inconsistent: rank {r} says it is local rank "
                f"{lrank} of {lsize} on node {node}, but the ranks on node {node} are {members}; "
                f"check the launcher's LOCAL_* and node variables")
    cross_groups: dict[int, list[int]] = {}
    for r, row in enumerate(rows):
        cross_groups.setdefault(row[1], []).append(r)
    return (world, [local_groups[n] for n in sorted(local_groups)],
            [cross_groups[lr] for lr in sorted(cross_groups)])
