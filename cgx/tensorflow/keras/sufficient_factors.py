"""Sufficient factors for Keras ``Dense`` layers (see :mod:`cgx.sufficient_factors`).

A Keras optimizer only receives gradients, and Keras 3 has no forward hooks, so the
factors are taken where they exist: each ``Dense`` layer of the model computes its
product ``x @ kernel + bias`` through a ``tf.custom_gradient`` whose gradient function
holds the layer's input ``x`` and output gradient ``dy``. That gradient function is
the exchange: it all-gathers every rank's ``[dy | x]`` and returns the exact averaged
kernel and bias gradients (``x^T dy / P``, ``sum(dy) / P``), one ``tf.py_function``
run during backward, as soon as ``dy`` exists. When the factors are not worth it
(``K x P x (M + N) >= M x N``, decided alike on every rank from every rank's K), the
same op averages the layer's local gradient with the optimizer's compression instead.
Either way the result is the average over the ranks (also under ``op=Sum``: the
optimizer multiplies it by P), bit-identical on every rank.

A layer called twice in one step exchanges the factors of each call; the tape sums the
two averaged parts, which is the averaged gradient. Only plain ``keras.layers.Dense``
layers are routed (not subclasses, not LoRA or quantized ones); the others, and layers
that do not train, keep their own ``call``. The routing is installed when the optimizer
is built, so it is part of every train step traced afterwards.

When the rebuilt average is the whole gradient
----------------------------------------------
The tape adds every use of a variable. A kernel also read outside its layer's product
(a tied head holding the layer, ``tf.matmul(h, layer.kernel)`` in another layer or a
``Lambda``, an extra loss term in a custom train step) gets the rebuilt average plus
this rank's own share of the other uses, which the ranks do not hold alike: passed
through unreduced, it would let the replicas drift apart. Two rules keep it out:

1. Routing, when the layer is called: a ``Dense`` layer is routed only when no other
   layer of the model holds its kernel or bias, or holds the layer itself (a tied head
   borrowing its kernel), and it has no kernel or bias regularizer (a loss term of its
   own weights). Those layers take the ordinary path from the start.
2. Proof, in the optimizer at every step (every pass with ``backward_passes_per_step``):
   a routed layer's received kernel and bias gradients count as averaged only if, on
   every rank, they are exactly ``c`` times what its custom gradient returned (the sum
   of its calls), with one scalar ``c`` that every rank agrees on (1, or a loss scale's
   ``1/s``). What the custom gradients return is bit-identical on every rank, so every
   rank then holds the same gradient, which is its own average. One small allgather
   per step (each layer's ``[exact, c]`` from every rank) makes the decision identical
   on every rank. Otherwise the layer's received gradient is reduced like any other
   (the optimizer's ``compression`` and ``op``), which is exact whatever the other uses
   were: the averaged part averages to itself, the rest is averaged. From then on that
   layer sends no factors (its custom gradient returns its local gradient), so a kernel
   used elsewhere at every step does not pay for both.

Code between ``tape.gradient`` and the optimizer sees the averaged gradients of the
layers that send factors. Every rank issues these exchanges in the same order: each is
a stateful ``tf.py_function`` without resource inputs, which ``tf.function``'s automatic
control dependencies run in program order (the order backward creates them), before
the optimizer's own buckets; eagerly, they run as backward reaches them.
"""

from __future__ import annotations

import collections
import threading
import types
from typing import Optional

import keras
import tensorflow as tf
import torch

