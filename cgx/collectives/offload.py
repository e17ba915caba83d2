"""Quantizing CUDA tensors on the host: the C path on pinned copies, beside the GPU's compute.

ByteComp (Wang et al., EuroSys 2023) places each tensor's compression on the GPU or the
CPU: a GPU kernel is fast but takes the GPU from backward's kernels; the host's C
quantizer is slower and costs two trips over PCIe, but leaves the GPU to the compute.
:class:`Placement` names the two; ``cgx.policy.planner.placement`` decides between them, and
``ReduceContext.placements`` (``cgx.collectives.algorithms``) applies the decision per
fused tensor.

:func:`quantize` and :func:`dequantize` take the arguments of ``cgx.quant.codec``'s and
write the same bytes and values (the C path and the Triton kernels are bit-exact with the
reference). For a CUDA tensor they run::

    D2H  the values (or the payload) into pinned memory, on a side stream; wait for it
    C    quantize (or dequantize) on the host, on the calling thread
    H2D  the payload (or the decoded values) back, on the side stream; the caller's
         stream waits for it, so its next kernels see the result

Only the calling thread (the engine's) blocks on the copy; the GPU keeps running
backward's kernels meanwhile. Any other tensor (CPU) goes to the codec unchanged.
"""

from __future__ import annotations

import enum
import functools
from typing import Optional

import torch

from cgx.quant import codec
from cgx.quant.codec import Backend, QuantSpec


class Placement(enum.Enum):
    """Where a CUDA tensor is quantized and dequantized."""

    GPU = "gpu"  # the codec's choice: the Triton kernels on the tensor's device
    CPU_OFFLOAD = "cpu"  # the C path on pinned host copies (this module)


@functools.lru_cache(maxsize=None)
def _side_stream(index: int) -> "torch.cuda.Stream":
    """One copy stream per device, made on first use (never at import)."""
    return torch.cuda.Stream(device=index)


def _host_backend(backend) -> Backend:
    """The backend the host copy runs: the caller's, except Triton (C on the host)."""
    b = Backend(backend) if not isinstance(backend, Backend) else backend
    return Backend.AUTO if b is Backend.TRITON else b


def to_host(x: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of the CUDA tensor ``x``, complete on return.

    The copy waits for the work already queued on the caller's stream (``x`` is its
    output) and runs on the side stream; a sync point for this thread only.
    """
    side = _side_stream(x.device.index)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    return host


def to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy the pinned ``host`` into the CUDA tensor ``dst`` on the side stream; the
    caller's stream waits for the copy (no host sync). The host block stays reserved
    until the copy is done (torch's pinned allocator records the copy's stream)."""
    side = _side_stream(dst.device.index)
    current = torch.cuda.current_stream(dst.device)
    side.wait_stream(current)  # dst's earlier readers and writers are done
    with torch.cuda.stream(side):
        dst.copy_(host, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    current.wait_event(done)
    dst.record_stream(side)


def quantize(x: torch.Tensor, spec: QuantSpec, *, out: Optional[torch.Tensor] = None,
             key: int = 0, index_offset: int = 0, write_back: bool = False,
             backend: Backend | str = Backend.AUTO, threads: int = 1,
             rotation_key: int = 0) -> torch.Tensor:
    """``cgx.quant.codec.quantize``, run on the host for a CUDA ``x``.

    Hidden costs: a D2H of ``x``, an H2D of the payload, and with ``write_back`` an
    H2D of the decoded values; pinned buffers of the same sizes.
    """
    kw = dict(key=key, index_offset=index_offset, write_back=write_back, threads=threads,
              rotation_key=rotation_key)
    if not x.is_cuda:
        return codec.quantize(x, spec, out=out, backend=backend, **kw)
    if not x.is_contiguous():
        raise ValueError("x must be contiguous; call .contiguous() first")
    if out is not None and out.device != x.device:
        raise ValueError(f"out is on {out.device} but x on {x.device}: the payload of an "
                         "offloaded quantization goes back to the tensor's device")
    nbytes = spec.nbytes(x.numel())
    host = to_host(x)
    payload = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    codec.quantize(host, spec, out=payload, backend=_host_backend(backend), **kw)
    if out is None:
        out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    out = out[:nbytes]
    to_device(out, payload)
    if write_back:
        to_device(x, host)
    return out


def dequantize(payload: torch.Tensor, numel: int, spec: QuantSpec, *,
               out: Optional[torch.Tensor] = None, accumulate: bool = False,
               dtype: torch.dtype = torch.float32, backend: Backend | str = Backend.AUTO,
               threads: int = 1, rotation_key: int = 0) -> torch.Tensor:
    """``cgx.quant.codec.dequantize``, run on the host for a CUDA ``payload``.

    Decoded on the host into float32 (or ``out``'s dtype when overwriting), copied
    back, and with ``accumulate`` added on the device: ``dtype(float32(out) + decoded)``,
    as the kernels do. Hidden costs: a D2H of the payload, an H2D of the values.
    """
    kw = dict(threads=threads, rotation_key=rotation_key)
    if not payload.is_cuda:
        return codec.dequantize(payload, numel, spec, out=out, accumulate=accumulate, dtype=dtype,
                                backend=backend, **kw)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an `out` tensor to add into")
        out = torch.empty(numel, dtype=dtype, device=payload.device)
    elif out.device != payload.device or out.numel() != numel:
        raise ValueError(f"out ({out.numel()} values on {out.device}) must hold numel={numel} "
                         f"values on the payload's device ({payload.device})")
    host_payload = to_host(payload[:spec.nbytes(numel)])
    decoded = torch.empty(numel, dtype=torch.float32 if accumulate else out.dtype,
                          pin_memory=True)
    codec.dequantize(host_payload, numel, spec, out=decoded, backend=_host_backend(backend), **kw)
    flat = out.view(-1)
    if not accumulate:
        to_device(flat, decoded)
        return out
    staged = torch.empty(numel, dtype=torch.float32, device=payload.device)
    to_device(staged, decoded)
    flat.add_(staged)  # computed in float32, rounded once to out's dtype
    return out


def placements_of(placements, count: int, chosen) -> Optional[list[Placement]]:
    """The placements of the tensors ``chosen`` (indices) out of ``count`` given, checked:
    None, or one :class:`Placement` (or None: ``GPU``) per tensor."""
    if placements is None:
        return None
    placements = list(placements)
    if len(placements) != count:
        raise ValueError(f"got {len(placements)} placements for {count} tensors; pass one "
                         "cgx Placement (or None) per tensor")
    for i, p in enumerate(placements):
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"placements[{i}] must be a Placement or None, got {p!r}")
    return [placements[i] or Placement.GPU for i in chosen]
