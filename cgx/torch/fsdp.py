"""Compressed sharded training: FSDP2 (``fully_shard``) models reduce-scatter their gradients
through cgx's quantized reduce-scatter.

After the model's ``fully_shard`` calls, one call installs cgx's collectives in every FSDP
parameter group (``FSDPModule.set_custom_reduce_scatter``, and with ``params_bits``
``set_custom_all_gather``); FSDP2 keeps doing the sharding, the prefetching and the
optimizer step::

    import cgx.torch as hvd
    from torch.distributed.fsdp import fully_shard

    hvd.init()                                    # launched by cgxrun, torchrun, ...
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hvd.fsdp.compress(model, compression=hvd.Compression.quantize(
        bits=8, error_feedback=True))
    opt = torch.optim.AdamW(model.parameters())   # as with plain FSDP2
    ...
    dcp.save({"model": model_sd, "optim": optim_sd, "cgx": state}, checkpoint_id=path)

What travels (per parameter group, each backward):

==============================================  ===========================================
``compression=``                                the reduce-scatter
==============================================  ===========================================
``Compression.exact``                           FSDP2's own (``torch.distributed``), so the
                                                run is plain FSDP2's, bit for bit
``Compression.quantize(bits, bucket_size, ...)``  cgx's: each rank quantizes the chunks the
                                                others own, one all-to-all, owners sum;
                                                ``error_feedback=True``: residuals of this
                                                rank's input, kept in the returned state
``Compression.none``                            the ``CGX_COMPRESSION_*`` quantization (4 bits);
                                                ``CGX_COMPRESSION``'s deciding exchange
                                                plans replicated gradients, not this
``"auto"`` / ``Compression.auto(...)``          a level per parameter group: auto's knapsack
                                                (fewest bytes with the summed error within
                                                ``alpha`` x the uniform default's) over the
                                                quantization levels and exact, from each
                                                group's measured errors
                                                (:mod:`cgx.policy.levels.groups`)
``+ cross_compression=...``                     hierarchical: ``compression`` among the
                                                ranks of a host, ``cross_compression``
                                                between hosts (SDP4Bit: 8 and 4 bits)
==============================================  ===========================================

Casts (fp16/bf16) are FSDP2's own ``MixedPrecisionPolicy(reduce_dtype=...)``; it combines
with any of the above (bf16 parameters with an fp32 reduce-scatter input, say). Per-layer
rules (``CGX_LAYER_CONFIG``) do not apply: a group's gradients travel as one flat buffer.

Not supported (``ValueError`` from :func:`compress`): HSDP (a 2-D mesh with a replicate
dimension), a mesh over other ranks than cgx's world, ``Compression.planned()``, top-k
and PowerSGD, ``"auto"`` with ``cross_compression`` or ``objective="time"``.

Gradient scaling stays FSDP2's: a compressing :func:`compress` has FSDP2 reduce with a sum
and divide afterwards (``set_force_sum_reduction_for_comms(True)`` on every module), so
``set_gradient_divide_factor`` (1.0 for a sum, as when the loss is normalized by the
global token count) works as without cgx. Turning the sum-only reduction off again makes
the first backward fail (cgx's reduce-scatter averages or sums, it cannot pre-multiply).
"""

from __future__ import annotations

import io
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from cgx import runtime, session
from cgx.policy.levels.groups import GroupLevels
from cgx.collectives import reduce_scatter as rs
from cgx.comm.torch_dist import all_gather_single, reduce_scatter_single
from cgx.collectives.sharded import Levels, ShardState, Topology, all_gather_flat, \
    reduce_scatter_flat
from cgx.compression import Compression
from cgx.config import MAX_BITS, MIN_BITS, CompressionMode, Rounding
from cgx.policy import GradMode
from cgx.policy import resolve as resolve_policy
from cgx.errors import NotInitializedError
from cgx.quant.codec import QuantSpec

STATE_FORMAT = 2  # 1: the groups' states alone
PARAMS_BUCKET_SIZE = 1024  # values per (unit, min) pair of the parameters' all-gather


