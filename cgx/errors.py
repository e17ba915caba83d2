"""Errors cgx raises on purpose.

Every error says what was expected, what arrived, and what to change.
User mistakes are ``ValueError``/``TypeError`` subclasses so that generic
handlers keep working.
"""


class CGXError(RuntimeError):
    """Base class for runtime failures inside cgx (not user input)."""


class CommunicationError(CGXError):
    """A collective failed or did not finish: a rank is gone or a link broke (what
    Horovod's elastic jobs catch as ``HorovodInternalError``; cgx's elastic jobs form a new
    world on it, and on nothing else)."""


class ConfigError(ValueError):
    """An environment variable or option holds a value cgx cannot use."""


class NotInitializedError(CGXError):
    """A call needs ``cgx.init()`` first."""

    def __init__(self, what: str = "this call"):
        super().__init__(f"{what} needs cgx.init() (or cgx.torch.init()) to be called first")


class MissingDependencyError(ImportError):
    """An optional dependency is missing; the message names the extra to install."""

    def __init__(self, module: str, extra: str, purpose: str):
        super().__init__(
            f"{purpose} needs the Python package '{module}', which is not installed. "
            f"Install it with: pip install 'cgx[{extra}]'"
        )
        self.name = module


class CollectiveMismatchError(CGXError):
    """Ranks disagree on a collective (different names, shapes, dtypes, roots or settings).

    Raised on every rank with the same message. ``recoverable`` is True when
    no rank has moved data yet, so the job can go on (as with Horovod);
    False when queued work depended on the agreement (cgx then stops
    communicating for good).
    """

    def __init__(self, message: str, recoverable: bool = True):
        super().__init__(message)
        self.recoverable = recoverable

    def __reduce__(self):
        return (type(self), (str(self), self.recoverable))
