"""PowerSGD low-rank compression (Vogels, Karimireddy, Jaggi; NeurIPS 2019).

The algorithm of PyTorch's ``powerSGD_hook``, applied per tensor (not per DDP
bucket), one power iteration per step::

    M   = tensor viewed as (n, m) = (shape[0], numel // shape[0]), plus the residual
    Q   = warm start: last step's Q; first step (or warm_start=False): N(0, 1)
          from a generator seeded by (seed, name, draw), the same on every rank;
          after a change of rank, last step's Q truncated to its leading columns,
          or extended with fresh ones (the warm start survives a re-plan)
    orthogonalize(Q)
    P   = M Q                  (n, r)    allreduce(P, SUM)
    orthogonalize(P)                     columns of P orthonormal
    Q   = M^T P                (m, r)    allreduce(Q, SUM); Q /= W
    out = P Q^T                          = P P^T mean_r(M_r)        (x W for SUM)
    residual = M - out                   local input minus the shared approximation,
                                         as torch's hook does

with ``r = min(rank, n, m)``. Two allreduces of ``n * r`` and ``m * r`` values
replace one of ``n * m``.

Payload: ``(n + m) * r`` values of the compute dtype (float32; float64 for
float64 tensors), 4 (n + m) r bytes for float32. P and Q travel in float32
even for half-precision gradients: they are small, and summing half-precision
P over ranks could overflow.

Uncompressed (a plain ``Compression.none`` allreduce, no residual): tensors
with ``ndim <= 1`` (biases, norms), matrices where
``r * (n + m) * min_compression_rate >= n * m`` (low rank would not pay off;
torch's rule), and every step before ``start_step``.

Orthogonalization is modified Gram-Schmidt at every rank (torch's hook
switches to QR above rank 2; QR's columns differ from Gram-Schmidt's only in
sign, which ``P Q^T`` does not see, and Gram-Schmidt keeps the non-finite
policy below simple). A column whose ``norm + orthogonalization_epsilon`` is 0
is left as zeros instead of becoming NaN.

Non-finite policy: a non-finite value in any rank's M makes P non-finite after
the allreduce (on every rank), which spreads through the orthogonalization and
Q into the whole output: non-finite in, non-finite out, never a finite wrong
value. The residual and the warm-start Q are then kept from before the step
(a device-side ``torch.where``, no host sync), so later steps start clean.

Local :meth:`PowerSGDCompressor.compress` / :meth:`~PowerSGDCompressor.decompress`
run the same math in one process (no allreduce) so the interface is the same
as the other families'; the payload is ``P`` and ``Q`` concatenated.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

from cgx.comm.base import ReduceOp, Transport
from cgx.quant import wire
from cgx.compression.base import (Compressor, Family, STATE_FORMAT, accumulate_dtype,
                                  check_float_tensor, check_name, check_reduce_op, check_state,
                                  stable_tensor_id, state_tensor)
from cgx.compression.casts import NoneCompressor

_Q_STAGE = 0x51  # noise_key stage of the Q draws: keeps them apart from quantization keys


class LowRankContext(NamedTuple):
    """What decompress needs; ``rank == 0`` marks an uncompressed payload."""

    shape: torch.Size
    dtype: torch.dtype
    n: int
    m: int
    rank: int


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed (and sent) in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def initial_q(seed: int, name: Optional[str], draw: int, m: int, rank: int,
              dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The random (m, rank) Q of draw number ``draw`` of tensor ``name`` (not orthogonalized).

    Drawn on CPU from a generator seeded by ``wire.noise_key(seed, draw, tensor id)``,
    so every rank, process and device gets the same values.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(wire.noise_key(seed, draw, stable_tensor_id(name), _Q_STAGE))
    q = torch.randn((m, rank), generator=gen, dtype=torch.float32)
    return q.to(device=device, dtype=dtype)


def _split_like(buf: torch.Tensor, like: list) -> list:
    """Views of ``buf`` shaped like each tensor of ``like``, in order (contiguous copies of
    nothing: ``buf`` is fresh)."""
    out, off = [], 0
    for t in like:
        out.append(buf[off:off + t.numel()].view(t.shape))
        off += t.numel()
    return out


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``matrix`` (k, r), in place.

    Each column is divided by ``norm + epsilon``; where that is 0 (an all-zero
    column, epsilon 0) the column stays zero. A NaN norm divides, so NaN spreads.
    """
    cols = matrix.shape[1]
    for i in range(cols):
        col = matrix[:, i:i + 1]
        denom = torch.linalg.vector_norm(col) + epsilon
        col.div_(torch.where(denom == 0, torch.ones_like(denom), denom))
        if i + 1 < cols:
            rest = matrix[:, i + 1:]
            rest.sub_((col * rest).sum(dim=0, keepdim=True) * col)
    return matrix


