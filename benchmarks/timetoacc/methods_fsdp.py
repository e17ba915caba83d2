"""Sharded training: PyTorch's FSDP2, plain and with cgx's reduce-scatter.

Names:
    fsdp-fp32        FSDP2 (``fully_shard`` on every transformer layer, or every top-level
                     child with parameters, then the model), fp32 reduce-scatter
    fsdp-bf16        the same with ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``: gradients
                     reduce-scattered in bf16 (parameters and compute in fp32)
    cgx-fsdp-8bit    ``cgx.torch.fsdp.compress``: 8-bit reduce-scatter, error feedback
    cgx-fsdp-4bit    4-bit, error feedback
    cgx-fsdp-hier    8-bit among the ranks of a host, 4-bit between hosts (one host: 8-bit)
    cgx-fsdp-4bit-p8 4-bit reduce-scatter and the parameters' all-gather at 8 bits
                     (``params_bits=8``; ZeRO++'s qgZ + qwZ pairing)

Every rank evaluates (a sharded model's forward all-gathers the parameters on all ranks).
Bytes of the training steps: FSDP2's own collectives counted as Gloo's ring sends them
((W - 1) / W of the all-gather's output, of the reduce-scatter's input), cgx's
reduce-scatter and quantized all-gather by ``hvd.stats()`` (every byte handed to cgx's
transport; the all-gathers of evaluation left out).
"""

from __future__ import annotations

from benchmarks.timetoacc.counters import init_cgx

FSDP_METHODS = ("fsdp-fp32", "fsdp-bf16", "cgx-fsdp-8bit", "cgx-fsdp-4bit", "cgx-fsdp-hier",
                "cgx-fsdp-4bit-p8")


def handles(name: str) -> bool:
    """Is ``name`` one of this module's methods?"""
    return name in FSDP_METHODS


class _Counted:
    """FSDP2's own collective (all-gather or reduce-scatter),
    counting what this rank sends in Gloo's ring."""

    def __init__(self, reduce: bool):
        self.reduce, self.sent, self.paused = reduce, 0.0, False

    def allocate(self, size, *, dtype, device):
        import torch
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        from cgx.comm.torch_dist import all_gather_single, reduce_scatter_single
        W = group.size()
        full = input_tensor if self.reduce else output_tensor
        if not self.paused:
            self.sent += (W - 1) / W * full.numel() * full.element_size()
        if self.reduce:
            return reduce_scatter_single(output_tensor, input_tensor, group=group, op=op,
                                         async_op=async_op)
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _units(model):
    """What gets its own ``fully_shard``: transformer layers, else the top-level children."""
    import torch.nn as nn
    layers = [m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)]
    return layers or [m for m in model.children() if any(True for _ in m.parameters())]


def build(name: str, model, make_optimizer, world: int) -> dict:
    """The fields of the method's ``methods.Setup`` (which ``methods.build`` makes: this
    module imports nothing of ``methods``, which imports it)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    if not handles(name):
        raise ValueError(f"not an FSDP method: {name!r}")
    mesh = init_device_mesh(next(model.parameters()).device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if name == "fsdp-bf16" else None
    for unit in _units(model):
        fully_shard(unit, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    fully_shard(model, mesh=mesh, **({"mp_policy": mp} if mp else {}))
    gathers, scatters = _Counted(reduce=False), _Counted(reduce=True)
    start = None
    if name.startswith("cgx"):
        import cgx.torch.fsdp
        hvd = init_cgx(model)
        q = {"cgx-fsdp-8bit": 8, "cgx-fsdp-4bit": 4, "cgx-fsdp-hier": 8,
             "cgx-fsdp-4bit-p8": 4}[name]
        cross = hvd.Compression.quantize(bits=4, error_feedback=True) \
            if name == "cgx-fsdp-hier" else None
        params_bits = 8 if name.endswith("-p8") else None
        state = cgx.torch.fsdp.compress(model, compression=hvd.Compression.quantize(
            bits=q, error_feedback=True), cross_compression=cross, params_bits=params_bits)
        start = hvd.stats().wire_bytes
    for n, m in model.named_modules():
        if isinstance(m, FSDPModule):
            if start is not None and state.params_spec is not None:
                m.set_custom_all_gather(cgx.torch.fsdp.CGXAllGather(state, n or "<root>"))
            else:
                m.set_custom_all_gather(gathers)
            if start is None:
                m.set_custom_reduce_scatter(scatters)

    evaluated = [0]  # cgx's bytes sent by evaluation (its quantized all-gathers)

    def cgx_sent() -> int:
        import cgx.torch as hvd
        return hvd.stats().wire_bytes if start is not None else 0

    def accounted(steps: int) -> float:
        cgx_bytes = cgx_sent() - start - evaluated[0] if start is not None else 0.0
        return gathers.sent + scatters.sent + cgx_bytes

    def evaluate(workload_evaluate):
        gathers.paused = True  # evaluation's all-gathers are not a training step's
        before = cgx_sent()
        try:
            return workload_evaluate(model)
        finally:
            gathers.paused = False
            evaluated[0] += cgx_sent() - before

    return dict(module=model, optimizer=make_optimizer(model.parameters()),
                accounted_bytes=accounted, evaluate=evaluate,
                note="FSDP2" + (", bf16 reduce-scatter" if mp else ""))