from cgx import session
from cgx.exchange import GradientPlan, GradMode
from cgx.ops import group_size
from cgx.comm.base import ReduceOp
from cgx.session import reducer_of
from cgx.sufficient_factors import agree_scaled, gathered
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
            plain reductions.
        group: the process set's group (None: all ranks).
        label: names the ops and collectives, the same on every rank.

    Attributes:
        used: layer name -> whether its last exchange sent factors (False too once the
            proof found its gradient was not theirs alone).
    """

    def __init__(self, model, *, compression, op, predivide: float, rules, group,
                 update_rule, label: str):
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"sufficient_factors= takes the Keras model whose Dense layers "
                            f"should exchange factors, got {type(model).__name__}")
        self.model = model
        self.compression, self.op, self.predivide = compression, op, float(predivide)
        self.rules, self.group, self.update_rule = rules, group, update_rule
        self.label = label
        self.used: dict[str, bool] = {}
        self._plans: dict = {}  # (where, layer name) -> GradientPlan, see _plan
        self._buffers = WorkBuffers()  # per layer, the kernel gradient's memory
        self._lock = threading.Lock()
        self.layers = [layer for layer in _layers(model) if type(layer) is keras.layers.Dense]
        # Rule 1: ids of the layers another layer can reach (None: not all built yet).
        self._held_elsewhere: Optional[set] = None
        # Rule 2: what each routed layer's custom gradient returned since the optimizer
        # last looked (id(layer) -> [[kernel part, bias part] per call]); the names of
        # the layers whose gradient was not theirs alone (engine thread; the same on
        # every rank); with backward_passes_per_step, the proof of the passes so far.
        self._returned: dict = {}
        self._unproven: set = set()
        with tf.init_scope():
            self._proven = tf.Variable(tf.ones([len(self.layers)], tf.int32),
                                       trainable=False, name="cgx_factors_proven")
        for layer in self.layers:
            _patch(layer, self)

    def routes(self, layer) -> bool:
        """Rule 1: route this layer's product through the factor exchange?"""
        return (routable(layer) and layer.kernel_regularizer is None
                and layer.bias_regularizer is None and id(layer) not in self._reachable())

    def _reachable(self) -> set:
        """ids of the Dense layers whose weights another layer of the model can reach
        (computed again until every Dense layer is built: weights appear at build)."""
        if self._held_elsewhere is not None:
            return self._held_elsewhere
        held = _held_elsewhere(self.model, self.layers)
        if all(layer.built for layer in self.layers):
            self._held_elsewhere = held
        return held

    def set_compression(self, compression) -> None:
        """Reduce with ``compression`` from the next step on."""
        check_compression(compression)
        with self._lock:
            self.compression = compression
            self._plans.clear()

    # -- the exchange (engine thread) ------------------------------------------------------

    def exchange(self, name: str, x: torch.Tensor, dy: torch.Tensor, bias: bool) -> list:
        """Every rank, same order: ``[kernel grad (N x M), bias grad (M)]`` averaged over
        the ranks, from this rank's input ``x`` (K x N) and output gradient ``dy`` (K x M);
        this rank's own, for a layer whose gradient was not theirs alone (rule 2)."""
        red = reducer_of(self.group)
        tr = red.transport
        P = tr.size
        x = x.to(tr.device, torch.float32)
        dy = dy.to(tr.device, torch.float32)
        n, m = x.shape[1], dy.shape[1]
        alone = P > 1 and name not in self._unproven
        # One call's factors are always a faithful record of it.
        factors = gathered(tr, [(dy, x)], m, n, rows=x.shape[0], faithful=True,
                           average=True, record=red.add_stats, bias=bias) if alone else None
        self.used[name] = factors is not None
        if factors is not None:
            dy_all, x_all = factors
            return [torch.mm(x_all.t(), dy_all, out=self._kernel_buffer(name, n, m, tr))] + \
                ([dy_all.sum(0)] if bias else [])
        grads = [torch.mm(x.t(), dy, out=self._kernel_buffer(name, n, m, tr))] + \
            ([dy.sum(0)] if bias else [])
        if not alone:
            return grads
        return self._plan("backward", name, grads).reduce(
            grads, name=f"{self.label}.factors.{name}")

    def _kernel_buffer(self, name: str, n: int, m: int, transport) -> torch.Tensor:
        """Where the layer's kernel gradient is written: last step's buffer once TensorFlow
        let go of it (a new M x N tensor would pay its page faults every step)."""
        return self._buffers.empty(name, (n, m), torch.float32, transport.device)

    def _plan(self, where: str, name: str, grads: list) -> GradientPlan:
        """A plain reduction's plan for one layer (the optimizer's compression and rules):
        ``"backward"`` averages its local gradient when factors would be larger (always
        an average: see the module docstring), ``"received"`` reduces what the optimizer
        received (rule 2) with the optimizer's op. Each keeps its own state."""
        names = [f"{name}/kernel", f"{name}/bias"][:len(grads)]
        op = ReduceOp.AVERAGE if where == "backward" else self.op
        with self._lock:
            plan = self._plans.get((where, name))
            if plan is None:
                plan = self._plans[(where, name)] = GradientPlan(
                    names, [tuple(g.shape) for g in grads], self.compression, op=op,
                    predivide=self.predivide, rules=self.rules, group=self.group,
                    update_rule=self.update_rule)
                if plan.mode in (GradMode.AUTO, GradMode.PLANNED):
                    check_compression(self.compression)  # raises, saying what to change
            return plan

    def record(self, layer, parts: list) -> None:
        """Backward: what ``layer``'s custom gradient returned for one call (rule 2)."""
        self._returned.setdefault(id(layer), []).append(parts)

    # -- the proof (optimizer, every step) -------------------------------------------------

    def settle(self, grads: list, variables: list, proven=None) -> tuple[list, set]:
        """The routed layers' gradients as the optimizer should apply them, and the ids of
        their variables (the optimizer's own exchange leaves these alone).

        Args:
            grads, variables: what the optimizer received.
            proven: from :meth:`check` (per layer, 1: every rank holds exactly the rebuilt
                average times one ``c``); None: check ``grads`` now.

        Returns:
            ``grads`` with each routed layer's kernel and bias passed through where proven
            (times P under ``Sum``), reduced plainly otherwise (rule 2).
        """
        if proven is None:
            proven = self.check(grads, variables)
        slots = self._slots(grads, variables)
        P = group_size(self.group)
        if proven is None or P == 1 or not slots:
            return grads, set()
        out = list(grads)
        for index, layer, at in slots:
            pair = [tf.convert_to_tensor(grads[i]) for i in at]

            def passed(pair=pair):
                # Every rank holds the same gradient: its own average, P times it the sum.
                return pair if self.op is ReduceOp.AVERAGE else \
                    [g * tf.cast(P, g.dtype) for g in pair]

            def reduced(pair=pair, name=layer.name):
                return self._reduce_received(name, pair)

            settled = tf.cond(proven[index] > 0, passed, reduced)
            for i, g in zip(at, settled):
                out[i] = g
        return out, {id(variables[i]) for _, _, at in slots for i in at}

    def check(self, grads: list, variables: list) -> Optional[tf.Tensor]:
        """Per layer of ``self.layers`` (int32), the same on every rank: 1 unless the layer
        is routed and its received gradient is not exactly ``c`` times what its custom
        gradient returned, for one ``c`` on every rank (rule 2). One small allgather;
        None on one rank or when no routed layer has a gradient here."""
        returned, self._returned = self._returned, {}  # what is not used here is stale
        slots = self._slots(grads, variables)
        if group_size(self.group) == 1 or not slots:
            return None
        mine = tf.stack([_exactly_scaled([grads[i] for i in at], returned.get(id(layer)))
                         for _, layer, at in slots])
        names = [layer.name for _, layer, _ in slots]
        index = [i for i, _, _ in slots]

        def body(mine):
            out = session.run(self._agree, names, index, to_torch(mine),
                              label=f"{self.label}.factors")
            return [to_tf(out)]

        return run_collective(body, [mine], [tf.int32], [tf.TensorShape([len(self.layers)])],
                              f"{self.label}.factors.proof")[0]

    def note(self, grads: list, variables: list) -> None:
        """``backward_passes_per_step > 1``: fold one pass's :meth:`check` into the step's."""
        proof = self.check(grads, variables)
        if proof is not None:
            self._proven.assign(tf.minimum(self._proven, proof))

    def noted(self) -> tf.Tensor:
        """The passes' proof so far (:meth:`note`), then a fresh one for the next step."""
        proven = tf.identity(self._proven)
        with tf.control_dependencies([proven]):
            self._proven.assign(tf.ones_like(proven))
        return proven

    def _slots(self, grads: list, variables: list) -> list:
        """``(index in self.layers, layer, positions of its kernel and bias)`` of each
        routed layer whose kernel has a gradient here."""
        at = {id(v): i for i, v in enumerate(variables)}
        out = []
        for index, layer in enumerate(self.layers):
            ik = at.get(id(layer._kernel)) if self.routes(layer) else None
            if ik is None or grads[ik] is None:
                continue
            ib = at.get(id(layer.bias)) if layer.bias is not None else None
            out.append((index, layer, [ik] + ([ib] if ib is not None and
                                              grads[ib] is not None else [])))
        return out

    def _agree(self, names: list, index: list, mine: torch.Tensor) -> torch.Tensor:
        """Engine thread, every rank: every rank's ``[exact, c]`` per routed layer ->
        per layer of ``self.layers``, 1 where every rank is exact with the same ``c``."""
        exact = agree_scaled(reducer_of(self.group).transport, mine)
        out = torch.ones(len(self.layers), dtype=torch.int32)
        for name, i, good in zip(names, index, exact):
            if not good or name in self._unproven:
                out[i] = 0
                self._unproven.add(name)  # from the next call on: no factors
                self.used[name] = False
        return out

    def _reduce_received(self, name: str, pair: list) -> list:
        """Reduce a layer's received gradients the plain way (one collective)."""
        def body(*xs):
            out = session.run(self._reduce_plainly, name, [to_torch(x) for x in xs],
                              label=f"{self.label}.factors")
            return [to_tf(o) for o in out]

        outs = run_collective(body, pair, [tf.float32] * len(pair), [g.shape for g in pair],
                              f"{self.label}.received.{name}")
        return [tf.cast(o, g.dtype) for o, g in zip(outs, pair)]

    def _reduce_plainly(self, name: str, xs: list) -> list:
        """Engine thread: the plain reduction of one layer's received gradients."""
        dev = reducer_of(self.group).transport.device
        grads = [x.to(dev, torch.float32, copy=True) for x in xs]  # reduced in place
        return self._plan("received", name, grads).reduce(
            grads, name=f"{self.label}.received.{name}")


