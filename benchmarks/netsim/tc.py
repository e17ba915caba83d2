"""The ``tc`` commands that shape the links (the parameters: :mod:`benchmarks.netsim.shaping`).

Every veth end that sends toward the wire gets a root tbf qdisc: the host's
own end (its upload) and, behind a switch, the switch's port toward the host
(its download). ``lo`` is never shaped.
"""

from __future__ import annotations

import shutil
from typing import Optional, Sequence

from .endpoints import RankEndpoint
from .namespaces import run
from .shaping import Shaping


def shape_links(shaping: Shaping, hosts: Sequence[RankEndpoint],
                switch_namespace: Optional[str]) -> None:
    """Add ``shaping``'s tbf to every host's veth (and the switch's ports); nothing if unshaped."""
    if shaping.rate is None:
        return
    tc = shutil.which("tc")
    tbf = shaping.tc_args()
    for ep in hosts:
        run([tc, "-n", ep.namespace, "qdisc", "add", "dev", ep.ifname, "root", *tbf])
        if switch_namespace is not None:  # the switch's egress toward the rank: the rank's download
            run([tc, "-n", switch_namespace, "qdisc", "add", "dev", ep.peer_ifname,
                 "root", *tbf])
