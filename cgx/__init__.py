"""cgx: compressed gradient exchange for data-parallel training.

Importing ``cgx`` is cheap: torch, TensorFlow and Triton load only when the
part that needs them is used.
"""

from cgx.config import Config, Hierarchy, ReductionType, Rounding, TorchBackend, TransportKind
from cgx.errors import CGXError, ConfigError, NotInitializedError
from cgx.version import __version__

# Runtime calls (cgx.init(), cgx.rank(), ...) load cgx.runtime on first use.
_RUNTIME = (
    "init", "shutdown", "is_initialized", "size", "rank", "local_rank", "local_size",
    "cross_rank", "cross_size", "world", "transport", "local_transport", "cross_transport",
)

__all__ = [
    "Config", "Rounding", "ReductionType", "TransportKind", "TorchBackend", "Hierarchy",
    "CGXError", "ConfigError", "NotInitializedError", "__version__", *_RUNTIME,
]


def __getattr__(name):
    if name in _RUNTIME:
        from cgx import runtime
        return getattr(runtime, name)
    if name in ("runtime", "launcher"):  # `cgx.runtime.transport()` works after `import cgx`
        import importlib
        return importlib.import_module(f"cgx.{name}")
    raise AttributeError(f"module 'cgx' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_RUNTIME))