def _layers(model) -> list:
    """``model`` and every layer inside it (nested models too), once each."""
    return list(model._flatten_layers(include_self=True, recursive=True))


def _held_elsewhere(model, dense: list) -> set:
    """ids of the ``dense`` layers whose kernel or bias another layer of ``model`` can
    reach (rule 1): a weight held by two layers, or the layer held by two (a tied head
    keeps the layer whose kernel it borrows)."""
    holders = collections.Counter()
    for layer in _layers(model):
        children = list(layer._flatten_layers(include_self=False, recursive=False))
        inherited = {id(w) for child in children for w in child.weights}
        holders.update(id(child) for child in children)
        holders.update(id(w) for w in layer.weights if id(w) not in inherited)
    return {id(d) for d in dense
            if holders[id(d)] > 1 or any(holders[id(w)] > 1 for w in d.weights)}


def _usable(t) -> bool:
    """Can a tensor from backward be used here: an eager one eagerly, a graph one in its
    own graph or in a function nested in it (a ``tf.cond`` branch)?"""
    if tf.executing_eagerly():
        return not tf.is_symbolic_tensor(t)
    if not tf.is_symbolic_tensor(t):
        return False
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if graph is t.graph:
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _exactly_scaled(grads: list, returned: Optional[list]) -> tf.Tensor:
    """This rank's ``[exact, c]`` (float64) for one layer (rule 2): are its received
    ``grads`` (kernel, bias) exactly ``c`` times what its custom gradient ``returned``
    (per call, summed as the tape sums them), ``c`` read off the largest value? Costs one
    pass over the kernel gradient, unless the tape handed the returned tensor over as is."""
    if not returned or not all(_usable(t) for call in returned for t in call) or \
            any(len(call) != len(grads) for call in returned):
        return tf.constant([0.0, 1.0], tf.float64)  # not this step's, or not all of it
    if len(returned) == 1 and all(g is p for g, p in zip(grads, returned[0])):
        return tf.constant([1.0, 1.0], tf.float64)
    grads = [tf.convert_to_tensor(g) for g in grads]
    parts = [tf.add_n([tf.cast(t, g.dtype) for t in ts]) for g, ts in zip(grads, zip(*returned))]
    flat_g, flat_p = tf.reshape(grads[0], [-1]), tf.reshape(parts[0], [-1])
    j = tf.argmax(tf.abs(flat_p))
    c = tf.where(tf.equal(flat_p[j], 0), tf.ones([], flat_g.dtype), flat_g[j] / flat_p[j])
    exact = tf.reduce_all([tf.reduce_all(tf.equal(g, p * c)) for g, p in zip(grads, parts)])
    return tf.stack([tf.cast(exact, tf.float64), tf.cast(c, tf.float64)])


