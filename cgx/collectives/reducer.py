"""Fused, compressed allreduce of lists of tensors: the API the adapters call.

Example::

    reducer = Reducer(transport, config)
    specs = [QuantSpec(4, 1024), None]          # None: this one travels exact
    reducer.allreduce([weight_grad, bias_grad], specs, op=ReduceOp.AVERAGE)
    handle = reducer.allreduce_async(tensors, specs)   # runs on the engine thread
    handle.wait()

Tensors are reduced in place. Compressed tensors are never copied into a
float fusion buffer: only their compressed bytes are fused (see
``layout.py``). Tensors without a spec (small ones, 1-D ones, excluded
layers) are concatenated per dtype into plain buffers of at most
``fusion_buffer_mb`` and reduced exactly by the engine's own allreduce.
Compression applies to ``Sum`` and ``Average``; ``Min``, ``Max`` and
``Product`` always travel exact.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import zlib
from typing import Optional, Sequence

import torch

from cgx.comm.base import ReduceOp, SentBytes, Transport, count_sent, scale_
from cgx.quant.codec import FLOAT_DTYPES, QuantSpec
from cgx.config import Config, Hierarchy, ReductionType
from cgx.collectives import algorithms as alg
from cgx.collectives import offload, pipeline
from cgx.collectives.engine import Engine, Handle
from cgx.collectives.layout import make_plan
from cgx.timeline import Timeline

PIPELINE_DEPTH = 3  # collectives in flight: enough to keep one link busy
PIPELINE_BLOCKS = 8  # aim for this many pipeline blocks per call...
MIN_BLOCK_BYTES = 1 << 20  # ...of at least 1 MB (fp32): each collective has a fixed cost


@dataclasses.dataclass
class ReduceStats:
    """What one call (or, summed, many calls) cost.

    Attributes:
        calls: number of allreduce calls.
        numel: values reduced.
        input_bytes: their size as sent uncompressed (dtype bytes).
        wire_bytes: bytes this rank handed to the transport for sending, counted there
            (``cgx.comm.base.SentBytes`` says what each collective counts): one call's
            collectives in a call's statistics; in the totals (``Reducer.snapshot``,
            ``hvd.stats()``) every collective on the reducer's transports since the
            reducer was made, the per-step status exchange, consistency checks and
            planning included.
        sent: ``wire_bytes`` per collective (``{"allgather": ..., "allreduce": ...}``).
        seconds: time per phase: compress, reduce, decompress, wait (blocked on
            the wire), plain (uncompressed allreduce), total.
        steps: optimizer steps whose exchange finished (totals only).
        exposed_seconds: time the training thread waited for the exchange in
            those steps, i.e. communication not hidden behind backward.
        layer_error: latest relative compression error ``||C(g) - g|| / ||g||``
            per layer, sampled every ``CGX_STATS_EVERY`` steps.
    """

    calls: int = 0
    numel: int = 0
    input_bytes: int = 0
    wire_bytes: int = 0
    sent: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)
    steps: int = 0
    exposed_seconds: float = 0.0
    layer_error: dict = dataclasses.field(default_factory=dict)

    def add(self, other: "ReduceStats") -> None:
        self.calls += other.calls
        self.numel += other.numel
        self.input_bytes += other.input_bytes
        self.wire_bytes += other.wire_bytes
        for k, v in other.sent.items():
            self.sent[k] = self.sent.get(k, 0) + v
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.steps += other.steps
        self.exposed_seconds += other.exposed_seconds
        self.layer_error.update(other.layer_error)

    def copy(self) -> "ReduceStats":
        return dataclasses.replace(self, sent=dict(self.sent), seconds=dict(self.seconds),
                                   layer_error=dict(self.layer_error))

    @property
    def ratio(self) -> float:
        """The reduced values' bytes in an fp32 ring allreduce over the bytes sent."""
        return self.seconds.get("_fp32_wire", 0.0) / self.wire_bytes if self.wire_bytes else 1.0


def _sanitize_residuals(residuals) -> None:
    """After a step with inf/NaN gradients (routine while AMP's loss scale calibrates), drop the
    non-finite parts of the error-feedback residuals, so that one overflow does not poison
    every later step. The step's result itself stays non-finite on every rank, so that
    ``GradScaler`` skips it everywhere.

    Cost: one sum per residual (a fast vectorized pass); the cleaning pass runs only
    after an overflow.
    """
    for e in residuals:
        if e is not None and e.numel() and not torch.isfinite(e.sum()):
            torch.nan_to_num_(e, nan=0.0, posinf=0.0, neginf=0.0)


