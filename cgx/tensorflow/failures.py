"""Which TensorFlow errors are a failed collective (a rank lost, a link broken).

Inside a graph (``model.fit``, a ``tf.function``) a cgx collective reports its failure to
TensorFlow, which raises its own error type (``UnknownError`` for a ``tf.py_function``)
with the message only. Elastic training (``cgx.tensorflow.elastic``) must tell such a
failure from a wrong program: every cgx op that fails with a
:class:`~cgx.errors.CommunicationError` notes it here, and :func:`failure_behind` finds
it again behind the TensorFlow error.
"""

from __future__ import annotations

import threading
from typing import Optional

from cgx.errors import CommunicationError

_lock = threading.Lock()
_noted: list = []  # the last CommunicationError a TF op reported, until taken


def note(error: BaseException) -> None:
    """Called by the op bodies with the error they report to TensorFlow."""
    if isinstance(error, CommunicationError):
        with _lock:
            _noted[:] = [error]


def clear() -> None:
    with _lock:
        _noted.clear()


def failure_behind(error: BaseException) -> Optional[CommunicationError]:
    """The :class:`CommunicationError` behind ``error`` (itself, or the one a cgx op in a
    graph reported before TensorFlow raised ``error``), or None for any other error."""
    if isinstance(error, CommunicationError):
        return error
    import tensorflow as tf
    if not isinstance(error, tf.errors.OpError):
        return None
    with _lock:
        noted = _noted.pop() if _noted else None
    if noted is None and CommunicationError.__name__ in str(error):
        noted = CommunicationError(str(error))
    return noted
