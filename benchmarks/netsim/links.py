"""The wires between the simulated hosts: veth pairs, the switch's bridge, addresses.

Every veth is created from inside a host's namespace (``ip -n NS link add``),
so the root namespace never sees it; deleting a namespace deletes its veths.
"""

from __future__ import annotations

from typing import Sequence

from .endpoints import RankEndpoint
from .namespaces import ip_command, run

BRIDGE = "cgxbr"


def join_through_switch(hosts: Sequence[RankEndpoint], switch_namespace: str) -> None:
    """A bridge in ``switch_namespace`` and one veth from each host into it."""
    ip, sw = ip_command(), switch_namespace
    run([ip, "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
    run([ip, "-n", sw, "link", "set", BRIDGE, "up"])
    for ep in hosts:
        # Created from inside the rank's namespace: the root namespace never sees it.
        run([ip, "-n", ep.namespace, "link", "add", ep.ifname, "type", "veth",
             "peer", "name", ep.peer_ifname, "netns", sw])
        run([ip, "-n", sw, "link", "set", ep.peer_ifname, "master", BRIDGE])
        run([ip, "-n", sw, "link", "set", ep.peer_ifname, "up"])


def join_directly(a: RankEndpoint, b: RankEndpoint) -> None:
    """One veth pair between the namespaces of two hosts."""
    run([ip_command(), "-n", a.namespace, "link", "add", a.ifname, "type", "veth",
         "peer", "name", b.ifname, "netns", b.namespace])


def address_hosts(hosts: Sequence[RankEndpoint], prefixlen: int) -> None:
    """Each host's address on its veth, and its ``lo`` and veth up."""
    ip = ip_command()
    for ep in hosts:
        cidr = f"{ep.address}/{prefixlen}"
        run([ip, "-n", ep.namespace, "addr", "add", cidr, "dev", ep.ifname])
        run([ip, "-n", ep.namespace, "link", "set", "lo", "up"])
        run([ip, "-n", ep.namespace, "link", "set", ep.ifname, "up"])
