"""Exchange policies: ``compression=`` settings that decide per tensor (``Compression.auto``,
``Compression.planned``) instead of compressing by themselves.

A policy is not a :class:`cgx.compression.base.Compressor`: it has no payload, and only the
gradient exchange of the optimizers, the tape and the DDP hook (``cgx.exchange``) carries it
out. ``cgx.compression.resolve`` turns a ``compression=`` argument into a compressor or a
policy; a single collective takes compressors only.
"""

from __future__ import annotations

from typing import ClassVar, Optional

STATE_FORMAT = 1


def single_call_error(spelling: str) -> str:
    """What to tell a user who passes a policy (as ``spelling``) to one collective."""
    return (f"{spelling} decides per tensor inside the gradient exchange of "
            f"DistributedOptimizer (and the tape, and the DDP hook); a single collective "
            f"takes a fixed compressor, e.g. Compression.quantize(bits=4)")


class Policy:
    """Settings of an exchange that chooses per tensor; subclasses validate their own."""

    name: ClassVar[str] = "policy"  # how users spell it: Compression.<name>(...)
    warmup_steps: int = 0  # exact exchange for the first steps

    def to_config(self) -> dict:
        """The constructor arguments that rebuild these settings, JSON-able."""
        raise NotImplementedError

    @classmethod
    def from_config(cls, config: dict) -> "Policy":
        return cls(**config)

    def single_call_error(self) -> str:
        """What to tell a user who passes this policy to one collective."""
        return single_call_error(f"Compression.{self.name}")

    def state_dict(self) -> dict:
        """Policies keep no per-tensor state of their own (the exchange keeps it)."""
        return {"format": STATE_FORMAT, "kind": self.name}

    def load_state_dict(self, state: dict) -> None:
        # "quantize": what these settings wrote when they were compressors.
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or \
                state.get("kind") not in (self.name, "quantize"):
            raise ValueError(f"expected a Compression.{self.name} state (from state_dict()), "
                             f"got {state!r}")

    def reset(self, *names: Optional[str]) -> None:
        """Nothing to forget: the exchange holds the per-tensor state."""


def is_policy_name(obj) -> bool:
    """``"auto"`` (any case): the string spelling of ``Compression.auto()``."""
    return isinstance(obj, str) and obj.strip().lower() == "auto"
