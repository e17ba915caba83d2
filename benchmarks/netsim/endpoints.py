"""Who lives where on the simulated network: the hosts, their ranks and addresses.

Nothing here creates anything: :func:`check_arguments` validates a
:class:`~benchmarks.netsim.network.SlowNetwork`'s sizes before anything exists,
and :func:`host_endpoints` names each host's namespace, veth and address.
"""

from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RankEndpoint:
    """Where one rank lives on the simulated network."""

    rank: int
    namespace: str  # run the rank with `ip netns exec <namespace> ...`
    address: str  # its IPv4 address, valid inside the namespaces only
    ifname: str  # its veth (what GLOO_SOCKET_IFNAME names)
    peer_namespace: str  # the other end: rank 1's namespace, or the switch
    peer_ifname: str


def count_hosts(n_ranks: int, ranks_per_host: int) -> int:
    """The number of simulated hosts; ValueError/TypeError when there would be fewer than 2."""
    if isinstance(n_ranks, bool) or not isinstance(n_ranks, int):
        raise TypeError(f"n_ranks must be an int, got {type(n_ranks).__name__}")
    if n_ranks < 2:
        raise ValueError(f"n_ranks must be >= 2 (a link needs two ends), got {n_ranks}")
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) \
            or ranks_per_host < 1 or n_ranks % ranks_per_host:
        raise ValueError(f"ranks_per_host must be a divisor of n_ranks={n_ranks}, "
                         f"got {ranks_per_host!r}")
    n_hosts = n_ranks // ranks_per_host
    if n_hosts < 2:
        raise ValueError(f"{n_ranks} ranks at {ranks_per_host} per host make one host; "
                         "a link needs two (lower ranks_per_host)")
    return n_hosts


def private_subnet(subnet: str, n_hosts: int) -> ipaddress.IPv4Network:
    """``subnet`` as a private IPv4 network with room for ``n_hosts`` addresses (else ValueError)."""
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as err:
        raise ValueError(
            f"subnet {subnet!r} is not an IP network such as '10.213.0.0/24': {err}") from None
    if network.version != 4 or not network.is_private:
        raise ValueError(f"subnet {subnet!r} must be a private IPv4 range (e.g. '10.213.0.0/24')")
    if network.num_addresses - 2 < n_hosts:
        raise ValueError(
            f"subnet {subnet!r} has room for {network.num_addresses - 2} hosts, {n_hosts} asked")
    return network


def check_launch_settings(master_port: int, threads_per_rank: int) -> None:
    """ValueError for a MASTER_PORT outside 1..65000 or fewer than one thread per rank."""
    if not (1 <= master_port <= 65000):
        raise ValueError(f"master_port must be in 1..65000, got {master_port}")
    if threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be >= 1, got {threads_per_rank}")


def host_endpoints(prefix: str, network: ipaddress.IPv4Network, n_hosts: int,
                   ranks_per_host: int, switch_namespace: Optional[str]) -> list[RankEndpoint]:
    """One endpoint per host (its first rank's number in ``.rank``), addressed in order.

    With one rank per host the namespaces keep their per-rank names
    (``<prefix>r<h>``, else ``<prefix>h<h>``); with a switch every host's
    peer is its port ``sw<h>`` in ``switch_namespace``, else the other host.
    """
    tag = "r" if ranks_per_host == 1 else "h"
    addrs = itertools.islice(network.hosts(), n_hosts)
    switch = switch_namespace is not None
    return [
        RankEndpoint(
            rank=h * ranks_per_host,
            namespace=f"{prefix}{tag}{h}",
            address=str(addr),
            ifname=f"cgx{h}",
            peer_namespace=switch_namespace if switch else f"{prefix}{tag}{1 - h}",
            peer_ifname=f"sw{h}" if switch else f"cgx{1 - h}",
        )
        for h, addr in enumerate(addrs)
    ]
