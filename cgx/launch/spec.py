"""What a ``cgxrun`` command line asks for: :class:`RunSpec`, its hosts, and usage errors."""

from __future__ import annotations

import dataclasses
from typing import Optional

DEFAULT_MASTER_PORT = 29500
USAGE_EXIT = 2


class UsageError(Exception):
    """A command line cgxrun cannot run; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class ElasticSpec:
    """The elastic part of a cgxrun command line."""

    min_np: int
    max_np: int
    discovery_script: Optional[str] = None
    reset_limit: Optional[int] = None
    cooldown: Optional[tuple[float, float]] = None  # seconds; None: blacklisted for good
    wait_s: float = 600.0  # how long fewer than min_np ranks may wait for slots


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A parsed, validated cgxrun command line."""

    num_proc: int
    command: tuple[str, ...]
    hosts: tuple[Host, ...] = ()  # empty: this machine
    mode: str = "gloo"  # "gloo" (torch.distributed.run) or "mpi" (mpirun)
    fusion_threshold_mb: Optional[float] = None
    timeline_filename: Optional[str] = None
    verbose: bool = False
    start_timeout: Optional[float] = None
    network_interface: Optional[str] = None
    node_rank: Optional[int] = None
    master_port: int = DEFAULT_MASTER_PORT
    mpi_args: tuple[str, ...] = ()
    dry_run: bool = False
    tag_output: bool = True  # prefix each line with its rank ("[1]<stdout>:")
    output_filename: Optional[str] = None  # per-rank logs: DIR/rank.<r>/{stdout,stderr}
    elastic: Optional[ElasticSpec] = None  # --min-np/--max-np/--host-discovery-script

    def assignment(self) -> list[tuple[str, int]]:
        """(host, ranks) per host: ``-H`` slots filled in order up to ``num_proc``."""
        if not self.hosts:
            return [("localhost", self.num_proc)]
        out, left = [], self.num_proc
        for h in self.hosts:
            n = min(h.slots, left)
            if n:
                out.append((h.name, n))
            left -= n
        return out
