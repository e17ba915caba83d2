"""Slow-link simulator: ranks in network namespaces joined by tbf-shaped veths.

Example:
    >>> from benchmarks.netsim import SlowNetwork, NetnsUnavailable   # doctest: +SKIP
    >>> with SlowNetwork(n_ranks=2, rate="1gbit") as net:
    ...     res = net.run_function("benchmarks.netsim.probes:allreduce_probe", {"size_mb": 100})

See ``benchmarks/netsim/README.md``; ``python -m benchmarks.netsim --help``
for the ``selftest`` and ``cleanup`` commands.
"""

from .endpoints import RankEndpoint
from .errors import NetnsError, NetnsUnavailable, RankFailedError
from .launch import LaunchResult, RankResult
from .namespaces import NAMESPACE_PREFIX, check_available, cleanup_leftovers, list_namespaces
from .network import SlowNetwork
from .shaping import Shaping, parse_rate, parse_size, parse_time
from .worker import RESULT_ENV, link_tx_bytes, write_result

__all__ = [
    "NAMESPACE_PREFIX",
    "RESULT_ENV",
    "LaunchResult",
    "NetnsError",
    "NetnsUnavailable",
    "RankEndpoint",
    "RankFailedError",
    "RankResult",
    "Shaping",
    "SlowNetwork",
    "check_available",
    "cleanup_leftovers",
    "link_tx_bytes",
    "list_namespaces",
    "parse_rate",
    "parse_size",
    "parse_time",
    "write_result",
]