def _check_int(value, what: str, lo: int, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo:
        raise ValueError(f"{what}={value!r} is not valid; expected an int >= {lo} ({hint})")
    return int(value)


def _check_real(value, what: str, hint: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what}={value!r} is not valid; expected a finite number >= 0 ({hint})")
    return float(value)


def _check_bool(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


class PowerSGDCompressor(Compressor):
    """Rank-``rank`` PowerSGD with warm start and built-in error feedback.

    Args:
        rank: columns of P and Q; 1-4 is typical (torch's ``matrix_approximation_rank``).
        min_compression_rate: compress a matrix only if ``n * m`` exceeds
            ``r * (n + m)`` times this (torch's default 2); 0 compresses every matrix.
        start_step: plain allreduce for this tensor's first ``start_step`` steps
            (torch's ``start_powerSGD_iter``; early training is sensitive).
        warm_start: reuse last step's Q (better approximation, cheaper).
        error_feedback: keep ``M - P Q^T`` and add it to the next step's M.
        orthogonalization_epsilon: added to each column norm (torch's option).
        seed: seed of the random Q draws, the same on every rank.

    Attributes:
        ranks: per-tensor rank overrides, by name (``cgx.policy.levels`` sets them); a
            change keeps the warm start (Q truncated, or extended with fresh columns).

    Example::

        comp = PowerSGDCompressor(rank=2)
        grad = comp.allreduce(grad, transport, name="fc.weight")
    """

    family = Family.POWERSGD
    summable = False

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, start_step: int = 0,
                 warm_start: bool = True, error_feedback: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0):
        self.rank = _check_int(rank, "rank", 1, "columns of the low-rank factors, e.g. 1, 2 or 4")
        self.min_compression_rate = _check_real(
            min_compression_rate, "min_compression_rate", "e.g. 2: compress only matrices at "
            "least twice as big as their factors")
        self.start_step = _check_int(start_step, "start_step", 0,
                                     "steps of plain allreduce before compressing")
        self.warm_start = _check_bool(warm_start, "warm_start")
        self.error_feedback = _check_bool(error_feedback, "error_feedback")
        self.orthogonalization_epsilon = _check_real(
            orthogonalization_epsilon, "orthogonalization_epsilon", "e.g. 0 or 1e-8")
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) \
                or not 0 <= seed < 2**64:
            raise ValueError(f"seed={seed!r} must be an int in [0, 2**64), the same on every rank")
        self.seed = int(seed)
        # Per-tensor rank overrides by name (cgx.policy.levels sets them; others use `rank`).
        self.ranks: dict = {}
        # Per-tensor state, keyed by name (plain tensors and ints: state_dict() copies them).
        self._q: dict[Optional[str], torch.Tensor] = {}  # last step's Q (m, r), warm start
        self._residuals: dict[Optional[str], torch.Tensor] = {}  # M - P Q^T, shape (n, m)
        self._steps: dict[Optional[str], int] = {}  # calls so far (for start_step)
        self._draws: dict[Optional[str], int] = {}  # random Q draws so far

    # -- sizes -------------------------------------------------------------------

    def effective_rank(self, shape, name=None) -> int:
        """``min(rank, n, m)`` if a tensor of this shape is compressed, else 0 (``rank``:
        the tensor's entry in :attr:`ranks` when it has one)."""
        shape = tuple(shape)
        if len(shape) < 2 or math.prod(shape) == 0:
            return 0
        n = shape[0]
        m = math.prod(shape) // n
        r = min(self.ranks.get(name, self.rank) if name is not None else self.rank, n, m)
        return r if r * (n + m) * self.min_compression_rate < n * m else 0

    def payload_numel(self, shape, name=None) -> int:
        """Values sent for a tensor of this shape: ``(n + m) * r``, or ``numel`` uncompressed."""
        shape = tuple(shape)
        r = self.effective_rank(shape, name)
        if r == 0:
            return math.prod(shape)
        return (shape[0] + math.prod(shape) // shape[0]) * r

    def residual(self, name: Optional[str] = None) -> Optional[torch.Tensor]:
        """The (n, m) residual of ``name``, or None."""
        return self._residuals.get(name)

    def take_residual(self, name: Optional[str]) -> Optional[torch.Tensor]:
        return self._residuals.pop(name, None)

    def per_tensor_tables(self) -> tuple[dict, ...]:
        return (self._residuals, self._q, self._steps, self._draws)

    # -- the math ------------------------------------------------------------------

    def _next_step(self, tensor: torch.Tensor, name: Optional[str], who: str) -> int:
        check_float_tensor(tensor, who)
        check_name(name)
        step = self._steps.get(name, 0)
        self._steps[name] = step + 1
        if step < self.start_step:
            return 0
        return self.effective_rank(tensor.shape, name)

    def _input_matrix(self, tensor: torch.Tensor, name: Optional[str], n: int, m: int):
        M = tensor.reshape(n, m).to(compute_dtype(tensor.dtype), copy=True)
        old = self._residuals.get(name) if self.error_feedback else None
        if old is not None:
            if tuple(old.shape) != (n, m):
                raise ValueError(f"the residual of {name!r} is for a {tuple(old.shape)} matrix "
                                 f"but the tensor is viewed as ({n}, {m}): give every tensor "
                                 "its own name, or reset() it after changing the model")
            M.add_(old.to(M.device))
        return M

    def _start_q(self, name: Optional[str], M: torch.Tensor, r: int) -> torch.Tensor:
        m = M.shape[1]
        q = self._q.get(name) if self.warm_start else None
        if q is not None and q.shape[0] != m:
            raise ValueError(f"the warm-start Q of {name!r} has {q.shape[0]} rows but the tensor "
                             f"has {m} columns: give every tensor its own name, or reset() it")
        if q is None:  # first step, or no warm start
            draw = self._draws.get(name, 0)
            self._draws[name] = draw + 1
            q = initial_q(self.seed, name, draw, m, r, M.dtype, M.device)
        elif q.shape[1] > r:  # the rank went down: keep the leading directions
            q = q[:, :r].to(device=M.device, dtype=M.dtype, copy=True)
        elif q.shape[1] < r:  # the rank went up: keep the warm start, add fresh columns
            draw = self._draws.get(name, 0)
            self._draws[name] = draw + 1
            extra = initial_q(self.seed, name, draw, m, r - q.shape[1], M.dtype, M.device)
            q = torch.cat([q.to(device=M.device, dtype=M.dtype), extra], dim=1)
        else:
            q = q.to(device=M.device, dtype=M.dtype, copy=True)
        return orthogonalize_(q, self.orthogonalization_epsilon)

    def _power_step(self, M: torch.Tensor, name: Optional[str], r: int,
                    transport: Optional[Transport]):
        """One power iteration; returns (P, Q, P Q^T) and updates Q and the residual."""
        return self._finish(M, name, *self._factors(M, name, r, transport))

    def _factors(self, M: torch.Tensor, name: Optional[str], r: int,
                 transport: Optional[Transport]):
        """P (orthogonalized M Q_start) and Q = M^T P, each summed over ranks with a
        transport; returns (P, Q, Q_start)."""
        q_start = self._start_q(name, M, r)
        P = M @ q_start
        if transport is not None:
            transport.allreduce(P, ReduceOp.SUM)  # no /W: P is orthogonalized next
        orthogonalize_(P, self.orthogonalization_epsilon)
        Q = M.T @ P
        if transport is not None:
            transport.allreduce(Q, ReduceOp.SUM)
            Q.div_(transport.size)
        return P, Q, q_start

    def _finish(self, M, name, P, Q, q_start):
        """P Q^T, and the state it leaves: warm-start Q and the residual M - P Q^T."""
        approx = P @ Q.T
        # Device-side guards, no host sync: a non-finite step keeps the previous state.
        self._keep_warm_start(name, Q, q_start)
        if self.error_feedback:
            old = self._residuals.get(name)
            keep = old.to(M.device) if old is not None else torch.zeros_like(M)
            new = M.sub_(approx)  # M is our copy
            self._residuals[name] = torch.where(torch.isfinite(new).all(), new, keep)
        return P, Q, approx

    # -- Compressor interface ------------------------------------------------------

    def compress(self, tensor, name=None):
        """Local PowerSGD (one process): payload = P and Q flattened and concatenated."""
        r = self._next_step(tensor, name, type(self).__name__)
        if r == 0:
            return tensor.clone(), LowRankContext(tensor.shape, tensor.dtype, 0, 0, 0)
        n = tensor.shape[0]
        m = tensor.numel() // n
        P, Q, _ = self._power_step(self._input_matrix(tensor, name, n, m), name, r, None)
        payload = torch.cat([P.reshape(-1), Q.reshape(-1)])
        return payload, LowRankContext(tensor.shape, tensor.dtype, n, m, r)

    def factors(self, tensor, name=None):
        """One local power iteration that advances the warm start but never forms P Q^T
        (an (n, m) product): ``(P, Q)``, or None where the tensor is sent whole. For
        scoring (cgx.policy.levels.stats); without error feedback only."""
        if self.error_feedback:
            raise ValueError("factors() keeps no residual: build the compressor with "
                             "error_feedback=False")
        r = self._next_step(tensor, name, f"{type(self).__name__}.factors")
        if r == 0:
            return None
        n = tensor.shape[0]
        M = tensor.reshape(n, tensor.numel() // n).to(compute_dtype(tensor.dtype))
        P, Q, q_start = self._factors(M, name, r, None)
        self._keep_warm_start(name, Q, q_start)
        return P, Q

    def _keep_warm_start(self, name, Q, q_start) -> None:
        """The next step starts from Q (device-side guard, no host sync: a non-finite Q
        keeps the previous start)."""
        if self.warm_start:
            self._q[name] = torch.where(torch.isfinite(Q).all(), Q, q_start)

    def decompress(self, payload, ctx: LowRankContext):
        if ctx.rank == 0:
            return payload.view(ctx.shape).to(ctx.dtype)
        split = ctx.n * ctx.rank
        P = payload[:split].view(ctx.n, ctx.rank)
        Q = payload[split:].view(ctx.m, ctx.rank)
        return (P @ Q.T).view(ctx.shape).to(ctx.dtype)

    def allreduce(self, tensor, transport, name=None, op=ReduceOp.AVERAGE):
        """PowerSGD reduction: two allreduces (P, then Q) instead of one of the whole tensor."""
        op = check_reduce_op(op, self.family)
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a cgx.comm.base.Transport, got "
                            f"{type(transport).__name__}")
        r = self._next_step(tensor, name, f"{type(self).__name__}.allreduce")
        if r == 0:
            return NoneCompressor().allreduce(tensor, transport, name, op)
        n = tensor.shape[0]
        m = tensor.numel() // n
        _, _, approx = self._power_step(self._input_matrix(tensor, name, n, m), name, r,
                                        transport)
        if op is ReduceOp.SUM:
            approx = approx.mul_(transport.size)
        return approx.view(tensor.shape).to(tensor.dtype)

    def allreduce_many(self, tensors, transport, names, op=ReduceOp.AVERAGE):
        """:meth:`allreduce` of several tensors with three collectives in all: the P
        factors of every compressed tensor in one allreduce, then their Q factors in
        another, and the tensors PowerSGD leaves exact (1-D, small, before
        ``start_step``) in a third (as PyTorch's PowerSGD hook batches a bucket)."""
        if len(tensors) != len(names):
            raise ValueError(f"{len(tensors)} tensors but {len(names)} names")
        op = check_reduce_op(op, self.family)
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a cgx.comm.base.Transport, got "
                            f"{type(transport).__name__}")
        outs: list = [None] * len(tensors)
        plain, low = [], []  # indices; for low: (i, M, r, q_start, P)
        for i, (t, name) in enumerate(zip(tensors, names)):
            r = self._next_step(t, name, f"{type(self).__name__}.allreduce_many")
            if r == 0:
                plain.append(i)
                continue
            n = t.shape[0]
            M = self._input_matrix(t, name, n, t.numel() // n)
            q_start = self._start_q(name, M, r)
            low.append((i, M, q_start, M @ q_start))
        if plain:
            flat = [tensors[i].reshape(-1) for i in plain]
            buf = torch.cat([f.to(accumulate_dtype(f.dtype)) for f in flat])
            transport.allreduce(buf, ReduceOp.SUM)
            if op is ReduceOp.AVERAGE:  # as Compression.none does: times 1/W
                buf = buf * (1.0 / transport.size)
            off = 0
            for i, f in zip(plain, flat):
                outs[i] = buf[off:off + f.numel()].view(tensors[i].shape).to(tensors[i].dtype)
                off += f.numel()
        if low:
            for dtype in sorted({M.dtype for _, M, _, _ in low}, key=str):
                group = [item for item in low if item[1].dtype == dtype]
                Ps = [P for _, _, _, P in group]
                buf = torch.cat([P.reshape(-1) for P in Ps])
                transport.allreduce(buf, ReduceOp.SUM)  # no /W: P is orthogonalized next
                Ps = _split_like(buf, Ps)
                Qs = []
                for (_, M, _, _), P in zip(group, Ps):
                    orthogonalize_(P, self.orthogonalization_epsilon)
                    Qs.append(M.T @ P)
                buf = torch.cat([Q.reshape(-1) for Q in Qs])
                transport.allreduce(buf, ReduceOp.SUM)
                buf.div_(transport.size)
                Qs = _split_like(buf, Qs)
                for (i, M, q_start, _), P, Q in zip(group, Ps, Qs):
                    _, _, approx = self._finish(M, names[i], P, Q, q_start)
                    if op is ReduceOp.SUM:
                        approx = approx.mul_(transport.size)
                    outs[i] = approx.view(tensors[i].shape).to(tensors[i].dtype)
        return outs

    # -- state -------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "kind": self.family.value,
                "q": {n: state_tensor(q) for n, q in self._q.items()},
                "residuals": {n: state_tensor(r) for n, r in self._residuals.items()},
                "steps": dict(self._steps), "draws": dict(self._draws)}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, self.family.value, type(self).__name__)
        self._q = {n: q.detach().clone() for n, q in state["q"].items()}
        self._residuals = {n: r.detach().clone() for n, r in state["residuals"].items()}
        self._steps = {n: int(s) for n, s in state["steps"].items()}
        self._draws = {n: int(d) for n, d in state["draws"].items()}

    def reset(self, *names: Optional[str]) -> None:
        for table in self.per_tensor_tables():
            if not names:
                table.clear()
            for name in names:
                table.pop(name, None)

    config_type = "powersgd"

    def to_config(self) -> dict:
        return {k: getattr(self, k) for k in ("rank", "min_compression_rate", "start_step",
                                              "warm_start", "error_feedback",
                                              "orthogonalization_epsilon", "seed")}

    def __repr__(self) -> str:
        return (f"PowerSGDCompressor(rank={self.rank}, "
                f"min_compression_rate={self.min_compression_rate}, "
                f"start_step={self.start_step}, warm_start={self.warm_start}, "
                f"error_feedback={self.error_feedback}, "
                f"orthogonalization_epsilon={self.orthogonalization_epsilon}, seed={self.seed})")
