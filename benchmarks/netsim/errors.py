"""Errors of the slow-link harness."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .launch import LaunchResult


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
    """A rank exited non-zero, was killed, or timed out; ``result`` holds every rank's output."""

    def __init__(self, message: str, result: "LaunchResult"):
        super().__init__(message)
        self.result = result
