"""Error feedback: remember what compression dropped and send it later.

One wrapper for every compressor family (quantize, top-k, casts)::

    g'        = g + residual[name]           (in float32 or wider)
    payload   = C(g')                        (the wrapped compressor)
    residual  = g' - D(payload)              what this rank's payload failed to carry

so over any number of steps ``sum(transmitted) + residual == sum(inputs)``
(up to float32 rounding): nothing is lost, only delayed. Biased compressors
(top-k above all) need this to converge like uncompressed SGD.

Costs: one residual per tensor, kept in float32 even for float16/bfloat16
gradients (a half-precision residual would round away the small corrections
it exists to keep), and one local decode per step to compute ``D(payload)``.
The wrapped compressor sees ``g'`` cast back to the gradient's dtype, so the
payload keeps its size; the residual also absorbs that cast's rounding.

PowerSGD keeps its own residual (``error_feedback=True`` there), so wrapping
it is refused.

Non-finite policy: when ``g'`` or the new residual holds an inf or NaN (a
non-finite gradient, or a value the wire type cannot hold), the payload is
non-finite as the wrapped compressor's policy says, and the residual is
*left as it was before the step*: the step is expected to be skipped (loss
scalers skip non-finite steps), and the correction the residual carried is
still owed. A NaN never enters the residual, so one bad step cannot poison
later ones. The check is a device-side ``torch.where`` (no host sync).
Caveat: in a reduction where only some ranks saw the non-finite value, the
other ranks' residuals advance normally; at most one step's residual on those
ranks is lost with the skipped step. Call :meth:`ErrorFeedback.reset` to
drop residuals explicitly (e.g. after changing the model).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from cgx.comm.base import ReduceOp, Transport
from cgx.compression.base import (Compressor, Family, STATE_FORMAT, accumulate_dtype,
                                  as_compressor, check_name, check_state, check_tensor,
                                  state_tensor)


class ErrorFeedbackContext(NamedTuple):
    """The wrapped compressor's ctx plus the caller's dtype."""

    inner: Any
    dtype: torch.dtype


class ErrorFeedback(Compressor):
    """Residual memory around any compressor: ``ErrorFeedback(TopKCompressor(0.01))``.

    Args:
        compressor: the compressor whose error is fed back (an instance, or a
            cgx compressor class such as ``Compression.fp16``).

    Attributes ``kind`` and ``summable`` are the wrapped compressor's, so the
    collectives layer routes the payloads the same way.

    Example::

        comp = ErrorFeedback(QuantizeCompressor(bits=2))
        payload, ctx = comp.compress(grad, name="fc.weight")   # residual updated
    """

    def __init__(self, compressor: Compressor):
        inner = as_compressor(compressor)
        if isinstance(inner, ErrorFeedback):
            raise ValueError("the compressor already has error feedback; wrap it only once")
        if inner.family is Family.POWERSGD:
            raise ValueError("PowerSGD keeps its own residual: use "
                             "Compression.powersgd(error_feedback=True) instead of wrapping it "
                             "in ErrorFeedback")
        self.compressor = inner
        self._residuals: dict[Optional[str], torch.Tensor] = {}

    @property
    def family(self) -> Family:  # type: ignore[override]
        return self.compressor.family

    @property
    def summable(self) -> bool:  # type: ignore[override]
        return self.compressor.summable

    def residual(self, name: Optional[str] = None) -> Optional[torch.Tensor]:
        """The residual of ``name`` (float32 or wider), or None before its first step."""
        return self._residuals.get(name)

    def take_residual(self, name: Optional[str]) -> Optional[torch.Tensor]:
        return self._residuals.pop(name, None)

    def per_tensor_tables(self) -> tuple[dict, ...]:
        return (self._residuals, *self.compressor.per_tensor_tables())

    def _with_feedback(self, tensor: torch.Tensor, name: Optional[str],
                       transport: Optional[Transport]):
        check_tensor(tensor, f"ErrorFeedback({type(self.compressor).__name__})")
        check_name(name)
        if not tensor.is_floating_point():  # nothing is lost on integers: no residual
            payload, ctx = self._encode(tensor, name, transport)
            return payload, ErrorFeedbackContext(ctx, tensor.dtype)
        work = tensor.to(accumulate_dtype(tensor.dtype), copy=True)
        old = self._residuals.get(name)
        if old is not None:
            if old.shape != tensor.shape:
                raise ValueError(f"the residual of {name!r} has shape {tuple(old.shape)} but the "
                                 f"tensor has shape {tuple(tensor.shape)}: give every tensor its "
                                 "own name, or reset() the residual after changing the model")
            work.add_(old.to(device=work.device))
        sent = work if work.dtype == tensor.dtype else work.to(tensor.dtype)
        payload, ctx = self._encode(sent, name, transport)
        # Not in place: the payload may alias `work` (Compression.none).
        new = work - self.compressor.decompress(payload, ctx).to(work.dtype).view(work.shape)
        # Device-side guard, no host sync: a non-finite step leaves the residual unchanged.
        keep = old.to(device=new.device) if old is not None else torch.zeros_like(new)
        self._residuals[name] = torch.where(torch.isfinite(new).all(), new, keep)
        return payload, ErrorFeedbackContext(ctx, tensor.dtype)

    def _encode(self, tensor, name, transport):
        if transport is None:
            return self.compressor.compress(tensor, name)
        return self.compressor.compress_for_reduction(tensor, transport, name)

    def compress(self, tensor, name=None):
        return self._with_feedback(tensor, name, None)

    def compress_for_reduction(self, tensor, transport: Transport, name=None):
        return self._with_feedback(tensor, name, transport)

    def decompress(self, payload, ctx: ErrorFeedbackContext):
        return self.compressor.decompress(payload, ctx.inner).to(ctx.dtype)

    def accumulate(self, payload, ctx: ErrorFeedbackContext, out):
        self.compressor.accumulate(payload, ctx.inner, out)

    def gathers(self) -> bool:
        return self.compressor.gathers()

    def reduce_payload(self, payload, ctx: ErrorFeedbackContext, transport: Transport,
                       like: torch.Tensor, op: ReduceOp = ReduceOp.AVERAGE) -> torch.Tensor:
        return self.compressor.reduce_payload(payload, ctx.inner, transport, like, op)

    def state_dict(self) -> dict:
        return {"format": STATE_FORMAT, "kind": "error_feedback",
                "residuals": {n: state_tensor(r) for n, r in self._residuals.items()},
                "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(state, "error_feedback", type(self).__name__)
        self.compressor.load_state_dict(state["compressor"])
        self._residuals = {n: r.detach().clone() for n, r in state["residuals"].items()}

    def reset(self, *names: Optional[str]) -> None:
        if not names:
            self._residuals.clear()
        for name in names:
            self._residuals.pop(name, None)
        self.compressor.reset(*names)

    config_type = "error_feedback"

    @property
    def inner(self) -> Compressor:
        return self.compressor

    def to_config(self) -> dict:
        return {"compressor": self.compressor}  # described in turn by cgx.compression.configs

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.compressor!r})"
