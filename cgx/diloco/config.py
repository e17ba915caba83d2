"""The settings of DiLoCo-style training, validated once for both adapters.

DiLoCo (Douillard et al., 2023): every rank takes ``sync_every`` (H) steps of its own
inner optimizer; then the change of the parameters since the last synchronization,
the *outer gradient* ``anchor - current``, is averaged over ranks and applied to the
anchor by an outer optimizer (SGD with Nesterov momentum, lr 0.7, momentum 0.9).
Streaming DiLoCo (Douillard et al., 2025) cuts the parameters into ``fragments`` synced
at staggered steps, each fragment's exchange overlapping the next ``delay`` inner steps.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional, Union

AUTO = "auto"


def _int_at_least(value, name: str, low: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}{hint}")
    return int(value)


def _real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class OuterSGD:
    """The outer optimizer: SGD on the averaged outer gradient, applied to the anchor.

    ``buf = momentum * buf + d``; the anchor moves by ``-lr * (d + momentum * buf)``
    (Nesterov) or ``-lr * buf``, as ``torch.optim.SGD``. DiLoCo's defaults.

    An outer gradient is the inner steps' sum, so it carries the inner learning rate of
    its round; the buffer keeps earlier rounds' at their old rate. Under a decaying inner
    schedule that stale momentum keeps pushing when the inner steps have almost stopped
    (the loss rises at the end of training). ``follow_inner_lr=True`` rescales the buffer
    by ``inner lr now / inner lr at the last outer step`` before adding ``d``: the buffer
    then decays with the schedule, as ``torch.optim.SGD``'s does under a scheduler. With a
    constant inner learning rate it changes nothing.

    Args:
        lr: outer learning rate, > 0 (1.0 with momentum 0 is plain averaging).
        momentum: in [0, 1).
        nesterov: Nesterov momentum (needs momentum > 0).
        follow_inner_lr: rescale the momentum buffer with the inner learning rate (the
            adapters read it from the inner optimizer at every outer step).
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    follow_inner_lr: bool = False

    def __post_init__(self):
        lr, momentum = _real(self.lr, "outer lr"), _real(self.momentum, "outer momentum")
        if not lr > 0:
            raise ValueError(f"the outer learning rate must be > 0, got {self.lr!r} "
                             "(DiLoCo uses 0.7; outer_optimizer=None averages plainly)")
        if not 0 <= momentum < 1:
            raise ValueError(f"the outer momentum must be in [0, 1), got {self.momentum!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")
        if not isinstance(self.follow_inner_lr, bool):
            raise ValueError(f"follow_inner_lr must be True or False, got "
                             f"{self.follow_inner_lr!r}")
        if self.nesterov and momentum == 0:
            raise ValueError("Nesterov momentum needs momentum > 0; pass nesterov=False")
        object.__setattr__(self, "lr", lr)
        object.__setattr__(self, "momentum", momentum)


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """What a DiLoCo run does; every field checked at construction.

    Attributes:
        sync_every: H, inner steps per round (each fragment syncs once a round), or
            ``"auto"``: the smallest H whose exchange hides behind H inner steps, chosen
            after ``calibrate_steps`` local steps from the measured step time and link
            (``cgx.diloco.auto``); with an outer optimizer at least 50.
        fragments: K, parameter groups synced at staggered steps (1: the whole model at
            once, DiLoCo); at most H and at most the number of parameters.
        delay: inner steps a fragment's exchange overlaps before its result lands (0: the
            step that starts it waits for it). None: 0 for one fragment, 1 for several.
            Must be < H.
        outer_optimizer: :class:`OuterSGD`, or None: plain averaging (local SGD).
        compression: how the outer gradient travels (any ``compression=`` of cgx). None:
            4-bit quantization with error feedback.
        warmup_steps: steps of ordinary synchronous data parallel (gradients averaged
            every step through ``warmup_compression``) before the local steps begin.
        warmup_compression: the ``compression=`` of those steps (``Compression.none``: the
            ``CGX_*`` settings, as ``DistributedOptimizer``, but never the deciding
            exchange: a warm-up is too short for its trials; under the default
            ``CGX_COMPRESSION=decide`` the uniform ``CGX_COMPRESSION_*`` quantization).
        mix: weight of the rank's own parameters when a delayed fragment lands
            (Streaming DiLoCo's alpha): 0 replaces them by the synced ones (every rank
            then holds the same values); > 0 keeps part of the steps taken meanwhile.
        calibrate_steps: with ``sync_every="auto"``, local steps timed before H is chosen.
        assume_gbit: with ``"auto"``, plan for this link speed instead of measuring it.
    """

    sync_every: Union[int, str] = 50
    fragments: int = 1
    delay: Optional[int] = None
    outer_optimizer: Optional[OuterSGD] = OuterSGD()
    compression: Any = None
    warmup_steps: int = 0
    warmup_compression: Any = None
    mix: float = 0.0
    calibrate_steps: int = 5
    assume_gbit: Optional[float] = None

    def __post_init__(self):
        if self.sync_every != AUTO:
            _int_at_least(self.sync_every, "sync_every (H)", 1, " or 'auto'")
        k = _int_at_least(self.fragments, "fragments", 1)
        if self.delay is None:
            object.__setattr__(self, "delay", 0 if k == 1 else 1)
        _int_at_least(self.delay, "delay", 0)
        _int_at_least(self.warmup_steps, "warmup_steps", 0)
        _int_at_least(self.calibrate_steps, "calibrate_steps", 1)
        if self.sync_every != AUTO:
            self.check_round(int(self.sync_every))
        if self.outer_optimizer is not None and not isinstance(self.outer_optimizer, OuterSGD):
            raise TypeError(f"outer_optimizer must be cgx.diloco.OuterSGD(...) or None (plain "
                            f"averaging), got {type(self.outer_optimizer).__name__}")
        mix = _real(self.mix, "mix")
        if not 0 <= mix < 1:
            raise ValueError(f"mix must be in [0, 1), got {self.mix!r}")
        if self.assume_gbit is not None and not _real(self.assume_gbit, "assume_gbit") > 0:
            raise ValueError(f"assume_gbit must be > 0 (Gbit/s), got {self.assume_gbit!r}")

    def check_round(self, sync_every: int) -> None:
        """H against K and the delay (also for an H chosen by ``"auto"``)."""
        if self.fragments > sync_every:
            raise ValueError(f"fragments={self.fragments} > sync_every={sync_every}: each "
                             "fragment syncs at its own step of a round; use at most H "
                             "fragments")
        if self.delay >= sync_every:
            raise ValueError(f"delay={self.delay} must be < sync_every={sync_every}: a "
                             "fragment's exchange has to land before its next one starts")

    def check_parameters(self, count: int) -> None:
        """K against the number of parameters (known when the model is)."""
        if count < 1:
            raise ValueError("DiLoCo got no trainable parameters")
        if self.fragments > count:
            raise ValueError(f"fragments={self.fragments} > the {count} trainable parameters: "
                             f"every fragment holds at least one; use fragments <= {count}")

    @property
    def auto(self) -> bool:
        return self.sync_every == AUTO

    def outer_compression(self):
        """The outer gradient's compressor (a fresh one: compressors keep state)."""
        if self.compression is not None:
            return self.compression
        from cgx.compression import Compression
        return Compression.quantize(bits=4, error_feedback=True)
