"""The job's secret: drawn by ``cgxrun``, handed to its ranks, proved with HMAC-SHA256.

``cgxrun`` draws one per job (:func:`draw`) and exports it to the ranks it starts as
``CGX_JOB_SECRET`` (:data:`SECRET_VAR`); a user may set it themselves, the same on every
host, for launches cgxrun cannot reach (``--gloo`` on several hosts). Ranks never send
it: they send :func:`prove`'s HMAC of a fresh challenge, checked with :func:`verify`
(constant time), as Horovod's launcher signs its messages with a per-job key.
:mod:`cgx.launch.gate` runs the exchange. :func:`redact` keeps the value out of
anything printed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Mapping

SECRET_VAR = "CGX_JOB_SECRET"
REDACTED = "<redacted>"
# Every message's first part: a proof made for one purpose (or protocol version)
# never verifies for another.
_DOMAIN = "cgx-job-gate-v1"


def draw() -> str:
    """A fresh secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def prove(secret: str, *parts: object) -> str:
    """HMAC-SHA256 of ``parts`` (joined with a separator no part holds) under ``secret``."""
    text = "\x1f".join([_DOMAIN, *map(str, parts)])
    if text.count("\x1f") != len(parts):
        raise ValueError("a part of a proof holds the separator \\x1f")
    return hmac.new(secret.encode(), text.encode(), hashlib.sha256).hexdigest()


def verify(secret: str, proof: object, *parts: object) -> bool:
    """Whether ``proof`` is :func:`prove` (secret, parts); constant time in the proof."""
    if not isinstance(proof, str) or not proof:
        return False
    return hmac.compare_digest(prove(secret, *parts).encode(), proof.encode())


def redact(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` with the secret's value replaced by ``<redacted>``."""
    return {k: (REDACTED if k == SECRET_VAR and v else v) for k, v in env.items()}
