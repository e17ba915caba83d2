"""Sufficient factors for Keras ``Dense`` layers (see :mod:`cgx.sufficient_factors`).

A Keras optimizer only receives gradients, and Keras 3 has no forward hooks, so the
factors are taken where they exist: each ``Dense`` layer of the model computes its
product ``x @ kernel + bias`` through a ``tf.custom_gradient`` whose gradient function
holds the layer's input ``x`` and output gradient ``dy``. That gradient function is
the exchange: it all-gathers every rank's ``[dy | x]`` and returns the exact averaged
kernel and bias gradients (``x^T dy / P``, ``sum(dy) / P``), one ``tf.py_function``
run during backward, as soon as ``dy`` exists. When the factors are not worth it
(``K x P x (M + N) >= M x N``, decided alike on every rank from every rank's K), the
same op reduces the layer's local gradient with the optimizer's compression instead.
Either way the result is already the average: the optimizer passes these gradients
through.

A layer called twice in one step exchanges the factors of each call; the tape sums the
two averaged parts, which is the averaged gradient. Only plain ``keras.layers.Dense``
layers are routed (not subclasses, not LoRA or quantized ones); the others, and layers
that do not train, keep their own ``call``. The routing is installed when the optimizer
is built, so it is part of every train step traced afterwards.

Every rank issues these exchanges in the same order: each is a stateful
``tf.py_function`` without resource inputs, which ``tf.function``'s automatic control
dependencies run in program order (the order backward creates them), before the
optimizer's own buckets; eagerly, they run as backward reaches them.
"""

from __future__ import annotations

import threading
import types
from typing import Optional

import keras
import tensorflow as tf
import torch

from cgx import session
from cgx.grad_plan import GradientPlan, GradMode
from cgx.comm.base import ReduceOp
from cgx.process_sets import reducer_of
from cgx.sufficient_factors import gathered
from cgx.tensorflow._bridge import WorkBuffers, run_collective, to_tf, to_torch


def routable(layer) -> bool:
    """A plain, built, float ``Dense`` layer that trains: its product can be routed."""
    return (type(layer) is keras.layers.Dense and layer.built and layer.trainable
            and not getattr(layer, "lora_enabled", False)
            and getattr(layer, "quantization_mode", None) is None
            and getattr(layer, "_kernel", None) is not None and layer._kernel.trainable
            and tf.as_dtype(layer._kernel.dtype).is_floating)


class FactorLayers:
    """Routes the ``Dense`` layers of ``model`` through the sufficient-factor exchange.

    Args:
        model: a Keras model or layer; its ``Dense`` layers (nested ones included)
            are patched (their ``call``; the model's config and weights are untouched).
        compression, op, predivide, rules, update_rule: the optimizer's, for the
            plain fallback.
        group: the process set's group (None: all ranks).
        label: names the ops and collectives, the same on every rank.

    Attributes:
        used: layer name -> whether its last exchange sent factors.
    """

    def __init__(self, model, *, compression, op, predivide: float, rules, group,
                 update_rule, label: str):
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"sufficient_factors= takes the Keras model whose Dense layers "
                            f"should exchange factors, got {type(model).__name__}")
        self.compression, self.op, self.predivide = compression, op, float(predivide)
        self.rules, self.group, self.update_rule = rules, group, update_rule
        self.label = label
        self.used: dict[str, bool] = {}
        self._plans: dict = {}
        self._buffers = WorkBuffers()  # per layer, the kernel gradient's memory
        self._lock = threading.Lock()
        self.layers = [layer for layer in _layers(model) if type(layer) is keras.layers.Dense]
        for layer in self.layers:
            _patch(layer, self)

    def reduced_ids(self) -> set:
        """ids of the variables whose gradients the exchange already averaged."""
        out = set()
        for layer in self.layers:
            if routable(layer):
                out.add(id(layer._kernel))
                if layer.bias is not None and layer.bias.trainable:
                    out.add(id(layer.bias))
        return out

    # -- the exchange (engine thread) ------------------------------------------------------

    def exchange(self, name: str, x: torch.Tensor, dy: torch.Tensor, bias: bool) -> list:
        """Every rank, same order: ``[kernel grad (N x M), bias grad (M)]`` averaged (or
        summed) over the ranks, from this rank's input ``x`` (K x N) and output gradient
        ``dy`` (K x M)."""
        red = reducer_of(self.group)
        tr = red.transport
        P = tr.size
        x = x.to(tr.device, torch.float32)
        dy = dy.to(tr.device, torch.float32)
        n, m = x.shape[1], dy.shape[1]
        # One call's factors are always a faithful record of it.
        factors = None if P == 1 else gathered(
            tr, [(dy, x)], m, n, rows=x.shape[0], faithful=True,
            average=self.op is ReduceOp.AVERAGE, record=red.add_stats, bias=bias)
        self.used[name] = factors is not None
        if factors is not None:
            dy_all, x_all = factors
            return [torch.mm(x_all.t(), dy_all, out=self._kernel_buffer(name, n, m, tr))] + \
                ([dy_all.sum(0)] if bias else [])
        grads = [torch.mm(x.t(), dy, out=self._kernel_buffer(name, n, m, tr))] + \
            ([dy.sum(0)] if bias else [])
        if P == 1:
            return grads
        return self._plan(name, grads).reduce(grads, name=f"{self.label}.factors.{name}")

    def _kernel_buffer(self, name: str, n: int, m: int, transport) -> torch.Tensor:
        """Where the layer's kernel gradient is written: last step's buffer once TensorFlow
        let go of it (a new M x N tensor would pay its page faults every step)."""
        return self._buffers.empty(name, (n, m), torch.float32, transport.device)

    def _plan(self, name: str, grads: list) -> GradientPlan:
        """The plain path's plan for one layer (the optimizer's compression and rules)."""
        names = [f"{name}/kernel", f"{name}/bias"][:len(grads)]
        with self._lock:
            plan = self._plans.get(name)
            if plan is None:
                plan = self._plans[name] = GradientPlan(
                    names, [tuple(g.shape) for g in grads], self.compression, op=self.op,
                    predivide=self.predivide, rules=self.rules, group=self.group,
                    update_rule=self.update_rule)
                if plan.mode in (GradMode.AUTO, GradMode.PLANNED):
                    check_compression(self.compression)  # raises, saying what to change
            return plan


