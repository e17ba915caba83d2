"""Gradient compressors behind one interface, and Horovod's ``Compression`` namespace.

Families (see ``docs/compression.md`` for payload sizes, options and the
non-finite policy):

* casts: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``
* quantization: ``Compression.quantize(bits=4, bucket_size=1024)``
* sparsification: ``Compression.topk(density=0.01)``
* low rank: ``Compression.powersgd(rank=1)``
* error feedback for any of the first three: ``ErrorFeedback(compressor)``

Example::

    from cgx.compression import Compression
    payload, ctx = Compression.fp16.compress(grad)      # exactly as with Horovod
    comp = Compression.topk(density=0.01)               # stateful, error feedback on
    grad = comp.allreduce(grad, transport, name="fc.weight")

Only torch is imported here (no TensorFlow, no Triton).
"""

from __future__ import annotations

from typing import Optional

from cgx.compression.base import (Compressor, Family, HorovodCompressor, as_compressor,
                                  stable_tensor_id, user_compressor)
from cgx.compression.auto_policy import AutoCompression, default_policy
from cgx.compression.planned_policy import PlannedCompression
from cgx.compression.policy import Policy, is_policy_name
from cgx.compression.casts import (BF16Compressor, ExactCompressor, FP16Compressor,
                                  NoneCompressor)
from cgx.compression.error_feedback import ErrorFeedback
from cgx.compression.powersgd import PowerSGDCompressor
from cgx.compression.quantize import QuantizeCompressor
from cgx.compression.topk import TopKCompressor
from cgx.config import CompressionMode, Rounding


