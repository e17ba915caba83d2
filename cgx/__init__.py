"""cgx: compressed gradient exchange for data-parallel training.

Importing ``cgx`` is cheap: torch, TensorFlow and Triton load only when the
part that needs them is used.
"""

from cgx.config import Config, Rounding, ReductionType, TransportKind, Hierarchy
from cgx.errors import CGXError, ConfigError, NotInitializedError
from cgx.version import __version__

__all__ = [
    "Config", "Rounding", "ReductionType", "TransportKind", "Hierarchy",
    "CGXError", "ConfigError", "NotInitializedError", "__version__",
]
