"""TensorFlow <-> torch hand-over, and running a Python collective eagerly or in a graph.

The core reduces torch tensors. On CPU a TF tensor becomes a torch tensor
through DLPack without a copy (:func:`to_torch`), and a torch result becomes
a TF tensor the same way (:func:`to_tf`); TF then owns a reference to the
torch memory. TF tensors are immutable and their buffers may be shared, so
the core never writes into a tensor obtained from :func:`to_torch`: every
collective reduces a copy (one ``memcpy``, ~4 GB/s here, cheap next to
quantization) and hands that copy back.

Horovod's collectives go through :func:`collective`: eagerly one engine call, in a
graph one asynchronous op negotiated by name (:mod:`cgx.tensorflow.graph_ops`), which
completes whatever order a ``tf.compat.v1`` session starts them in. Other bodies (the
gradient exchange's bucket starts, Keras' helpers) are one ``tf.py_function`` op each
(:func:`run_collective`); ``py_function`` ops are stateful, so ``tf.function``'s
automatic control dependencies run them in program order: every rank issues them in
the same order, as ``cgx.session`` requires. XLA cannot compile either; under
``jit_compile=True`` the call fails early with :class:`XLAUnsupportedError`.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf
import torch
import torch.utils.dlpack

from cgx import session
from cgx.errors import CollectiveMismatchError, CommunicationError
from cgx.ops import op_name
from cgx.tensorflow import failures

# TF's CPU allocator aligns buffers to 64 bytes and its kernels assume it
# (a misaligned buffer aborts the process in Eigen); torch allocations are
# 64-byte aligned too, but a view at an offset (a slice of a gathered buffer)
# need not be.
TF_ALIGNMENT = 64

_NO_DLPACK = (tf.string, tf.resource, tf.variant)


class XLAUnsupportedError(ValueError):
    """A cgx collective was traced inside an XLA-compiled function."""

    # Autograph re-raises errors from converted code as their own type only when
    # it can call that type with a message, which it recognizes by this __init__;
    # otherwise the user would get an anonymous StagingError.
    __init__ = Exception.__init__


def _on_cpu(x: tf.Tensor) -> bool:
    device = getattr(x, "device", "") or ""
    return device == "" or ":CPU:" in device.upper()


def to_torch(x: tf.Tensor) -> torch.Tensor:
    """A torch view of an eager TF tensor (zero-copy on CPU; a host copy otherwise).

    Never write into the result: it may share memory with ``x``.
    """
    if x.dtype in _NO_DLPACK:
        raise TypeError(f"cgx collectives take numeric or bool tensors, got dtype {x.dtype.name}")
    if _on_cpu(x):
        return torch.utils.dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(x))
    # GPU tensors go through host memory: sharing them would need TF's and
    # torch's CUDA streams ordered, which DLPack alone does not do.
    arr = x.numpy()
    if x.dtype == tf.bfloat16:  # NumPy has no bfloat16 that torch reads
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def to_tf(t: torch.Tensor) -> tf.Tensor:
    """A TF tensor sharing ``t``'s memory (copied first when misaligned or strided)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()  # see to_torch: results come back through host memory
    if not t.is_contiguous() or t.data_ptr() % TF_ALIGNMENT:
        t = t.clone(memory_format=torch.contiguous_format)
    return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(t))


def copy_to_torch(x: tf.Tensor) -> torch.Tensor:
    """A torch tensor with its own memory holding ``x``: what the core may reduce in place."""
    return to_torch(x).clone(memory_format=torch.contiguous_format)


