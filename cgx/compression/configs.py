"""``compression=`` settings as plain dicts, and back: ``{"type": "quantize", "bits": 4, ...}``.

Each compressor and policy describes itself (``to_config()``: its constructor arguments)
and is rebuilt from that (``from_config``); this module only adds the ``type`` key and
finds the class by it. Keras optimizer configs, checkpoints and tables use this one
description. A user's compressor (Horovod's two-method interface) cannot be described:
:func:`to_config` raises ``TypeError`` for it.
"""

from __future__ import annotations

from typing import Any, Optional

from cgx.compression.auto_policy import AutoCompression
from cgx.compression.base import OFFERED_FAMILIES, Compressor
from cgx.compression.casts import BF16Compressor, ExactCompressor, FP16Compressor, NoneCompressor
from cgx.compression.error_feedback import ErrorFeedback
from cgx.compression.planned_policy import PlannedCompression
from cgx.compression.powersgd import PowerSGDCompressor
from cgx.compression.quantize import QuantizeCompressor
from cgx.compression.topk import TopKCompressor

# type -> class: the compressors and policies that describe themselves.
TYPES: dict = {cls.config_type: cls
               for cls in (NoneCompressor, ExactCompressor, FP16Compressor, BF16Compressor,
                           QuantizeCompressor, TopKCompressor, PowerSGDCompressor,
                           ErrorFeedback)}
TYPES.update({cls.name: cls for cls in (AutoCompression, PlannedCompression)})
# A class stands for its default instance (Compression.none, Compression.fp16 are classes).
_STATELESS = (NoneCompressor, ExactCompressor, FP16Compressor, BF16Compressor)


def register(cls) -> type:
    """Add a compressor class (with ``config_type``) or policy class (with ``name``) to
    :data:`TYPES`, so that its configs are rebuilt; returns the class (a decorator)."""
    key = getattr(cls, "config_type", None) or getattr(cls, "name", None)
    if not isinstance(key, str) or not key:
        raise TypeError(f"{cls.__name__} needs a config_type (compressors) or name (policies) "
                        "to be registered")
    TYPES[key] = cls
    OFFERED_FAMILIES.pop(key, None)
    if isinstance(cls, type) and issubclass(cls, Compressor) and cls.summable and \
            cls.auto_levels.__func__ is not Compressor.auto_levels.__func__:
        OFFERED_FAMILIES[key] = cls
    return cls


def offered(name: str) -> Optional[type]:
    """The registered summable compressor class that ``Compression.auto`` offers as the
    family ``name`` (its ``config_type``), or None: it defines no :meth:`auto_levels`."""
    return OFFERED_FAMILIES.get(name)


def offered_names() -> tuple:
    """The ``config_type`` of every registered family auto may offer (see :func:`offered`)."""
    return tuple(OFFERED_FAMILIES)


def type_of(comp: Any) -> str:
    """The ``type`` key of ``comp``'s config; TypeError for what cannot describe itself."""
    cls = comp if isinstance(comp, type) else type(comp)
    for key, known in TYPES.items():
        if cls is known or (issubclass(cls, known) and _same_config_type(cls, known)):
            return key
    raise TypeError(f"compression={comp!r} is not a cgx compressor or policy and cannot be "
                    "described as a config")


def _same_config_type(cls, known) -> bool:
    """A subclass (e.g. TensorFlow's fp16 cast) is described as its base when it keeps
    the base's config name."""
    return getattr(cls, "config_type", None) == getattr(known, "config_type", None) and \
        getattr(cls, "name", None) == getattr(known, "name", None)


def _describable(value: Any) -> bool:
    """A compressor inside a config (ErrorFeedback's), described in turn."""
    return isinstance(value, Compressor) or \
        (isinstance(value, type) and issubclass(value, Compressor))


def to_config(comp: Any) -> dict:
    """``{"type": ..., **comp.to_config()}``; a stateless class stands for itself."""
    key = type_of(comp)
    if isinstance(comp, type):
        if not issubclass(comp, _STATELESS):
            raise TypeError(f"pass an instance of {comp.__name__}, not the class")
        return {"type": key}
    config = {"type": key, **{k: to_config(v) if _describable(v) else v
                              for k, v in comp.to_config().items()}}
    if isinstance(comp, Compressor) and getattr(comp, "warmup_steps", 0):
        config["warmup_steps"] = comp.warmup_steps  # Compression.quantize(warmup_steps=...)
    return config


def from_config(config: Any, classes: dict | None = None) -> Any:
    """What :func:`to_config` described. ``classes``: per type, the class to build instead
    (TensorFlow's casts). A stateless compressor without arguments comes back as its
    class, as ``Compression.none`` and ``Compression.fp16`` are.

    Raises:
        ValueError: not such a dict, or an unknown type.
    """
    if not isinstance(config, dict) or "type" not in config:
        raise ValueError(f"a compression config is a dict with a 'type' key (from "
                         f"get_config()), got {config!r}")
    kind = config["type"]
    cls = (classes or {}).get(kind) or TYPES.get(kind)
    if cls is None:
        raise ValueError(f"unknown compression type {kind!r} in a config; expected one of "
                         f"{sorted(TYPES)}")
    args = {k: from_config(v, classes) if isinstance(v, dict) and "type" in v else v
            for k, v in config.items() if k != "type"}
    warmup = args.pop("warmup_steps", 0) if issubclass(cls, Compressor) else 0
    if issubclass(cls, _STATELESS) and not args and not warmup:
        return cls
    comp = cls.from_config(args)
    if warmup:
        comp.warmup_steps = int(warmup)
    return comp
