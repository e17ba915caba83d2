"""``resolve(compression, config, update_rule)``: the one reading of a ``compression=``."""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Optional

from cgx.policy.update_rule import UpdateRule, error_feedback_for
from cgx.compression import (AutoCompression, Compression, Family, ErrorFeedback,
                             ExactCompressor, QuantizeCompressor, default_policy, is_default)
from cgx.compression import resolve as as_setting
from cgx.compression.planned_policy import PlannedCompression
from cgx.config import AutoObjective, Config
from cgx.quant.codec import QuantSpec


class GradMode(enum.Enum):
    """How a list of gradients travels."""

    EXACT = "exact"  # plain fused allreduce
    QUANTIZE = "quantize"  # fused compressed allreduce (SRA/ring/allgather), per-layer specs
    SUMMABLE = "summable"  # cast payloads (fp16, bf16, Horovod-style), fused plain allreduce
    PER_TENSOR = "per_tensor"  # top-k, PowerSGD: the compressor's own reduction, per bucket
    AUTO = "auto"  # per-layer levels chosen within an error budget (cgx.policy.levels)
    PLANNED = "planned"  # per tensor exact or quantized, as the planner decides (cgx.policy.planner)


@dataclasses.dataclass(frozen=True)
class ExchangePolicy:
    """Everything the exchange needs to know about a ``compression=`` setting.

    Attributes:
        compressor: what carries it out: a compressor (the fixed modes) or the settings of
            a policy (``AutoCompression``, ``PlannedCompression``).
        mode: the :class:`GradMode`.
        base: the configuration the per-layer rules read (bits, bucket size, rounding of a
            quantizing compressor or ``Compression.planned``; else the given one).
        error_feedback: whether residuals are kept.
        warmup_steps: exact exchange for the first steps.
        rotate: quantized buckets are rotated (Hadamard) before quantizing.
        given: the setting as the user passed it (resolved to an object), for messages
            and signatures.
    """

    compressor: Any
    mode: GradMode
    base: Config
    error_feedback: bool
    warmup_steps: int = 0
    rotate: bool = False
    given: Any = None

    @property
    def quantizes(self) -> bool:
        """Fixed quantization with per-layer specs (``Compression.quantize``, the
        ``CGX_*`` default)."""
        return self.mode is GradMode.QUANTIZE

    @property
    def chooses(self) -> bool:
        """The setting chooses per layer as training goes (auto, planned)."""
        return self.mode in (GradMode.AUTO, GradMode.PLANNED)

    @property
    def quant_spec(self) -> Optional[QuantSpec]:
        """The one level of a fixed quantizing policy (None when nothing is quantized)."""
        if self.mode is not GradMode.QUANTIZE:
            return None
        b = self.base
        return QuantSpec(b.bits, b.bucket_size, b.rounding, rotate=self.rotate)

    @property
    def seed(self) -> int:
        """The stochastic-rounding seed: the quantizing compressor's, else the config's."""
        inner = getattr(self.compressor, "inner", None)  # policies have none
        return getattr(inner, "seed", self.base.seed)


def resolve(compression=None, config: Optional[Config] = None,
            update_rule: UpdateRule = UpdateRule.UNKNOWN, *,
            error_feedback: Optional[bool] = None) -> ExchangePolicy:
    """The :class:`ExchangePolicy` of a ``compression=`` argument.

    Args:
        compression: what the user passed (None: ``Compression.none``, the default, whose
            meaning ``CGX_COMPRESSION`` sets: :func:`cgx.compression.default_policy`).
        config: the settings (default: ``Config.from_env()``).
        update_rule: the optimizer's; auto keeps residuals under SGD, not under Adam.
        error_feedback: an adapter's override (the DDP hook's ``error_feedback=``): for
            auto, its residuals; otherwise the configured default's.

    Raises:
        TypeError, ValueError: what ``cgx.compression.resolve`` refuses.
    """
    cfg = config if config is not None else Config.from_env()
    given = as_setting(Compression.none if compression is None else compression)
    comp = given
    if is_default(comp):
        comp = default_policy(cfg) or comp
    if error_feedback is not None:
        if isinstance(comp, AutoCompression):
            comp = copy.copy(comp)  # the caller's object is never changed
            comp.error_feedback = bool(error_feedback)
        else:
            cfg = cfg.replace(error_feedback=bool(error_feedback))
    mode, base, ef = _mode_of(comp, cfg, update_rule)
    inner = getattr(comp, "inner", comp)
    return ExchangePolicy(comp, mode, base, ef,
                          warmup_steps=int(getattr(comp, "warmup_steps", 0) or 0),
                          rotate=getattr(inner, "rotate", False) is True, given=given)


def _mode_of(comp, cfg: Config, update_rule: UpdateRule) -> tuple:
    """``(mode, base config, error feedback)`` of a resolved setting."""
    if isinstance(comp, AutoCompression):
        if comp.objective is AutoObjective.TIME and comp.error_feedback is None:
            # the deciding exchange: residuals as the fixed default keeps them (the error
            # budget is the uniform default's, and residuals cost step time on every plan)
            return GradMode.AUTO, cfg, cfg.error_feedback
        return GradMode.AUTO, cfg, error_feedback_for(comp.error_feedback, update_rule,
                                                      cfg.error_feedback)
    if isinstance(comp, PlannedCompression):
        return (GradMode.PLANNED, cfg.replace(bits=comp.bits, bucket_size=comp.bucket_size),
                comp.error_feedback)
    if isinstance(comp, ExactCompressor):
        return GradMode.EXACT, cfg, False
    if comp.family is Family.EXACT:
        mode = GradMode.QUANTIZE if cfg.quantization_enabled else GradMode.EXACT
        return mode, cfg, cfg.error_feedback
    inner = comp.inner
    if isinstance(inner, QuantizeCompressor):
        base = cfg.replace(bits=inner.bits, bucket_size=inner.bucket_size,
                           rounding=inner.rounding)
        return GradMode.QUANTIZE, base, isinstance(comp, ErrorFeedback)
    return GradMode.SUMMABLE if comp.summable else GradMode.PER_TENSOR, cfg, False
