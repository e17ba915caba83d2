"""Admission: only the ranks that prove they know the job's secret join its process group.

Rank 0 runs the gate on the rendezvous store, before the process group is built;
the other ranks claim their place in it. Keys, under ``cgx/gate/<scope>/``:

``mode``
    rank 0: ``open`` (no ``CGX_JOB_SECRET``: nothing is checked), or the challenge
    ``C`` (fresh random hex) with ``HMAC(k, "challenge", C)``.
``claims``
    a counter: each claimant takes slot ``s = add(claims, 1)``, so that two
    processes claiming the same rank cannot overwrite each other.
``claim/<s>``
    the claimant: its rank, host, pid and ``HMAC(k, "claim", C, s, rank)`` (no
    proof without a secret).
``verdict/<s>``
    rank 0: admitted or refused, the reason, and ``HMAC(k, "verdict", C, s, rank,
    admitted)``: a claimant trusts only a verdict signed with its own secret.
``closed``
    rank 0, once every rank is admitted: the last slot it answers. A later claim
    is refused (the job is complete).

Rank 0 admits the first valid claim of each rank 1..N-1 and refuses every other,
with one line on its stderr that says what to change; a refused process raises
:class:`AdmissionError`. The admitted ranks build their process group under a
key prefix derived from the secret and the challenge (:func:`gated_store`), so a
process that skipped the gate does not meet them by accident. The gate
authenticates ranks; it does not make the store private: torch's ``TCPStore`` has
no authentication, and any client that reaches its port can list, read and write
every key (docs/security.md).

Nothing here imports torch at module level.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets as _random
import socket
import sys
import time
from typing import Callable, Optional

from cgx.config import Config
from cgx.errors import CGXError
from cgx.launch.secret import SECRET_VAR, prove, verify

_POLL_S = 0.02  # store polling interval while claims and verdicts are awaited
_FIX = (f"set {SECRET_VAR} to the launcher's value on every rank (cgxrun hands it to the "
        f"ranks it starts; with several hosts export the same value on each)")


class AdmissionError(CGXError):
    """This process was not admitted to the job (or rank 0 could not admit every rank)."""


class _Keys:
    def __init__(self, scope: str):
        self.base = f"cgx/gate/{scope}/"
        self.mode, self.claims, self.closed = (self.base + k for k in ("mode", "claims",
                                                                         "closed"))

    def claim(self, slot: int) -> str:
        return f"{self.base}claim/{slot}"

    def verdict(self, slot: int) -> str:
        return f"{self.base}verdict/{slot}"


def gated_store(store, rank: int, world_size: int, cfg: Config, scope: str,
                log: Optional[Callable[[str], None]] = None):
    """The store this rank builds its process group on, once admitted.

    Args:
        store: the job's rendezvous store (a ``torch.distributed.Store``).
        rank, world_size: this rank and the job's size.
        cfg: ``cfg.job_secret`` (``CGX_JOB_SECRET``) and ``cfg.start_timeout_s``.
        scope: the same on every rank of one attempt (init count, torchrun restart).
        log: where rank 0 writes a refusal (default: a line on stderr).

    Returns:
        ``store`` itself when the job has no secret, else a ``PrefixStore`` on it
        whose prefix only holders of the secret can derive.

    Raises:
        AdmissionError: this process was refused (the message says what to change),
            or, on rank 0, not every rank was admitted within ``cfg.start_timeout_s``.
    """
    keys, deadline = _Keys(scope), time.monotonic() + cfg.start_timeout_s
    secret = cfg.job_secret
    if rank == 0:
        challenge = _admit(store, world_size, secret, keys, cfg, deadline, log or _stderr)
    else:
        challenge = _claim(store, rank, secret, keys, cfg, deadline)
    if challenge is None:
        return store
    from torch.distributed import PrefixStore
    return PrefixStore(f"cgx/group/{prove(secret, 'group', challenge)[:32]}", store)


# -- rank 0 --------------------------------------------------------------------------------

def _admit(store, world_size, secret, keys, cfg, deadline, log) -> Optional[str]:
    """Open the gate and answer claims until ranks 1..N-1 are in; the challenge."""
    if secret is None:
        store.set(keys.mode, "open")
        return None
    challenge = _random.token_hex(16)
    store.set(keys.mode, json.dumps({"challenge": challenge,
                                     "mac": prove(secret, "challenge", challenge)}))
    admitted: dict[int, int] = {}  # rank -> slot
    refused: list[str] = []
    waiting: set[int] = set()  # slots taken whose claim is not written yet
    seen = 0  # slots counted so far
    while len(admitted) < world_size - 1:
        count = store.add(keys.claims, 0)
        waiting.update(range(seen + 1, count + 1))
        seen = count
        for slot in sorted(waiting):
            if store.check([keys.claim(slot)]):
                waiting.discard(slot)
                reason, rank = _judge(store.get(keys.claim(slot)), slot, secret, challenge,
                                      world_size, admitted)
                _answer(store, keys, slot, rank, secret, challenge, reason)
                if reason is None:
                    admitted[rank] = slot
                else:
                    refused.append(reason)
                    log(f"cgx: rank 0 refused {reason}; {_FIX}")
        if len(admitted) == world_size - 1:
            break
        if time.monotonic() > deadline:
            missing = sorted(set(range(1, world_size)) - set(admitted))
            raise AdmissionError(
                f"rank 0 admitted ranks {sorted(admitted) or 'none'} of 1..{world_size - 1}, "
                f"but ranks {missing} did not prove they know the job's secret within "
                f"{cfg.start_timeout_s:g} s" + (f" (refused: {'; '.join(refused)})" if refused
                                                 else "") + f"; {_FIX}, or raise "
                f"CGX_START_TIMEOUT_S if they start late")
        time.sleep(_POLL_S)
    final = store.add(keys.claims, 0)
    store.set(keys.closed, str(final))
    for slot in sorted(waiting | set(range(seen + 1, final + 1))):
        # claims that came too late (or were never written): the job is complete
        _answer(store, keys, slot, -1, secret, challenge, "the job already has all its ranks")
    return challenge


def _judge(raw: bytes, slot: int, secret: str, challenge: str, world_size: int,
           admitted: dict) -> tuple[Optional[str], int]:
    """(None, rank) for a claim to admit, else (the refusal, its rank)."""
    try:
        claim = json.loads(raw)
        rank, host, pid = int(claim["rank"]), str(claim["host"]), int(claim["pid"])
        mac = claim.get("mac") or ""
    except (ValueError, KeyError, TypeError):
        return f"a malformed claim in slot {slot} (not cgx's)", -1
    who = f"a process claiming rank {rank} (host {host}, pid {pid})"
    if not 1 <= rank < world_size:
        return f"{who}: the job's ranks are 1..{world_size - 1}", rank
    if not mac:
        return f"{who}: it has no {SECRET_VAR}", rank
    if not verify(secret, mac, "claim", challenge, slot, rank):
        return f"{who}: its {SECRET_VAR} differs from rank 0's", rank
    if rank in admitted:
        return f"{who}: rank {rank} is already admitted", rank
    return None, rank


def _answer(store, keys, slot, rank, secret, challenge, reason: Optional[str]) -> None:
    ok = reason is None
    store.set(keys.verdict(slot), json.dumps({
        "admitted": ok, "reason": reason or "",
        "mac": prove(secret, "verdict", challenge, slot, rank, int(ok))}))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# -- ranks 1..N-1 --------------------------------------------------------------------------

def _claim(store, rank, secret, keys, cfg, deadline) -> Optional[str]:
    """Claim ``rank`` and wait for rank 0's verdict; the challenge (None: open job)."""
    _wait(store, [keys.mode], deadline,
          f"rank 0 did not open the job's admission within {cfg.start_timeout_s:g} s; check "
          f"that rank 0 runs, or raise CGX_START_TIMEOUT_S")
    mode = store.get(keys.mode).decode()
    if mode == "open":
        if secret is not None:
            raise AdmissionError(f"this rank has {SECRET_VAR} set but rank 0 has none, so the "
                                 f"job checks nobody; set the same {SECRET_VAR} on every rank, "
                                 f"or unset it on all")
        return None
    challenge = json.loads(mode)["challenge"]
    slot = store.add(keys.claims, 1)
    mac = prove(secret, "claim", challenge, slot, rank) if secret is not None else ""
    store.set(keys.claim(slot), json.dumps({"rank": rank, "host": socket.gethostname(),
                                            "pid": os.getpid(), "mac": mac}))
    verdict = None
    while verdict is None:
        if store.check([keys.verdict(slot)]):
            verdict = json.loads(store.get(keys.verdict(slot)))
        elif store.check([keys.closed]) and slot > int(store.get(keys.closed)):
            verdict = {"admitted": False, "reason": "the job already has all its ranks"}
        elif time.monotonic() > deadline:
            raise AdmissionError(f"rank 0 did not answer this rank's claim within "
                                 f"{cfg.start_timeout_s:g} s; check that rank 0 runs, or raise "
                                 f"CGX_START_TIMEOUT_S")
        else:
            time.sleep(_POLL_S)
    if not verdict.get("admitted"):
        what = "without" if secret is None else "with this"
        raise AdmissionError(f"rank 0 refused this process as rank {rank} ({what} "
                             f"{SECRET_VAR}): {verdict.get('reason')}; {_FIX}")
    if not verify(secret, verdict.get("mac"), "verdict", challenge, slot, rank, 1):
        raise AdmissionError(f"an admission for rank {rank} was not signed with this rank's "
                             f"{SECRET_VAR}; {_FIX}")
    return challenge


def _wait(store, names, deadline, message) -> None:
    """The store's own wait for ``names``, until ``deadline``; AdmissionError after it."""
    from torch.distributed import DistStoreError
    # at least 1 ms: a zero timeout is c10d's "no timeout" (HashStore then waits forever)
    left = max(0.001, deadline - time.monotonic())
    try:
        store.wait(names, datetime.timedelta(seconds=left))
    except DistStoreError as exc:  # the deadline passed
        raise AdmissionError(message) from exc