def compress(model: torch.nn.Module, compression=Compression.none, *, cross_compression=None,
             params_bits: Optional[int] = None) -> "FSDPCompression":
    """Make every FSDP2 parameter group of ``model`` reduce-scatter through cgx.

    Call after ``fully_shard`` (on the layers, then the model) and ``cgx.torch.init()``,
    before the first forward; every rank calls it.

    Args:
        model: a module that ``fully_shard`` was applied to (itself or its submodules).
        compression: how gradients travel (see the module docstring).
        cross_compression: between hosts, on the node layout cgx found at ``init``:
            None (default) for a flat reduce-scatter over all ranks with ``compression``.
        params_bits: quantize the parameters' all-gather (before forward, and before
            backward where FSDP re-gathers) to this many bits, nearest rounding, one
            (unit, min) pair per 1024 values; None (default): FSDP2's exact all-gather.
            The error it adds: :meth:`FSDPCompression.param_gather_error`.

    Returns:
        The :class:`FSDPCompression` holding the residuals and step counters: pass it to
        ``torch.distributed.checkpoint`` (it is ``Stateful``) or save its ``state_dict()``.

    Raises:
        TypeError: no ``fully_shard`` module in ``model``.
        ValueError: an unsupported mesh or compression, ``params_bits`` out of range.
        NotInitializedError: ``cgx.torch.init()`` was not called.
    """
    modules = _fsdp_modules(model)
    if not runtime.is_initialized():
        raise NotInitializedError("call cgx.torch.init() before cgx.torch.fsdp.compress(model)")
    _check_mesh(model)
    auto = _group_levels(compression, cross_compression)
    levels = Levels(None, None, auto.error_feedback) if auto is not None else \
        _levels(compression, cross_compression)
    params_spec = _params_spec(params_bits)
    topology = None
    if cross_compression is not None:
        world = runtime.transport()
        topology = session.run(Topology.of, world, runtime.local_transport(),
                               runtime.cross_transport(), label="fsdp topology")
    state = FSDPCompression(levels, params_spec, topology, _seed(compression), auto)
    for name, module in modules:
        module.set_custom_reduce_scatter(CGXReduceScatter(state, name or "<root>"))
        if levels is not None:  # exact: FSDP2's own collective, bit for bit
            module.set_force_sum_reduction_for_comms(True)  # FSDP2 divides, by its factor
        if params_spec is not None:
            module.set_custom_all_gather(CGXAllGather(state, name or "<root>"))
    return state


class FSDPCompression:
    """What :func:`compress` keeps: each parameter group's :class:`ShardState` on this rank.

    ``Stateful`` for ``torch.distributed.checkpoint`` (each rank's part under its own key,
    as an opaque blob), or ``state_dict()`` / ``load_state_dict()`` per rank with
    ``torch.save``. A run restored from either continues bit for bit.

    Attributes:
        levels: how gradients travel (None: FSDP2's own exact reduce-scatter).
        params_spec: the parameters' all-gather quantization, or None (exact).
        groups: parameter group name (its module's name, ``"<root>"`` for the model) to
            :class:`ShardState`.
    """

    __slots__ = ("levels", "params_spec", "topology", "seed", "groups", "auto")

    def __init__(self, levels: Optional[Levels], params_spec: Optional[QuantSpec],
                 topology: Optional[Topology], seed: int, auto: Optional[GroupLevels] = None):
        self.levels, self.params_spec, self.topology, self.seed = \
            levels, params_spec, topology, seed
        self.groups: dict[str, ShardState] = {}
        self.auto = auto  # compression="auto": each group's level (else levels for all)

    def group(self, name: str) -> ShardState:
        return self.groups.setdefault(name, ShardState())

    def compression_plan(self) -> list[dict]:
        """With ``compression="auto"``: per group, its level, bytes, error and share of the
        error budget (``cgx.policy.levels.format_levels`` prints it): the uniform default until
        the first plan, empty before the second step and in the other modes."""
        return self.auto.rows() if self.auto is not None else []

    def param_gather_error(self) -> float:
        """Relative L2 error the quantized all-gather added to this rank's parameter shards,
        over every all-gather so far (0.0 when it is exact)."""
        err = sum(s.gather_error_sq for s in self.groups.values())
        norm = sum(s.gather_norm_sq for s in self.groups.values())
        return (err / norm) ** 0.5 if norm else 0.0

    def state_dict(self) -> dict:
        """``{"format", "world", "rank<r>": bytes}``: this rank's groups as a snapshot."""
        buf = io.BytesIO()
        torch.save({"groups": {n: _plain(s) for n, s in self.groups.items()},
                    "auto": None if self.auto is None else self.auto.state_dict()}, buf)
        return {"format": STATE_FORMAT, "world": runtime.size(),
                f"rank{runtime.rank()}": buf.getvalue()}

    def load_state_dict(self, state: dict) -> None:
        """Restore this rank's part of a :meth:`state_dict` (saved by the same rank)."""
        if state.get("format") not in (1, STATE_FORMAT):
            raise ValueError(f"not a cgx.torch.fsdp state (format {state.get('format')!r}, "
                             f"expected {STATE_FORMAT})")
        key, world = f"rank{runtime.rank()}", runtime.size()
        if state.get("world") != world or key not in state:
            raise ValueError(f"this state was saved by {state.get('world')} ranks; this job has "
                             f"{world}: residuals are per rank, so resume on as many ranks (or "
                             "leave the cgx state out of the load to start them from zero)")
        saved = torch.load(io.BytesIO(state[key]), weights_only=True)
        if state["format"] == 1:  # the groups alone
            saved = {"groups": saved, "auto": None}
        self.groups = {n: ShardState(**s) for n, s in saved["groups"].items()}
        if self.auto is not None and saved["auto"] is not None:
            self.auto.load_state_dict(saved["auto"])


