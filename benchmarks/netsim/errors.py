"""Errors of the slow-link harness."""

from __future__ import annotations

class NetnsUnavailable(RuntimeError):
    """This machine cannot build the simulated network (not root, no iproute2, ...).

    ``reason`` says what is missing; tests skip with it, benchmarks print it.
    """

    def __init__(self, reason: str):
        super().__init__(f"cannot simulate a slow network here: {reason}")
        self.reason = reason


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed although the machine supports namespaces."""


class RankFailedError(RuntimeError):
    """A rank exited non-zero, was killed, or timed out.

    ``result`` is the group's :class:`~benchmarks.netsim.results.LaunchResult`:
    every rank's exit code and output.
    """

    def __init__(self, message: str, result):
        super().__init__(message)
        self.result = result
