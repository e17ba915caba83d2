"""Collectives inside TensorFlow graphs: one asynchronous op each, negotiated by name.

A ``tf.compat.v1`` session starts independent ops in whatever order its threads pick
them, differently on each rank, and a ``tf.py_function`` that waits for the other ranks
holds one of those few threads (two on a 2-core machine): the ranks can wait for each
other's collectives forever. So in a graph each collective is one op of type
``CgxCollective``, registered here through TensorFlow's C API (``libtensorflow_framework``,
no compiled code of cgx's own) with an asynchronous kernel, as Horovod's ops are: the
kernel hands its inputs to :class:`cgx.collectives.negotiation.Negotiator` under the
collective's name and returns at once; the engine runs it when every rank has it ready,
in an order all ranks agree on, writes the outputs and tells TensorFlow the op is done.
Failures reach TensorFlow with Horovod's error codes: ``FailedPreconditionError`` when
ranks disagree (shapes, dtypes, root), ``InvalidArgumentError`` for bad arguments.

Auto-generated names in a graph come from the op's own node name
(``allreduce.noname.<node>``), the same on every rank that builds the same graph, and they
take no number from the eager counter (a graph built on one rank only shifts nothing).
Inputs are read in place (the collectives never write into them); outputs are copied once
into TensorFlow's buffers.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import weakref
from typing import Callable, Sequence

import tensorflow as tf
import torch
from tensorflow.python.framework import op_def_library

from cgx import session
from cgx.collectives.negotiation import Negotiator
from cgx.errors import CollectiveMismatchError
from cgx.tensorflow import failures

OP_TYPE = "CgxCollective"
_OK, _UNKNOWN, _INVALID_ARGUMENT, _FAILED_PRECONDITION = 0, 2, 3, 9

_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_COMPUTE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
_DELETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def _c_api():
    lib = ctypes.CDLL(os.path.join(tf.sysconfig.get_lib(), "libtensorflow_framework.so.2"))
    p, i, i64, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_char_p
    sigs = {"TF_NewStatus": (p, []), "TF_DeleteStatus": (None, [p]),
            "TF_GetCode": (i, [p]), "TF_Message": (s, [p]),
            "TF_SetStatus": (None, [p, i, s]),
            "TF_NewOpDefinitionBuilder": (p, [s]),
            "TF_OpDefinitionBuilderAddInput": (None, [p, s]),
            "TF_OpDefinitionBuilderAddOutput": (None, [p, s]),
            "TF_OpDefinitionBuilderAddAttr": (None, [p, s]),
            "TF_OpDefinitionBuilderSetIsStateful": (None, [p, ctypes.c_bool]),
            "TF_RegisterOpDefinition": (None, [p, p]),
            "TF_NewAsyncKernelBuilder": (p, [s, s, _CREATE, _COMPUTE, _DELETE]),
            "TF_RegisterKernelBuilder": (None, [s, p, p]),
            "TF_OpKernelConstruction_GetAttrInt64": (None, [p, s, ctypes.POINTER(i64), p]),
            "TF_NumInputs": (i, [p]), "TF_GetInput": (None, [p, i, ctypes.POINTER(p), p]),
            "TF_AllocateOutput": (p, [p, i, i, ctypes.POINTER(i64), i, ctypes.c_size_t, p]),
            "TF_OpKernelContext_Failure": (None, [p, p]),
            "TF_TensorData": (p, [p]), "TF_TensorByteSize": (ctypes.c_size_t, [p]),
            "TF_TensorType": (i, [p]), "TF_NumDims": (i, [p]), "TF_Dim": (i64, [p, i]),
            "TF_DeleteTensor": (None, [p])}
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class _Body:
    """What one graph op runs: ``fn(key, *torch inputs) -> torch outputs`` on the engine thread,
    under ``key`` (the collective's name), negotiated among the ranks of ``group``."""

    __slots__ = ("fn", "key", "group", "__weakref__")

    def __init__(self, fn: Callable, key, group):
        self.fn, self.key, self.group = fn, key, group


_bodies: "weakref.WeakValueDictionary[int, _Body]" = weakref.WeakValueDictionary()
_tokens = itertools.count(1)
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graph -> its bodies
_negotiators: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_api = None  # (the C library, the callbacks it holds): registered once per process


def _registered():
    global _api
    with _lock:
        if _api is None:
            lib = _c_api()
            # No delete callback (NULL): kernels die with sessions and functions, also while
            # the interpreter shuts down, when Python code can no longer run.
            callbacks = (_CREATE(_create), _COMPUTE(_compute), ctypes.cast(None, _DELETE))
            status = lib.TF_NewStatus()
            try:
                b = lib.TF_NewOpDefinitionBuilder(OP_TYPE.encode())
                for call, spec in ((lib.TF_OpDefinitionBuilderAddInput, "inputs: Tin"),
                                   (lib.TF_OpDefinitionBuilderAddOutput, "outputs: Tout"),
                                   (lib.TF_OpDefinitionBuilderAddAttr, "Tin: list(type) >= 0"),
                                   (lib.TF_OpDefinitionBuilderAddAttr, "Tout: list(type) >= 0"),
                                   (lib.TF_OpDefinitionBuilderAddAttr, "token: int")):
                    call(b, spec.encode())
                lib.TF_OpDefinitionBuilderSetIsStateful(b, True)
                lib.TF_RegisterOpDefinition(b, status)
                _check(lib, status)
                kb = lib.TF_NewAsyncKernelBuilder(OP_TYPE.encode(), b"CPU", *callbacks)
                lib.TF_RegisterKernelBuilder(OP_TYPE.encode(), kb, status)
                _check(lib, status)
            finally:
                lib.TF_DeleteStatus(status)
            _api = (lib, callbacks)
    return _api[0]


def _check(lib, status) -> None:
    if lib.TF_GetCode(status) != _OK:
        raise RuntimeError(f"cgx could not register its TensorFlow op: "
                           f"{lib.TF_Message(status).decode()}")


def negotiator_of(group) -> Negotiator:
    """The negotiator of a resolved process set (None: the world), one per session."""
    world = session.reducer()
    with _lock:
        per = _negotiators.setdefault(world, {})
        key = None if group is None else tuple(group.ranks)
        if key not in per:
            per[key] = Negotiator(lambda: session.reducer_of(group).transport, session.submit)
        return per[key]


def run_in_graph(fn: Callable, inputs: Sequence[tf.Tensor], dtypes: Sequence[tf.DType],
                 shapes: Sequence[tf.TensorShape], kind: str, name, group) -> tuple:
    """Build one negotiated collective op; returns (its outputs, its collective name).

    Args:
        fn: ``fn(name, *torch tensors) -> list of torch tensors``, run on the engine thread.
        name: the collective's name; None: ``<kind>.noname.<node name>``.
        group: the resolved process set (None: the world).
    """
    _registered()
    body = _Body(fn, name, group)
    token = next(_tokens)
    _bodies[token] = body
    with _lock:  # the body lives as long as the graph that can run the op
        _kept.setdefault(_outermost(tf.compat.v1.get_default_graph()), []).append(body)
    with tf.device("/cpu:0"):
        _, _, op, outs = op_def_library._apply_op_helper(
            OP_TYPE, inputs=list(inputs), Tout=list(dtypes), token=token, name=f"cgx_{kind}")
    if body.key is None:
        body.key = f"{kind}.noname.{op.name}"
    outs = list(outs)
    for out, shape in zip(outs, shapes):
        out.set_shape(shape)
    return outs, body.key


def _outermost(graph):
    while getattr(graph, "outer_graph", None) is not None:
        graph = graph.outer_graph
    return graph


# -- the kernel (TensorFlow's threads, holding the GIL while in Python) ---------------------

class _Done(ctypes.Structure):
    """A copy of the kernel's ``done`` callback, a libstdc++ ``std::function<void()>``
    (TensorFlow's wheels link libstdc++). The C API hands the kernel a pointer to its own
    argument, valid only while the kernel's compute call runs; the collective finishes
    later, so the kernel keeps a copy made with the function's own manager, as the copy
    constructor does."""

    _fields_ = [("functor", ctypes.c_byte * 16), ("manager", ctypes.c_void_p),
                ("invoker", ctypes.c_void_p)]
    _MANAGER = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
    _INVOKER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    _CLONE, _DESTROY = 2, 3  # std::_Manager_operation

    @classmethod
    def copy_of(cls, address: int) -> "_Done":
        src = cls.from_address(address)
        done = cls()
        if not src.manager or not src.invoker:
            raise RuntimeError("TensorFlow passed an empty completion callback")
        cls._MANAGER(src.manager)(ctypes.addressof(done), address, cls._CLONE)
        done.manager, done.invoker = src.manager, src.invoker
        return done

    def __call__(self) -> None:
        """Tell TensorFlow the op is done (once), then destroy the copy."""
        manager, here = self._MANAGER(self.manager), ctypes.addressof(self)
        self._INVOKER(self.invoker)(here)
        manager(here, here, self._DESTROY)
        self.manager = self.invoker = None

def _create(construction) -> int:
    lib = _api[0]
    token = ctypes.c_int64(0)
    status = lib.TF_NewStatus()
    lib.TF_OpKernelConstruction_GetAttrInt64(construction, b"token", ctypes.byref(token), status)
    lib.TF_DeleteStatus(status)
    return token.value


def _compute(token, ctx, done_address) -> None:
    held: list = []
    try:
        done = _Done.copy_of(done_address)
    except BaseException as exc:  # noqa: BLE001 - nothing to call back: say why, fail now
        return _fail_now(ctx, exc)
    try:
        body = _bodies.get(token or 0)
        if body is None:
            raise RuntimeError("this cgx collective's graph has been deleted")
        inputs = [_input(ctx, i, held) for i in range(_api[0].TF_NumInputs(ctx))]
        negotiator_of(body.group).ready(
            body.key, lambda: body.fn(body.key, *inputs),
            lambda result, error: _finish(ctx, done, held, result, error))
    except BaseException as exc:  # noqa: BLE001 - reported to TensorFlow, never lost
        _finish(ctx, done, held, None, exc)


def _input(ctx, i: int, held: list) -> torch.Tensor:
    """Input ``i`` as a torch tensor over TensorFlow's buffer (valid until done)."""
    lib = _api[0]
    t = ctypes.c_void_p()
    status = lib.TF_NewStatus()
    try:
        lib.TF_GetInput(ctx, i, ctypes.byref(t), status)
        _check_status(lib, status)
    finally:
        lib.TF_DeleteStatus(status)
    held.append(t.value)
    dtype = getattr(torch, tf.as_dtype(lib.TF_TensorType(t)).name)
    shape = [lib.TF_Dim(t, d) for d in range(lib.TF_NumDims(t))]
    nbytes = lib.TF_TensorByteSize(t)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    buf = (ctypes.c_uint8 * nbytes).from_address(lib.TF_TensorData(t))
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


def _finish(ctx, done, held: list, result, error) -> None:
    lib = _api[0]
    try:
        if error is None:
            for i, out in enumerate(result):
                _output(lib, ctx, i, out)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    if error is not None:
        _fail_now(ctx, error)
    for t in held:
        lib.TF_DeleteTensor(t)
    done()


def _fail_now(ctx, error: BaseException) -> None:
    failures.note(error)
    lib = _api[0]
    status = lib.TF_NewStatus()
    lib.TF_SetStatus(status, _code(error), _message(error).encode(errors="replace"))
    lib.TF_OpKernelContext_Failure(ctx, status)
    lib.TF_DeleteStatus(status)


def _output(lib, ctx, i: int, t: torch.Tensor) -> None:
    t = t.detach().cpu().contiguous()
    dims = (ctypes.c_int64 * max(1, t.dim()))(*t.shape)
    nbytes = t.numel() * t.element_size()
    code = tf.as_dtype(str(t.dtype).rsplit(".", 1)[1]).as_datatype_enum
    status = lib.TF_NewStatus()
    try:
        out = lib.TF_AllocateOutput(ctx, i, code, dims, t.dim(), nbytes, status)
        _check_status(lib, status)
    finally:
        lib.TF_DeleteStatus(status)
    if nbytes:
        ctypes.memmove(lib.TF_TensorData(out), t.data_ptr(), nbytes)
    lib.TF_DeleteTensor(out)


def _check_status(lib, status) -> None:
    if lib.TF_GetCode(status) != _OK:
        raise tf.errors.InternalError(None, None, lib.TF_Message(status).decode())


def _code(error: BaseException) -> int:
    """Horovod's error codes: ranks that disagree, bad arguments, anything else."""
    if isinstance(error, tf.errors.OpError):
        return error.error_code
    if isinstance(error, CollectiveMismatchError):
        return _FAILED_PRECONDITION
    if isinstance(error, (ValueError, TypeError)):
        return _INVALID_ARGUMENT
    return _UNKNOWN


def _message(error: BaseException) -> str:
    if isinstance(error, (tf.errors.OpError, CollectiveMismatchError, ValueError, TypeError)):
        return str(getattr(error, "message", None) or error)
    return f"{type(error).__name__}: {error}"