def _layers(model) -> list:
    """``model`` and every layer inside it (nested models too), once each."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def _patch(layer, factors: FactorLayers) -> None:
    if getattr(layer, "_cgx_factors", None) is not None:
        raise ValueError(f"Dense layer {layer.name!r} is already routed through a "
                         "sufficient-factor exchange; pass the model to one optimizer only")
    layer._cgx_factors = factors
    own = layer.call

    def call(self, inputs, training=None):
        if not routable(self) or isinstance(inputs, keras.KerasTensor):
            return own(inputs, training=training)
        y = _factor_product(self, factors, tf.convert_to_tensor(inputs),
                            tf.convert_to_tensor(self.kernel),
                            None if self.bias is None else tf.convert_to_tensor(self.bias))
        return self.activation(y) if self.activation is not None else y

    layer.call = types.MethodType(call, layer)


def _factor_product(layer, factors: FactorLayers, x, kernel, bias: Optional[tf.Tensor]):
    """``x @ kernel + bias``, whose gradient comes from the sufficient-factor exchange."""
    n, m = kernel.shape
    name = layer.name
    has_bias = bias is not None
    trains_bias = has_bias and layer.bias.trainable

    @tf.custom_gradient
    def product(x, kernel, *bias):
        lead = tf.shape(x)[:-1]
        x2 = tf.reshape(x, [-1, n])
        y = tf.matmul(x2, kernel)
        if bias:
            y = y + bias[0]
        y = tf.reshape(y, tf.concat([lead, [m]], 0))
        y.set_shape(x.shape[:-1].concatenate([m]))

        def grad(dy):
            dy2 = tf.reshape(dy, [-1, m])
            dx = tf.reshape(tf.matmul(dy2, kernel, transpose_b=True), tf.shape(x))

            def body(xs, dys):
                outs = session.run(factors.exchange, name, to_torch(xs), to_torch(dys),
                                   trains_bias, label=f"{factors.label}.factors")
                return [to_tf(o) for o in outs]

            dtypes = [tf.float32] * (2 if trains_bias else 1)
            shapes = [tf.TensorShape([n, m])] + ([tf.TensorShape([m])] if trains_bias else [])
            outs = run_collective(body, [x2, dy2], dtypes, shapes,
                                  f"{factors.label}.factors.{name}")
            gk = tf.cast(outs[0], kernel.dtype)
            if not has_bias:
                return dx, gk
            gb = tf.cast(outs[1], bias[0].dtype) if trains_bias else tf.zeros_like(bias[0])
            return dx, gk, gb

        return y, grad

    return product(x, kernel, *([bias] if has_bias else []))


def check_compression(compression) -> None:
    """The plain fallback reduces one layer at a time with a fixed compression: the
    per-layer planners (``"auto"``, ``planned()``) plan the whole model and cannot."""
    from cgx import runtime
    from cgx.compression import AutoCompression, CompressorKind, as_compressor
    from cgx.compression.planned import PlannedCompression
    from cgx.config import CompressionMode
    from cgx.tensorflow.ops import tf_side_compressor
    if tf_side_compressor(compression) is not None:
        raise ValueError("sufficient_factors= works with cgx's compressors (Compression.*), "
                         "not with a TensorFlow-side compressor object")
    comp = as_compressor(compression)
    if isinstance(comp, (AutoCompression, PlannedCompression)) or (
            comp.kind is CompressorKind.NONE and runtime.is_initialized()
            and runtime.config().compression is CompressionMode.AUTO):
        raise ValueError("sufficient_factors= on the Keras optimizer takes a fixed "
                         "compression (quantize, fp16, exact, ...), not a per-model plan "
                         "(auto, planned): the plain fallback reduces one layer at a time. "
                         "Pass e.g. Compression.quantize(bits=4), or leave CGX_COMPRESSION "
                         "at quantize")
