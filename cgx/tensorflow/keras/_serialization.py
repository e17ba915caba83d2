"""``compression=`` arguments as plain dicts, for ``get_config()`` / ``from_config()``.

Keras saves an optimizer's config as JSON, so a compressor travels as
``{"type": "quantize", "bits": 4, ...}``. cgx compressors round-trip with all
their options (their state, e.g. error-feedback residuals, is not part of a
config). A Horovod-style user compressor cannot be described this way: it is
saved as None, with a warning, and a loaded optimizer falls back to
``Compression.none`` unless ``cgx.tensorflow.keras.load_model(...,
compression=...)`` says otherwise.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from cgx import compression as core
from cgx.compression import (AutoCompression, ErrorFeedback, PowerSGDCompressor,
                             QuantizeCompressor, TopKCompressor)
from cgx.tensorflow.compression import (BF16Compressor, Compression, ExactCompressor,
                                        FP16Compressor, NoneCompressor)

# The TF-aware cast classes (what cgx.tensorflow.Compression holds) are what a loaded
# config gives back; the core classes describe the same thing.
_CLASSES = {"none": NoneCompressor, "exact": ExactCompressor, "fp16": FP16Compressor,
            "bf16": BF16Compressor}
_CORE = {"none": core.NoneCompressor, "exact": core.ExactCompressor,
         "fp16": core.FP16Compressor, "bf16": core.BF16Compressor}
_POWERSGD_KEYS = ("rank", "min_compression_rate", "start_step", "warm_start", "error_feedback",
                  "orthogonalization_epsilon", "seed")


def compression_to_config(comp: Any) -> Optional[dict]:
    """A JSON-able description of ``comp``, or None (with a warning) for user compressors."""
    for key, cls in _CLASSES.items():
        if comp is cls or comp is _CORE[key]:
            return {"type": key}
        if type(comp) in (cls, _CORE[key]):  # an instance: fp16/bf16 may carry a predivide
            return {"type": key, "predivide": getattr(comp, "predivide", None)}
    if isinstance(comp, AutoCompression):
        return {"type": "auto", "alpha": comp.alpha, "families": list(comp.families),
                "window": comp.window, "adjust_every": comp.adjust_every,
                "warmup_steps": comp.warmup_steps, "bits": list(comp.bits),
                "bucket_sizes": list(comp.bucket_sizes), "densities": list(comp.densities),
                "ranks": list(comp.ranks),
                "rounding": None if comp.rounding is None else comp.rounding.value,
                "error_feedback": comp.error_feedback, "planner": comp.planner,
                "assume_gbit": comp.assume_gbit}
    if isinstance(comp, QuantizeCompressor):
        return {"type": "quantize", "bits": comp.bits, "bucket_size": comp.bucket_size,
                "rounding": comp.rounding.value, "seed": comp.seed,
                **({"rotate": True} if comp.rotate else {})}
    if isinstance(comp, TopKCompressor):
        return {"type": "topk", "density": comp.density}
    if isinstance(comp, PowerSGDCompressor):
        return {"type": "powersgd", **{k: getattr(comp, k) for k in _POWERSGD_KEYS}}
    if isinstance(comp, ErrorFeedback):
        inner = compression_to_config(comp.compressor)
        return None if inner is None else {"type": "error_feedback", "compressor": inner}
    warnings.warn(f"compression={comp!r} is not a cgx compressor and cannot be saved in the "
                  "optimizer's config; a model loaded from it uses Compression.none unless "
                  "cgx.tensorflow.keras.load_model(..., compression=...) is given",
                  stacklevel=3)
    return None


def compression_from_config(config: Optional[dict]) -> Any:
    """The compressor :func:`compression_to_config` described (``Compression.none`` for None)."""
    if config is None:
        return Compression.none
    if not isinstance(config, dict) or "type" not in config:
        raise ValueError(f"a compression config is a dict with a 'type' key (from "
                         f"get_config()), got {config!r}")
    kind = config["type"]
    args = {k: v for k, v in config.items() if k != "type"}
    if kind in _CLASSES:
        cls = _CLASSES[kind]
        if args.get("predivide") is None:
            return cls  # the class, as Compression.none / Compression.fp16 are
        return cls(predivide=args["predivide"])
    if kind == "quantize":
        return QuantizeCompressor(**args)
    if kind == "topk":
        return TopKCompressor(**args)
    if kind == "powersgd":
        return PowerSGDCompressor(**args)
    if kind == "error_feedback":
        return ErrorFeedback(compression_from_config(args["compressor"]))
    if kind == "auto":
        return AutoCompression(**args)
    raise ValueError(f"unknown compression type {kind!r} in an optimizer config; expected one "
                     f"of {sorted(_CLASSES) + ['quantize', 'topk', 'powersgd', 'error_feedback', 'auto']}")