def _plain(s: ShardState) -> dict:
    """A :class:`ShardState` as plain containers (loads with ``weights_only=True``)."""
    snap = s.copy()
    return {"step": snap.step, "residuals": snap.residuals,
            "gather_error_sq": snap.gather_error_sq, "gather_norm_sq": snap.gather_norm_sq}


class CGXReduceScatter:
    """FSDP2's reduce-scatter of one parameter group, through cgx (the group's state in
    ``owner.groups[name]``). Exact levels hand the call to FSDP2's own collective.

    FSDP2's ``ReduceScatter`` comm interface: ``allocate`` its buffers, ``__call__`` the
    collective (synchronous here: it returns None, which FSDP2 does not wait on)."""

    def __init__(self, owner: FSDPCompression, name: str):
        self.owner, self.name = owner, name

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        levels = self.owner.levels
        if levels is None:
            return reduce_scatter_single(output_tensor, input_tensor, group=group, op=op,
                                              async_op=async_op)
        average = _is_average(op)
        t0 = time.perf_counter()
        sent = _run_ordered(self._reduce_scatter, input_tensor, output_tensor, average,
                            label=f"fsdp reduce_scatter {self.name}")
        rs.record(session.reducer(), input_tensor, sent, t0)
        return None


    def _reduce_scatter(self, x: torch.Tensor, out: torch.Tensor, average: bool) -> int:
        """On the engine thread: this step's level (``"auto"``: the group's, a re-plan
        when due), then cgx's reduce-scatter."""
        owner, transport = self.owner, runtime.transport()
        state, levels = owner.group(self.name), owner.levels
        if owner.auto is not None:
            levels = Levels(owner.auto.spec(self.name, state.step, x, transport), None,
                            levels.error_feedback)
        return reduce_scatter_flat(x, out, transport, levels, state, average=average,
                                   name=self.name, seed=owner.seed,
                                   threads=runtime.config().cpu_threads,
                                   topology=owner.topology)


class CGXAllGather:
    """FSDP2's all-gather of one parameter group's shards, quantized (float dtypes; a
    group of mixed dtypes, gathered as bytes, goes through FSDP2's own). FSDP2's
    ``AllGather`` comm interface, as :class:`CGXReduceScatter`."""

    def __init__(self, owner: FSDPCompression, name: str):
        self.owner, self.name = owner, name

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if not input_tensor.is_floating_point():
            return all_gather_single(output_tensor, input_tensor, group=group,
                                     async_op=async_op)
        _run_ordered(all_gather_flat, input_tensor, output_tensor, runtime.transport(),
                     self.owner.params_spec, self.owner.group(self.name),
                     threads=runtime.config().cpu_threads, label=f"fsdp all_gather {self.name}")
        return None


def _run_ordered(fn, tensor: torch.Tensor, *args, label: str, **kwargs):
    """``fn(tensor, *args, **kwargs)`` on cgx's engine thread. On CUDA, ordered with the
    caller's stream (FSDP2 calls from its reduce-scatter or all-gather stream): the engine
    waits for what that stream queued, and that stream for what the engine queued."""
    if tensor.device.type != "cuda":
        return session.run(fn, tensor, *args, label=label, **kwargs)
    ready = torch.cuda.current_stream(tensor.device).record_event()

    def ordered():
        torch.cuda.current_stream(tensor.device).wait_event(ready)
        out = fn(tensor, *args, **kwargs)
        return out, torch.cuda.current_stream(tensor.device).record_event()

    out, done = session.run(ordered, label=label)
    torch.cuda.current_stream(tensor.device).wait_event(done)
    return out


def _is_average(op) -> bool:
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise ValueError(f"FSDP asked for a reduce-scatter with op {op}; cgx's quantized "
                     "reduce-scatter averages or sums: keep set_force_sum_reduction_for_comms"
                     "(True), which cgx.torch.fsdp.compress() set, so that FSDP applies "
                     "set_gradient_divide_factor after the sum")


def _fsdp_modules(model) -> list:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise TypeError(f"{type(model).__name__} has no fully_shard module: call "
                        "torch.distributed.fsdp.fully_shard on its layers and on the model "
                        "first, then cgx.torch.fsdp.compress(model)")
    return modules


