"""What a group of ranks did: every rank's exit code and output (:class:`LaunchResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import RankFailedError


@dataclass
class RankResult:
    """What one rank's process did.

    ``returncode`` is negative when the process died from a signal (e.g. -15
    after the harness stopped it). ``killed`` is True when the harness stopped
    it, because another rank failed or the deadline passed.
    """

    rank: int
    returncode: int
    stdout: str
    stderr: str
    killed: bool = False
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass
class LaunchResult:
    """Every rank's :class:`RankResult`, in rank order, and the wall time of the group."""

    ranks: list[RankResult]
    elapsed_s: float
    timed_out: bool = False
    failed_ranks: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    @property
    def returncodes(self) -> list[int]:
        return [r.returncode for r in self.ranks]

    def check(self) -> "LaunchResult":
        """Return self if every rank exited 0; raise :class:`RankFailedError` otherwise."""
        if self.ok:
            return self
        if self.timed_out:
            head = f"ranks timed out after {self.elapsed_s:.1f} s (exit codes {self.returncodes})"
        else:
            head = f"rank(s) {self.failed_ranks} failed (exit codes {self.returncodes})"
        # The first rank that failed on its own usually holds the real error;
        # the others were stopped by the harness.
        culprits = [r for r in self.ranks if r.rank in self.failed_ranks]
        culprit = (culprits or [r for r in self.ranks if not r.ok])[0]
        tail = (culprit.stderr.strip() or culprit.stdout.strip())[-2000:]
        raise RankFailedError(f"{head}; rank {culprit.rank} said:\n{tail}", self)
