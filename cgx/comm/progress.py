"""A progress board: each rank publishes how far it got, so a stalled job can name who is missing.

Horovod's coordinator knows which ranks submitted a tensor; cgx has no
coordinator, so each rank's engine posts a small record (collectives submitted,
the last one's name, a heartbeat time) to the key-value store that
torch.distributed's rendezvous already runs (a ``TCPStore`` on rank 0's host),
through a client connection of its own with a short timeout. A rank waiting
on a collective reads the other records and reports the ranks that have not
submitted it yet, or whose heartbeat stopped (a dead process).

Only the engine's watchdog thread talks to the board, about once per second:
it costs nothing on the training path.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Optional

HEARTBEAT_S = 1.0  # how often a rank posts its record
STALE_S = 4.0  # a record older than this: the rank stopped responding


@dataclasses.dataclass
class RankProgress:
    """One rank's record: ``submitted`` collectives, the ``last`` one's name, heartbeat ``time``."""

    rank: int
    submitted: int
    last: str
    time: float

    def age(self, now: Optional[float] = None) -> float:
        return (time.time() if now is None else now) - self.time


class ProgressBoard:
    """Per-rank progress records in a torch.distributed store.

    Args:
        host, port: the store server (rank 0's rendezvous store).
        rank, size: this rank and the world size.
        scope: key prefix, unique per job generation (so restarts do not mix).
        timeout_s: per-operation timeout of this client connection.
    """

    def __init__(self, host: str, port: int, rank: int, size: int, scope: str,
                 timeout_s: float = 5.0):
        import torch.distributed as dist
        self.rank, self.size, self.scope = rank, size, scope
        self._store = dist.TCPStore(host, port, None, False,
                                    timeout=datetime.timedelta(seconds=timeout_s))

    def _key(self, rank: int) -> str:
        return f"cgx/{self.scope}/progress/{rank}"

    def publish(self, submitted: int, last: str) -> None:
        self._store.set(self._key(self.rank), json.dumps(
            {"n": submitted, "last": last, "t": time.time()}))

    def read(self) -> dict[int, Optional[RankProgress]]:
        """Every rank's latest record (None: it has posted none yet)."""
        out: dict[int, Optional[RankProgress]] = {}
        for r in range(self.size):
            key = self._key(r)
            if not self._store.check([key]):
                out[r] = None
                continue
            d = json.loads(self._store.get(key).decode())
            out[r] = RankProgress(r, int(d["n"]), str(d["last"]), float(d["t"]))
        return out


def describe_missing(board: Optional[ProgressBoard], seq: int, label: str) -> str:
    """Which ranks keep collective number ``seq`` (``label``) waiting, as a sentence.

    Args:
        board: the job's board (None: no board on this transport).
        seq: this rank's submission number of the waiting collective (1-based).
    """
    if board is None:
        return ("the other ranks' progress is unknown on this transport; check that every "
                "rank runs and issues the same collectives in the same order")
    try:
        records = board.read()
    except Exception as e:  # noqa: BLE001 - the store host may be the dead rank
        return (f"the progress board on rank 0's host is unreachable ({type(e).__name__}): "
                "rank 0 has probably died")
    now = time.time()
    dead, behind, silent = [], [], []
    for r, rec in records.items():
        if r == board.rank:
            continue
        if rec is None:
            silent.append(f"rank {r} (no progress posted)")
        elif rec.age(now) > STALE_S:
            dead.append(f"rank {r} (no heartbeat for {rec.age(now):.0f} s; last collective "
                        f"submitted: '{rec.last}')")
        elif rec.submitted < seq:
            behind.append(f"rank {r} (has submitted {rec.submitted} collectives, the last "
                          f"'{rec.last}')")
    parts = []
    if dead:
        parts.append("stopped responding (dead?): " + "; ".join(dead))
    if behind:
        parts.append(f"have not submitted '{label}' (collective #{seq}) yet: " + "; ".join(behind))
    if silent:
        parts.append("; ".join(silent))
    if not parts:
        return ("every rank has submitted it; the ranks may have issued different "
                "collectives, or the link is very slow")
    return "missing ranks: " + " | ".join(parts)
