"""What ``cgxrun``'s elastic driver tells each rank it starts, by environment.

The driver (:mod:`cgx.launch.elastic`) hosts the membership store and exports these
variables; :func:`ElasticEnv.from_env` reads them back on the rank. Without
``CGX_ELASTIC_STORE`` a rank is not part of an elastic job (None).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

from cgx.errors import ConfigError

STORE_VAR = "CGX_ELASTIC_STORE"  # host:port of the driver's membership store
RUN_ID_VAR = "CGX_ELASTIC_RUN_ID"  # the rendezvous' name (one per job)
MIN_VAR = "CGX_ELASTIC_MIN_NP"  # fewest ranks a world may have
MAX_VAR = "CGX_ELASTIC_MAX_NP"  # most ranks a world may have
RESET_LIMIT_VAR = "CGX_ELASTIC_RESET_LIMIT"  # most resets a rank goes through (unset: no limit)
HOST_VAR = "CGX_ELASTIC_HOST"  # the host this rank was started for (as the driver names it)
TIMEOUT_VAR = "CGX_ELASTIC_TIMEOUT_S"  # how long a rank waits for a world to form
# the ranks the driver started at the job's start (set on those only): their first world
# waits for all of them, as horovodrun's first rendezvous does, not only for --min-np
FIRST_VAR = "CGX_ELASTIC_FIRST_NP"


@dataclasses.dataclass(frozen=True)
class ElasticEnv:
    """An elastic rank's instructions: the store, the bounds of the world, the limits."""

    addr: str
    port: int
    run_id: str
    min_np: int
    max_np: int
    reset_limit: Optional[int] = None
    host: str = "localhost"
    timeout_s: float = 600.0
    first_np: Optional[int] = None  # set for the ranks started with the job

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["ElasticEnv"]:
        env = os.environ if env is None else env
        raw = env.get(STORE_VAR, "").strip()
        if not raw:
            return None
        addr, _, port = raw.rpartition(":")
        if not addr or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"{STORE_VAR}={raw!r} is not HOST:PORT; cgxrun sets it for the "
                              f"ranks of an elastic job (unset it outside one)")
        min_np, max_np = _count(env, MIN_VAR, 1), _count(env, MAX_VAR, None)
        max_np = max_np if max_np is not None else max(min_np, 1 << 16)
        if max_np < min_np:
            raise ConfigError(f"{MAX_VAR}={max_np} is below {MIN_VAR}={min_np}")
        limit = env.get(RESET_LIMIT_VAR, "").strip()
        if limit and not limit.isdigit():
            raise ConfigError(f"{RESET_LIMIT_VAR}={limit!r} is not a whole number")
        timeout = env.get(TIMEOUT_VAR, "").strip() or "600"
        try:
            timeout_s = float(timeout)
        except ValueError:
            raise ConfigError(f"{TIMEOUT_VAR}={timeout!r} is not a number of seconds") from None
        return cls(addr=addr, port=int(port), run_id=env.get(RUN_ID_VAR, "cgx") or "cgx",
                   min_np=min_np, max_np=max_np,
                   reset_limit=int(limit) if limit else None,
                   host=env.get(HOST_VAR, "localhost") or "localhost",
                   timeout_s=timeout_s, first_np=_count(env, FIRST_VAR, None))

    def as_env(self) -> dict[str, str]:
        """The variables that give a rank this (the driver's side of :meth:`from_env`)."""
        env = {STORE_VAR: f"{self.addr}:{self.port}", RUN_ID_VAR: self.run_id,
               MIN_VAR: str(self.min_np), MAX_VAR: str(self.max_np), HOST_VAR: self.host,
               TIMEOUT_VAR: f"{self.timeout_s:g}"}
        if self.reset_limit is not None:
            env[RESET_LIMIT_VAR] = str(self.reset_limit)
        if self.first_np is not None:
            env[FIRST_VAR] = str(self.first_np)
        return env


def _count(env: Mapping[str, str], name: str, default: Optional[int]) -> Optional[int]:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"{name}={raw!r} is not a positive whole number")
    return int(raw)