def _check_mesh(model) -> None:
    """The mesh FSDP shards over: one, 1-D, over cgx's world, on its device type."""
    meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()
              if isinstance(p, DTensor)}
    if len(meshes) != 1:
        raise ValueError(f"the model's sharded parameters live on {len(meshes)} device meshes; "
                         "cgx.torch.fsdp needs every fully_shard call on the same 1-D mesh")
    (mesh,) = meshes.values()
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard was given a {mesh.ndim}-D mesh {tuple(mesh.shape)} "
                         f"(dims {mesh.mesh_dim_names}): HSDP (replicate x shard) is not "
                         "supported by cgx.torch.fsdp; shard over a 1-D mesh of all ranks "
                         "(init_device_mesh(device, (world_size,)))")
    group = mesh.get_group(0)
    ranks = dist.get_process_group_ranks(group)
    world, tr = runtime.size(), runtime.transport()
    if ranks != list(range(world)) or dist.get_rank() != runtime.rank():
        raise ValueError(f"the FSDP mesh spans ranks {ranks}, but cgx's world is ranks "
                         f"0..{world - 1} (this is cgx rank {runtime.rank()}, torch.distributed "
                         f"rank {dist.get_rank()}): shard over a mesh of the whole job")
    if mesh.device_type != tr.device.type:
        raise ValueError(f"the FSDP mesh is on {mesh.device_type} but cgx's transport moves "
                         f"{tr.device.type} tensors; initialize cgx for the same device")


def _policy(compression, what: str):
    """One level's ``compression=`` as FSDP reads it: ``Compression.none`` is the
    ``CGX_COMPRESSION_*`` quantization (``CGX_COMPRESSION``'s deciding exchange plans
    replicated gradients, not shards)."""
    cfg = runtime.config().replace(compression=CompressionMode.QUANTIZE)
    policy = resolve_policy(compression, cfg)
    if policy.mode is GradMode.PLANNED:
        raise ValueError(f"{what}={compression!r}: the planned policy is not available for "
                         "FSDP; pass Compression.quantize(bits=...), Compression.exact, or "
                         "compression='auto' (a level per parameter group)")
    return policy


def _fixed_level(compression, what: str):
    """(QuantSpec or None, error feedback) for one level's fixed ``compression=``."""
    policy = _policy(compression, what)
    if policy.mode is GradMode.AUTO:
        raise ValueError(f"{what} takes a fixed level (Compression.quantize(...)); 'auto' is "
                         "for compression= over all ranks, without cross_compression")
    if policy.mode is GradMode.QUANTIZE:
        return policy.quant_spec, policy.error_feedback
    if policy.mode is GradMode.EXACT:
        return None, False
    raise ValueError(f"{what}={type(policy.compressor.inner).__name__} is not supported by "
                     "cgx.torch.fsdp: pass Compression.quantize(...), Compression.none or "
                     "Compression.exact (for a fp16/bf16 reduce-scatter, use FSDP2's "
                     "MixedPrecisionPolicy(reduce_dtype=...))")


def _group_levels(compression, cross_compression) -> Optional[GroupLevels]:
    """``compression="auto"`` (or ``Compression.auto(...)``): each group's level by auto's
    knapsack; None for a fixed compression."""
    if cross_compression is not None:
        _fixed_level(cross_compression, "cross_compression")  # auto there: refused
    policy = _policy(compression, "compression")
    if policy.mode is not GradMode.AUTO:
        return None
    if cross_compression is not None:
        raise ValueError("compression='auto' chooses one level per group over all ranks; "
                         "cross_compression (hierarchical) takes fixed levels: pass "
                         "Compression.quantize(...) for both, or leave cross_compression out")
    return GroupLevels(policy.compressor, policy.base, policy.error_feedback)


def _levels(compression, cross_compression) -> Optional[Levels]:
    inner, ef = _fixed_level(compression, "compression")
    if cross_compression is None:
        return None if inner is None else Levels(inner, None, ef)
    cross, cross_ef = _fixed_level(cross_compression, "cross_compression")
    return Levels(inner, cross, ef or cross_ef)


def _params_spec(params_bits) -> Optional[QuantSpec]:
    if params_bits is None:
        return None
    if isinstance(params_bits, bool) or not isinstance(params_bits, int) \
            or not MIN_BITS <= params_bits <= MAX_BITS:
        raise ValueError(f"params_bits={params_bits!r} is not supported; expected None (exact "
                         f"all-gather) or an int in [{MIN_BITS}, {MAX_BITS}] (8 keeps the "
                         "parameters' error near 0.2% of their range)")
    return QuantSpec(params_bits, PARAMS_BUCKET_SIZE, Rounding.NEAREST)


def _seed(compression) -> int:
    return _policy(compression, "compression").seed