def _with_warmup(comp: Compressor, warmup_steps: int) -> Compressor:
    """Mark ``comp`` to travel exact for the first ``warmup_steps`` optimizer steps."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} must be an int >= 0")
    comp.warmup_steps = warmup_steps
    return comp


def _check_flag(value, what: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, got {value!r}")
    return value


class Compression:
    """Compression algorithms for ``allreduce`` and ``DistributedOptimizer``.

    ``none``, ``fp16`` and ``bf16`` are compressor classes used as Horovod's
    are: ``Compression.fp16.compress(tensor)`` works on the class, and
    ``Compression.fp16(predivide=8)`` makes a configured instance. The other
    entries are factories returning a fresh stateful compressor: use one
    instance per model (its state is per tensor name).
    """

    none = NoneCompressor
    exact = ExactCompressor  # uncompressed even when CGX_* variables ask for quantization
    fp16 = FP16Compressor
    bf16 = BF16Compressor

    @staticmethod
    def quantize(bits: int = 4, bucket_size: int = 1024, rounding: Rounding | str = "stochastic",
                 error_feedback: bool = False, seed: int = 0,
                 warmup_steps: int = 0, rotate: bool = False) -> Compressor:
        """Max-min bucket quantization (CGX); see :class:`QuantizeCompressor`.

        Args:
            bits: 1..8 bits per value.
            bucket_size: values per (unit, min) pair, a multiple of 8.
            rounding: ``"stochastic"`` (unbiased) or ``"nearest"``.
            error_feedback: wrap in :class:`ErrorFeedback`.
            seed: stochastic-rounding seed, the same on every rank.
            warmup_steps: in ``DistributedOptimizer``, exact exchange for the first steps
                (as PyTorch's ``start_powerSGD_iter`` and DeepSpeed's ``freeze_step``).
            rotate: randomized Hadamard rotation of each bucket before quantizing (outliers
                spread out: less error at 2-4 bits), on every path.
        """
        comp = QuantizeCompressor(bits=bits, bucket_size=bucket_size, rounding=rounding, seed=seed,
                                  rotate=rotate)
        comp = ErrorFeedback(comp) if _check_flag(error_feedback, "error_feedback") else comp
        return _with_warmup(comp, warmup_steps)

    @staticmethod
    def auto(alpha: float = 1.0, families=None, window: int = 10,
             adjust_every: int = 1000, warmup_steps: int = 0, **kwargs) -> Compressor:
        """Per-layer levels chosen automatically within an error budget (L-GreCo).

        Every ``adjust_every`` steps, from gradients accumulated over ``window``
        steps, each layer gets the level that minimizes the bytes sent while the
        total error stays within ``alpha`` times the uniform default's. By default a
        layer may pick quantization, top-k or PowerSGD, and with ``objective="time"``
        the 16-bit casts (fp16, bf16) too. See
        :class:`AutoCompression` and :mod:`cgx.policy.levels`.
        """
        return AutoCompression(alpha=alpha, families=families, window=window,
                               adjust_every=adjust_every, warmup_steps=warmup_steps, **kwargs)

    @staticmethod
    def planned(bits: int = 4, bucket_size: int = 1024, calibrate_steps: int = 5,
                assume_gbit: Optional[float] = None, error_feedback: bool = False,
                replan_every: int = 50, drift_tolerance: float = 0.25, trials: bool = True,
                trial_steps: int = 3, trial_warmup_steps: int = 3,
                device_profile=None, trial_runoffs: int = 3) -> Compressor:
        """Exact or quantized per tensor, as the planner predicts is fastest (Espresso),
        confirmed by the step clock.

        The first ``calibrate_steps`` steps are traced (uniform quantized exchange), then
        the link and the quantizer are measured and each tensor's option is fixed; a
        tensor whose exchange hides under backward stays exact. With ``trials`` (the
        default) the planner's plan, all exact and all quantized then each run a few
        steps and the fastest measured is kept (:mod:`cgx.policy.trials.planned_decider`). Every
        ``replan_every`` steps the kept plan's step is checked (against its trial, or
        without trials against the prediction) and the plan remade when it drifts by
        more than ``drift_tolerance``. For CUDA gradients the plan also says where each
        tensor is quantized (the GPU, or the host on pinned copies; ``device_profile``).
        See :class:`PlannedCompression` and :mod:`cgx.policy.planner`.
        """
        return PlannedCompression(bits=bits, bucket_size=bucket_size,
                                  calibrate_steps=calibrate_steps, assume_gbit=assume_gbit,
                                  error_feedback=error_feedback, replan_every=replan_every,
                                  drift_tolerance=drift_tolerance, trials=trials,
                                  trial_steps=trial_steps, trial_warmup_steps=trial_warmup_steps,
                                  device_profile=device_profile, trial_runoffs=trial_runoffs)

    @staticmethod
    def topk(density: float = 0.01, error_feedback: bool = True,
             warmup_steps: int = 0) -> Compressor:
        """Top-k sparsification keeping ``density`` of each tensor; see :class:`TopKCompressor`.

        Error feedback is on by default: top-k without it is biased and loses accuracy.
        ``warmup_steps``: exact exchange for the first optimizer steps.
        """
        comp = TopKCompressor(density=density)
        comp = ErrorFeedback(comp) if _check_flag(error_feedback, "error_feedback") else comp
        return _with_warmup(comp, warmup_steps)

    @staticmethod
    def powersgd(rank: int = 1, min_compression_rate: float = 2.0, start_step: int = 0,
                 warm_start: bool = True, error_feedback: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0) -> Compressor:
        """PowerSGD low-rank compression; see :class:`PowerSGDCompressor` (own error feedback)."""
        return PowerSGDCompressor(rank=rank, min_compression_rate=min_compression_rate,
                                  start_step=start_step, warm_start=warm_start,
                                  error_feedback=error_feedback,
                                  orthogonalization_epsilon=orthogonalization_epsilon, seed=seed)


def resolve(compression) -> "Compressor | Policy":
    """A ``compression=`` argument of the optimizers, the tape and the DDP hook: a
    compressor (as :func:`as_compressor` makes it) or a policy (``"auto"``,
    ``Compression.auto(...)``, ``Compression.planned(...)``)."""
    if isinstance(compression, Policy):
        return compression
    if is_policy_name(compression):
        return AutoCompression()
    return as_compressor(compression)


def is_default(comp) -> bool:
    """Whether ``comp`` (resolved) is ``Compression.none``, the default ``compression=``
    whose meaning ``CGX_COMPRESSION`` sets (not ``Compression.exact``, which is exact
    whatever it says)."""
    return isinstance(comp, Compressor) and comp.family is Family.EXACT and \
        not isinstance(comp, ExactCompressor)


def fixed(compression, cfg) -> "Compressor | Policy":
    """``compression`` for an exchange that cannot plan the whole model (one layer at a
    time: Keras's sufficient-factor fallback; DiLoCo's warm-up, too short for trials): the
    default under ``CGX_COMPRESSION=decide`` becomes the uniform quantization of the
    ``CGX_COMPRESSION_*`` settings (exact when they turn it off); anything else as given."""
    if not (is_default(resolve(compression)) and cfg.compression is CompressionMode.DECIDE):
        return compression
    if not cfg.quantization_enabled:
        return Compression.exact
    return Compression.quantize(bits=cfg.bits, bucket_size=cfg.bucket_size,
                                rounding=cfg.rounding, error_feedback=cfg.error_feedback,
                                seed=cfg.seed)


__all__ = [
    "Compression", "Compressor", "Family", "HorovodCompressor", "as_compressor",
    "user_compressor",
    "resolve", "Policy",
    "stable_tensor_id", "NoneCompressor", "ExactCompressor", "FP16Compressor", "BF16Compressor",
    "QuantizeCompressor", "TopKCompressor", "PowerSGDCompressor", "ErrorFeedback",
    "AutoCompression", "PlannedCompression", "default_policy", "fixed", "is_default",
]