class WorkBuffers:
    """Torch buffers for the gradients of each exchange slot, reused from step to step.

    A fresh 64 MB tensor costs its page faults at every step (the allocator hands large
    blocks back to the system when they are freed): copying VGG-11's 112 MB of gradients
    into new tensors took 50-60 ms per step on one core here, into warm buffers a few
    times less. A slot's buffer is reused only when nothing but this object holds its
    memory (TensorFlow lets go of a result it was handed when the last tensor using it
    dies); otherwise - a caller keeping last step's gradients - a new one is taken.
    """

    def __init__(self):
        self._slots: dict = {}

    def empty(self, slot, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """The slot's buffer (uninitialized), or a new one when it is still in use."""
        buf = self._slots.get(slot)
        if buf is None or tuple(buf.shape) != tuple(shape) or buf.dtype != dtype or \
                buf.device != torch.device(device) or _shared(buf):
            buf = torch.empty(tuple(shape), dtype=dtype, device=device)
            self._slots[slot] = buf
        return buf

    def copy(self, slot, x: tf.Tensor) -> torch.Tensor:
        """A torch tensor holding ``x`` that the core may reduce in place."""
        src = to_torch(x)
        return self.empty(slot, src.shape, src.dtype, src.device).copy_(src)


def _shared(t: torch.Tensor) -> bool:
    """Is ``t``'s memory referenced by anything but ``t`` (a view, TensorFlow)?"""
    # One reference from t, one from the storage object made for this call.
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2


def in_xla_context() -> bool:
    """True while tracing a function that XLA compiles (``jit_compile=True``)."""
    from tensorflow.python.ops import control_flow_util
    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def _op_name(label: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", label).strip("_./-") or "collective"
    return "cgx_" + name


class InvalidArgumentError(tf.errors.InvalidArgumentError, ValueError):
    """A bad argument found while the collective runs (e.g. alltoall's splits): Horovod's
    ``tf.errors.InvalidArgumentError``, and still the ``ValueError`` cgx raised before."""


def _horovod_errors(fn):
    """Horovod's TensorFlow error types: ranks that disagree on a collective get
    ``tf.errors.FailedPreconditionError`` on every rank, bad arguments found while it runs
    ``tf.errors.InvalidArgumentError``. (Inside a graph, ``tf.py_function`` reports any
    Python error as ``tf.errors.UnknownError``, with the same message; the collectives of
    :func:`collective` are TensorFlow ops of their own there, with these types.)"""
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CommunicationError as e:  # a graph raises UnknownError: elastic runs look here
            failures.note(e)
            raise
        except CollectiveMismatchError as e:
            raise tf.errors.FailedPreconditionError(None, None, str(e)) from e
        except ValueError as e:
            if isinstance(e, tf.errors.OpError):
                raise
            raise InvalidArgumentError(None, None, str(e)) from e
    return wrapped


def collective(call: Callable[..., Sequence[torch.Tensor]], inputs: Sequence[tf.Tensor],
               dtypes: Sequence[tf.DType], shapes: Sequence[tf.TensorShape], kind: str, name,
               group) -> tuple:
    """Run the collective ``call(name, *torch tensors) -> torch tensors`` on the engine
    thread, now (eager) or as one graph op negotiated by name (:mod:`.graph_ops`).

    Args:
        inputs: TF tensors; dtypes, shapes: of the outputs (shapes may be partly unknown).
        kind, name: the collective's kind and name; None: auto-generated, from the eager
            counter (``<kind>.noname.<n>``) or, in a graph, from the op's node name.
        group: the resolved process set (None: the world).

    Returns:
        (the outputs as TF tensors, the collective's name).
    """
    if tf.executing_eagerly():
        name = op_name(name, kind, group)
        ts = [to_torch(x) for x in inputs]
        outs = _horovod_errors(session.run)(call, name, *ts, label=name)
        return [to_tf(o) for o in outs], name
    _refuse_xla(kind)
    from cgx.tensorflow.graph_ops import run_in_graph
    return run_in_graph(call, inputs, dtypes, shapes, kind, name, group)


def _refuse_xla(label: str) -> None:
    if in_xla_context():
        raise XLAUnsupportedError(
            f"cgx's {label} runs as a Python op (tf.py_function), which XLA cannot compile. "
            "Turn XLA off for this function: tf.function(jit_compile=False), or "
            "model.compile(..., jit_compile=False) with Keras")


def run_collective(fn: Callable[..., Sequence[tf.Tensor]], inputs: Sequence[tf.Tensor],
                   dtypes: Sequence[tf.DType], shapes: Sequence[tf.TensorShape],
                   label: str) -> list:
    """Run ``fn(*inputs) -> list of TF tensors`` now (eager) or as one graph op.

    Args:
        fn: the Python body; it receives eager tensors in both modes.
        inputs: TF tensors.
        dtypes, shapes: of the outputs (shapes may be partly unknown).
        label: names the op and the error messages.
    """
    fn = _horovod_errors(fn)
    if tf.executing_eagerly():
        return list(fn(*inputs))
    _refuse_xla(label)
    outs = tf.py_function(fn, list(inputs), list(dtypes), name=_op_name(label))
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return outs
