"""``compression=`` arguments in ``get_config()`` / ``from_config()``.

Keras saves an optimizer's config as JSON, so a compressor travels as the dict it
describes itself with (:mod:`cgx.compression.configs`: ``{"type": "quantize", "bits": 4,
...}``, every constructor argument; its state, e.g. error-feedback residuals, is not
part of a config). A Horovod-style user compressor cannot be described this way: it is
saved as None, with a warning, and a loaded optimizer falls back to
``Compression.none`` unless ``cgx.tensorflow.keras.load_model(...,
compression=...)`` says otherwise.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from cgx.compression import configs
from cgx.tensorflow.compression import (BF16Compressor, Compression, ExactCompressor,
                                        FP16Compressor, NoneCompressor)

# A loaded config gives back the TF-aware casts (what cgx.tensorflow.Compression holds).
_TF_CASTS = {cls.config_type: cls for cls in (NoneCompressor, ExactCompressor, FP16Compressor,
                                              BF16Compressor)}


def compression_to_config(comp: Any) -> Optional[dict]:
    """A JSON-able description of ``comp``, or None (with a warning) for user compressors."""
    try:
        return configs.to_config(comp)
    except TypeError:
        warnings.warn(f"compression={comp!r} is not a cgx compressor and cannot be saved in the "
                      "optimizer's config; a model loaded from it uses Compression.none unless "
                      "cgx.tensorflow.keras.load_model(..., compression=...) is given",
                      stacklevel=3)
        return None


def compression_from_config(config: Optional[dict]) -> Any:
    """The compressor :func:`compression_to_config` described (``Compression.none`` for None)."""
    if config is None:
        return Compression.none
    return configs.from_config(config, classes=_TF_CASTS)