def _plain_wire_bytes(nbytes: int, world: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes``."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def _validate(transport, tensors, specs, op):
    """``(tensors, specs)`` as lists, checked: types, one spec per tensor, the op, the
    device, contiguity and quantizable dtypes."""
    if isinstance(tensors, torch.Tensor) or not all(isinstance(t, torch.Tensor)
                                                    for t in tensors):
        raise TypeError("tensors must be a list of torch.Tensor (wrap a single tensor in "
                        "a list)")
    tensors = list(tensors)
    if specs is None:
        specs = [None] * len(tensors)
    specs = list(specs)
    if len(specs) != len(tensors):
        raise ValueError(f"got {len(specs)} specs for {len(tensors)} tensors; pass one "
                         "QuantSpec or None per tensor")
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a cgx ReduceOp, got {op!r}")
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        for i, t in enumerate(tensors):
            if t.is_complex():
                raise ValueError(f"tensor {i} is complex ({t.dtype}); complex tensors reduce "
                                 f"with op Sum or Average only, not {op.name.title()}")
    dev = transport.device
    for i, (t, s) in enumerate(zip(tensors, specs)):
        if t.device != dev:
            raise ValueError(f"tensor {i} is on {t.device} but this transport "
                             f"({transport.name}) reduces tensors on {dev}")
        if not t.is_contiguous():
            raise ValueError(f"tensor {i} is not contiguous; call .contiguous() first")
        if s is not None:
            if not isinstance(s, QuantSpec):
                raise TypeError(f"specs[{i}] must be a QuantSpec or None, got {s!r}")
            if t.dtype not in FLOAT_DTYPES:
                raise TypeError(f"tensor {i} has dtype {t.dtype}; only float32/float16/"
                                "bfloat16 tensors can be quantized (use spec None)")
    return tensors, specs


class Reducer:
    """Reduces tensor lists over a transport, compressed where a spec says so.

    Args:
        transport: the group (``cgx.runtime.transport()`` by default in adapters).
        config: fusion size, algorithms, pipeline block, seed (default: from env).
        local, cross: sub-transports for hierarchical reduction (ranks of this
            node; ranks with this local rank on other nodes).
        timeline: optional Chrome-trace timeline.
        board: this job's :class:`~cgx.comm.progress.ProgressBoard` (names
            missing ranks when a collective stalls), or None.
    """

    def __init__(self, transport: Transport, config: Optional[Config] = None, *,
                 local: Optional[Transport] = None, cross: Optional[Transport] = None,
                 timeline: Optional[Timeline] = None, board=None, world_gone=None):
        self.transport = transport
        self.config = config or Config.from_env()
        self.local, self.cross = local, cross
        if (local is None) != (cross is None):
            raise ValueError("pass both `local` and `cross` transports for hierarchical "
                             "reduction, or neither")
        if local is not None and local.size * cross.size != transport.size:
            raise ValueError(f"local size {local.size} x cross size {cross.size} != world size "
                             f"{transport.size}: hierarchical reduction needs the same number "
                             "of ranks on every node")
        self.timeline = timeline or Timeline(None)
        self.calls = 0  # part of the state: feeds the stochastic-rounding key
        self.totals = ReduceStats()  # its bytes sent are the transports' counts (snapshot)
        self._totals_lock = threading.Lock()  # the engine adds, the training thread reads
        self._sent_before = self._sent()  # what the transports had sent before this reducer
        self.board = board
        self.world_gone = world_gone  # (an elastic world's probe, cgx.launch.membership)
        self._engine: Optional[Engine] = None

    @property
    def started_engine(self) -> Optional[Engine]:
        """The engine thread if :meth:`engine` has started it, else None (starts nothing)."""
        return self._engine

    def engine(self) -> Engine:
        """The engine thread that runs this reducer's asynchronous work (created on first use)."""
        if self._engine is None:
            cfg = self.config
            self._engine = Engine(self.transport.device, board=self.board,
                                  stall_warning_s=cfg.stall_warning_s, timeout_s=cfg.timeout_s,
                                  rank=self.transport.rank, timeline=self.timeline,
                                  world_gone=self.world_gone)
        return self._engine

    # -- state ------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.calls = int(state["calls"])

    # -- public API -------------------------------------------------------------

    @property
    def hierarchical(self) -> bool:
        h = self.config.hierarchical
        if self.local is None or h is Hierarchy.OFF:
            return False
        return h is Hierarchy.ON or (self.local.size > 1 and self.cross.size > 1)

    def allreduce(self, tensors: Sequence[torch.Tensor],
                  specs: Optional[Sequence[Optional[QuantSpec]]] = None, *,
                  op: ReduceOp = ReduceOp.AVERAGE, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, algorithm: Optional[ReductionType] = None,
                  name: Optional[str] = None,
                  residuals: Optional[Sequence[Optional[torch.Tensor]]] = None,
                  step: Optional[int] = None,
                  placements: Optional[Sequence[Optional[offload.Placement]]] = None
                  ) -> ReduceStats:
        """Reduce ``tensors`` in place over the group; returns this call's stats.

        Args:
            tensors: contiguous tensors on ``transport.device``; compressed ones
                must be float32/float16/bfloat16.
            specs: one QuantSpec (compress) or None (exact) per tensor; None
                for the whole argument means all exact.
            op: Sum or Average compress; Min/Max/Product travel exact.
            prescale_factor, postscale_factor: multiply before / after the reduction.
            algorithm: SRA, RING or ALLGATHER (default: ``config.inner_reduction``).
            name: label for the timeline and the stochastic-rounding key.
            residuals: error feedback: one float32 tensor (same numel) per
                compressed tensor that keeps one, None for the others; kept by the caller
                across steps, with the same tensors in the same order (SRA and
                ALLGATHER only; see ``algorithms.ReduceContext``).
            step: step number for the stochastic-rounding key (default: this
                reducer's call counter); callers that checkpoint pass their own.
            placements: where each compressed CUDA tensor is (de)quantized
                (``cgx.collectives.offload.Placement``; None: on the GPU); the same
                bytes and values either way; CPU tensors ignore it.
        """
        tensors, specs = _validate(self.transport, tensors, specs, op)
        t_start = time.perf_counter()
        algorithm = _check_algorithm(algorithm or self.config.inner_reduction)
        world = self.transport.size
        scale = postscale_factor / world if op is ReduceOp.AVERAGE else postscale_factor
        if prescale_factor != 1.0:
            for t in tensors:
                scale_(t, prescale_factor)
        stats = ReduceStats(calls=1)
        timer = pipeline.PhaseTimer(self.timeline, row=name or "allreduce")
        comp = [i for i, s in enumerate(specs) if s is not None] if op in (
            ReduceOp.SUM, ReduceOp.AVERAGE) else []
        plain = sorted(set(range(len(tensors))) - set(comp))
        buffer_id = zlib.crc32(name.encode()) if name else 0
        fp32_wire = 0
        with count_sent() as sent:
            if comp and world > 1:
                fp32_wire += self._compressed_call(
                    tensors, specs, comp, algorithm, scale, buffer_id, timer, residuals,
                    self.calls if step is None else step, placements)
            elif comp and scale != 1.0:
                for i in comp:
                    scale_(tensors[i], scale)
            if plain:
                with timer.time("plain"):
                    self._plain([tensors[i] for i in plain], op, scale)
                fp32_wire += _plain_wire_bytes(sum(tensors[i].numel() * 4 for i in plain), world)
        self.calls += 1
        return self._record(stats, sent, tensors, timer, t_start, fp32_wire, name,
                            len(comp), len(plain))

    def _record(self, stats: ReduceStats, sent, tensors, timer, t_start: float,
                fp32_wire: int, name: Optional[str], compressed: int, plain: int) -> ReduceStats:
        """Fill in one call's statistics, mark it on the timeline, add it to the totals."""
        stats.wire_bytes, stats.sent = sent.total, dict(sent.by_collective)
        stats.numel = sum(t.numel() for t in tensors)
        stats.input_bytes = sum(t.numel() * t.element_size() for t in tensors)
        stats.seconds = dict(timer.seconds)
        stats.seconds["total"] = time.perf_counter() - t_start
        stats.seconds["_fp32_wire"] = float(fp32_wire)
        if self.timeline.enabled:
            self.timeline.add("done", t_start, stats.seconds["total"], row=name or "allreduce",
                              args={"numel": stats.numel, "input_bytes": stats.input_bytes,
                                    "wire_bytes": stats.wire_bytes,
                                    "compressed_tensors": compressed, "exact_tensors": plain})
        self.add_stats(stats)
        return stats

    # -- statistics (thread-safe) ----------------------------------------------------

    def add_stats(self, stats: ReduceStats) -> None:
        """Add to the totals (any thread); bytes sent are not taken from ``stats``, the
        totals' come from the transports (see :meth:`snapshot`)."""
        with self._totals_lock:
            self.totals.add(dataclasses.replace(stats, wire_bytes=0, sent={}))

    def snapshot(self) -> ReduceStats:
        """A consistent copy of the totals (any thread). Bytes sent: what this rank handed
        to the reducer's transports since the reducer was made, counted by the transports
        (every collective on them, by whichever code issued it)."""
        with self._totals_lock:
            out = self.totals.copy()
        sent = self._sent() - self._sent_before
        out.wire_bytes, out.sent = sent.total, dict(sent.by_collective)
        return out

    def _sent(self) -> SentBytes:
        out = SentBytes()
        for t in {id(t): t for t in (self.transport, self.local, self.cross)
                  if t is not None}.values():
            out = out + t.sent_bytes()
        return out

    def allreduce_async(self, tensors: Sequence[torch.Tensor],
                        specs: Optional[Sequence[Optional[QuantSpec]]] = None,
                        **kwargs) -> Handle:
        """Like :meth:`allreduce`, run on the engine thread; ``handle.wait()`` returns the stats.

        Submissions run in order; submit in the same order on every rank.
        """
        # Validate here so that a user error raises in the caller, not in the engine.
        tensors, specs = _validate(self.transport, tensors, specs,
                                   kwargs.get("op", ReduceOp.AVERAGE))
        return self.engine().submit(self.allreduce, (tensors, specs), kwargs,
                                   label=kwargs.get("name") or "allreduce")

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # -- internals ----------------------------------------------------------------

    def _compressed_call(self, tensors, specs, comp, algorithm, scale, buffer_id, timer,
                         residuals, step, placements) -> int:
        """The compressed tensors ``comp`` of a call, reduced; their float32 ring bytes."""
        views = [tensors[i].view(-1) for i in comp]
        segs = tuple((v.numel(), specs[i]) for v, i in zip(views, comp))
        # Error feedback keeps what one quantization dropped, which a two-level reduction
        # (several quantizations) cannot hand back: unless asked for (CGX_HIERARCHICAL=on),
        # a call with residuals reduces flat.
        if residuals is not None and all(r is None for r in residuals):
            residuals = None  # no tensor keeps one (each one's compensation is none)
        hierarchical = self.hierarchical and (residuals is None or
                                              self.config.hierarchical is Hierarchy.ON)
        res = _check_residuals(residuals, tensors, comp, algorithm, hierarchical)
        self._compressed(views, segs, algorithm, scale, buffer_id, timer, res, step,
                         offload.placements_of(placements, len(tensors), comp), hierarchical)
        if res is not None:
            _sanitize_residuals(res)
        return _plain_wire_bytes(sum(v.numel() * 4 for v in views), self.transport.size)

    def _block_numel(self, segs) -> int:
        """Values per pipeline block: ~PIPELINE_BLOCKS blocks, within [1 MB, CGX_PIPELINE_CHUNK_MB].

        Measured on 2 ranks at 1 Gbit/s (100 MB): 2 MB blocks 4.5x faster than Gloo
        fp32, 4 MB 5.8x, 8-16 MB 6.9x: per-collective overhead dominates small
        blocks, while too few blocks leave compression unoverlapped.
        """
        total = sum(n for n, _ in segs)
        largest = max(8, int(self.config.pipeline_chunk_mb * (1 << 20)) // 4)
        smallest = min(largest, MIN_BLOCK_BYTES // 4)
        return max(smallest, min(largest, -(-total // PIPELINE_BLOCKS)))

    def _run(self, algorithm, ctx, segs, world) -> None:
        plan = make_plan(segs, alg.chunks_per_block(algorithm, world), self._block_numel(segs))
        pipeline.run(alg.programs(algorithm, ctx, plan), PIPELINE_DEPTH, ctx.timer)

    def _ctx(self, views, transport, scale, buffer_id, timer, step) -> alg.ReduceContext:
        return alg.ReduceContext(views, transport, scale=scale, seed=self.config.seed,
                                 step=step, buffer_id=buffer_id, timer=timer,
                                 threads=self.config.cpu_threads)

    def _compressed(self, views, segs, algorithm, scale, buffer_id, timer, residuals,
                    step, placements, hierarchical: bool) -> None:
        if not hierarchical:
            ctx = self._ctx(views, self.transport, scale, buffer_id, timer, step)
            ctx.residuals, ctx.placements = residuals, placements
            self._run(algorithm, ctx, segs, self.transport.size)
            return
        # Hierarchical: reduce-scatter inside the node, reduce this rank's slice
        # across nodes, allgather inside the node. Keys differ per phase.
        local, cross = self.local, self.cross
        plan = make_plan(segs, local.size, self._block_numel(segs))
        lctx = self._ctx(views, local, 1.0, buffer_id * 3, timer, step)
        lctx.placements = placements
        pipeline.run((alg.sra_scatter(lctx, b) for b in plan.blocks), PIPELINE_DEPTH, timer)
        pieces = [p for b in plan.blocks for p in b.chunks[local.rank]]
        cviews = [lctx.values(p) for p in pieces]
        cctx = self._ctx(cviews, cross, scale, buffer_id * 3 + 1, timer, step)
        cctx.placements = placements and [placements[p.segment] for p in pieces]
        self._run(self.config.cross_reduction, cctx, tuple((p.numel, p.spec) for p in pieces),
                  cross.size)
        gctx = self._ctx(views, local, 1.0, buffer_id * 3 + 2, timer, step)
        gctx.placements = placements
        pipeline.run((alg.sra_gather(gctx, b, local.rank) for b in plan.blocks),
                     PIPELINE_DEPTH, timer)

    def _plain(self, tensors, op, scale) -> None:
        """Exact reduction, fused per dtype into buffers of at most the fusion size."""
        limit = self.config.fusion_buffer_bytes
        engine_op = ReduceOp.SUM if op is ReduceOp.AVERAGE else op
        groups: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        filled: dict[torch.dtype, int] = {}  # bytes in each dtype's last bin
        for t in tensors:  # first-appearance order: identical on every rank
            bins = groups.setdefault(t.dtype, [[]])
            nbytes = t.numel() * t.element_size()
            if bins[-1] and filled[t.dtype] + nbytes > limit:
                bins.append([])
                filled[t.dtype] = 0
            bins[-1].append(t)
            filled[t.dtype] = filled.get(t.dtype, 0) + nbytes
        for bins in groups.values():
            for group in bins:
                if len(group) == 1:
                    buf = group[0].view(-1)
                else:
                    buf = torch.cat([t.view(-1) for t in group])
                # What travels: complex as pairs of reals; bool as int32 (so that Sum
                # counts instead of saturating, and Average follows the integer rule).
                wire = torch.view_as_real(buf) if buf.is_complex() else (
                    buf.to(torch.int32) if buf.dtype == torch.bool else buf)
                if self.transport.size > 1:
                    self.transport.allreduce(wire, engine_op)
                scale_(wire, scale)
                if wire is not buf and wire.data_ptr() != buf.data_ptr():
                    buf.copy_(wire != 0 if buf.dtype == torch.bool else wire)
                if len(group) > 1:
                    for t, part in zip(group, buf.split([t.numel() for t in group])):
                        t.view(-1).copy_(part)


def _check_residuals(residuals, tensors, comp, algorithm, hierarchical: bool):
    """The residuals of the compressed tensors ``comp`` (flat views), checked."""
    if residuals is None:
        return None
    residuals = list(residuals)
    if len(residuals) != len(tensors):
        raise ValueError(f"got {len(residuals)} residuals for {len(tensors)} tensors; pass "
                         "one float32 tensor (or None: no residual) per tensor")
    if algorithm is ReductionType.RING or hierarchical:
        raise ValueError("error feedback inside the collective works with the SRA and "
                         "ALLGATHER algorithms, not with RING or hierarchical reduction: set "
                         "CGX_INNER_REDUCTION_TYPE=sra and CGX_HIERARCHICAL=auto (a call with "
                         "residuals then reduces flat), or turn error feedback off")
    out = []
    for i in comp:
        e = residuals[i]
        if e is None:  # this tensor keeps no residual (its compensation is none)
            out.append(None)
            continue
        if not isinstance(e, torch.Tensor) or e.dtype != torch.float32 or \
                e.numel() != tensors[i].numel() or not e.is_contiguous() or \
                e.device != tensors[i].device:
            raise ValueError(f"residual {i} must be a contiguous float32 tensor of "
                             f"{tensors[i].numel()} values on {tensors[i].device}")
        out.append(e.view(-1))
    return out


def _check_algorithm(algorithm) -> ReductionType:
    if not isinstance(algorithm, ReductionType):
        raise TypeError(f"algorithm must be a cgx.ReductionType, got {algorithm!r}")
    return algorithm