def _patch(layer, factors: FactorLayers) -> None:
    if getattr(layer, "_cgx_factors", None) is not None:
        raise ValueError(f"Dense layer {layer.name!r} is already routed through a "
                         "sufficient-factor exchange; pass the model to one optimizer only")
    layer._cgx_factors = factors
    own = layer.call

    def call(self, inputs, training=None):
        if isinstance(inputs, keras.KerasTensor) or not factors.routes(self):
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
            gb = tf.cast(outs[1], bias[0].dtype) if trains_bias else None
            factors.record(layer, [gk] + ([gb] if trains_bias else []))
            if not has_bias:
                return dx, gk
            return dx, gk, gb if trains_bias else tf.zeros_like(bias[0])

        return y, grad

    return product(x, kernel, *([bias] if has_bias else []))


def check_compression(compression) -> None:
    """The plain fallback reduces one layer at a time with a fixed compression: the
    per-layer planners (``"auto"``, ``planned()``) plan the whole model and cannot."""
    from cgx import runtime
    from cgx.config import CompressionMode, Config
    from cgx.policy import resolve as resolve_policy
    from cgx.tensorflow.ops import tf_side_compressor
    if tf_side_compressor(compression) is not None:
        raise ValueError("sufficient_factors= works with cgx's compressors (Compression.*), "
                         "not with a TensorFlow-side compressor object")
    cfg = runtime.config() if runtime.is_initialized() else Config()
    if cfg.compression is CompressionMode.DECIDE:  # here the default is fixed quantization
        cfg = cfg.replace(compression=CompressionMode.QUANTIZE)
    if resolve_policy(compression, cfg).chooses:
        raise ValueError("sufficient_factors= on the Keras optimizer takes a fixed "
                         "compression (quantize, fp16, exact, ...), not a per-model plan "
                         "(auto, planned): the plain fallback reduces one layer at a time. "
                         "Pass e.g. Compression.quantize(bits=4), or set CGX_COMPRESSION "
                         "to decide (the default: fixed quantization here) or quantize")
