"""Gradient exchange for TensorFlow: ``DistributedGradientTape`` and the shared exchange.

How gradients cross the frameworks::

    TF gradients --DLPack view, one copy--> torch work buffers
        --session.submit(GradientPlan.reduce)--> reduced in place on the engine thread
        --DLPack, no copy--> TF tensors

Inside a ``tf.function`` (``model.fit``, a compiled train step) the gradients are
cut into fusion buckets in the order backward produces them (the last layer's
first, ``CGX_FUSION_BUFFER_SIZE_MB``, a small first bucket), as the torch
optimizer does. Each bucket gets a ``tf.py_function`` that starts its exchange
and depends only on that bucket's gradients, so TensorFlow's executor runs it as
soon as they exist, while backward goes on; the starts are chained, so every rank
issues the buckets in the same order. One last op waits for all of them (the time
it waits is the exposed communication). Eagerly, backward is over before the
exchange is called: the gradients go in one call.

The :class:`~cgx.exchange.GradientPlan` decides per gradient, by
variable name and shape, whether it travels quantized (``CGX_*`` settings and
layer rules, as ``cgx.torch.DistributedOptimizer`` does) or exact; ``None``
gradients are left out (the variable set is the same on every rank: one
graph), and ``tf.IndexedSlices`` are made dense so they can be compressed.
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional, Sequence

import tensorflow as tf

from cgx import session
from cgx.policy.update_rule import UpdateRule
from cgx.compression import Compression, resolve
from cgx.tensorflow._bridge import WorkBuffers, run_collective, to_tf
from cgx import runtime
from cgx.exchange import ExchangeOptions, GradientPlan, unique_names
from cgx.exchange.buckets import compose_buckets
from cgx.exchange.options import names_by_id
from cgx.exchange.step import StepRecorder
from cgx.ops import Average, group_size
from cgx.process_sets import global_process_set
from cgx.tensorflow.ops import allreduce, resolve_process_set, tf_side_compressor

_labels = itertools.count()


def variable_name(v, fallback: Optional[str] = None) -> Optional[str]:
    """The name rules match: a Keras 3 variable's ``path`` ("dense/kernel"), else
    a tf.Variable's name without ":0"."""
    path = getattr(v, "path", None)
    if isinstance(path, str) and path:
        return path
    try:
        name = v.name
    except AttributeError:  # eager tensors have no name
        return fallback
    if isinstance(name, str) and name:
        return name[:-2] if name.endswith(":0") else name
    return fallback


def cgx_compression(compression):
    """``compression`` with its string spellings (``"auto"``) made the cgx compressor they
    name: a string has no ``compress`` of its own to run on the TF side."""
    return resolve(compression) if isinstance(compression, str) else compression


def variable_groups(num_groups, groups) -> tuple:
    """Horovod's ``num_groups``/``groups``: ``groups`` may be an int (the number of groups)
    or lists of variables; returns (num_groups, tuples of id(variable) or None)."""
    if groups is None:
        return num_groups, None
    if isinstance(groups, int):
        return groups, None
    return num_groups, tuple(tuple(id(v) for v in g) for g in groups)


class GradientExchange:
    """Reduces lists of TF gradients; one :class:`GradientPlan` per variable set.

    Args:
        compression: see :mod:`cgx.exchange.plan` (a Horovod-style TF
            compressor is applied on the TF side, its payloads reduced exactly).
        op: Average or Sum.
        gradient_predivide_factor: as in Horovod.
        rules: per-layer rules (``cgx.rules``).
        label: names the collective (timeline, stochastic-rounding key); the
            same on every rank.
        process_set: reduce over the ranks of this process set only.
        sparse_as_dense: False: ``tf.IndexedSlices`` gradients travel as Horovod's sparse
            allreduce (values and indices all-gathered, uncompressed) and stay
            IndexedSlices; True: they are made dense and reduced with the others.
        update_rule: the optimizer's :class:`cgx.policy.update_rule.UpdateRule`
            (``compression="auto"`` decides error feedback by it).
        num_groups: cut the gradients into this many fused buckets (Horovod's
            ``num_groups``; 0: by size in graph mode, one call when eager).
        group_ids: explicit buckets as lists of ``id(variable)`` (Horovod's ``groups``,
            through :func:`variable_groups`); other gradients form one more bucket.
    """

    def __init__(self, compression=Compression.none, op=Average,
                 gradient_predivide_factor: float = 1.0, rules=None,
                 label: Optional[str] = None, process_set=global_process_set,
                 sparse_as_dense: bool = False, update_rule: UpdateRule = UpdateRule.UNKNOWN,
                 num_groups: int = 0, group_ids=None):
        opts = ExchangeOptions.checked("gradient reduction", op=op,
                                       gradient_predivide_factor=gradient_predivide_factor,
                                       sparse_as_dense=sparse_as_dense, num_groups=num_groups)
        self.num_groups = opts.num_groups
        self.group_ids = group_ids
        compression = cgx_compression(compression)
        self._user = tf_side_compressor(compression)
        self.compression = Compression.exact if self._user is not None else compression
        self.op = opts.op
        self.predivide = opts.predivide
        self.rules = rules
        self.group = resolve_process_set(process_set)
        self.process_set = process_set
        self.sparse_as_dense = opts.sparse_as_dense
        self.update_rule = update_rule
        self.label = label or f"grads{next(_labels)}"
        self._plans: dict = {}
        self._lock = threading.Lock()
        # Buckets started and not yet collected: ticket -> (handle, work buffers kept alive).
        self._inflight: dict = {}
        self._tickets = itertools.count(1)
        self._step_of: dict = {}  # plan id -> the step its current exchange reduces
        # The gradients' torch copies, reused from step to step when TF let go of them.
        self._buffers = WorkBuffers()
        # compression="auto": plans restored from a checkpoint, applied when the
        # GradientPlan of the same layers is created (at the first exchange).
        self.pending_plans: list = []
        self._pending_states: dict = {}  # plan key -> state for a plan not made yet

    def plan(self, names: Sequence[str], shapes, dtypes) -> GradientPlan:
        key = (tuple(names), tuple(tuple(s) for s in shapes), tuple(dtypes))
        with self._lock:
            plan = self._plans.get(key)
            if plan is None:
                plan = self._new_plan(key)
                if key in self._pending_states:  # kept at a commit or synced before it existed
                    plan.load_state_dict(self._pending_states.pop(key))
                if plan.adaptive is not None:
                    from cgx.policy.levels.schedule import matches
                    for summary in self.pending_plans:
                        if matches(summary, plan.names):
                            plan.adaptive.load_plan_summary(summary)
                self._plans[key] = plan
            return plan

    def _new_plan(self, key) -> GradientPlan:
        names, shapes, _ = key
        return GradientPlan(list(names), [list(s) for s in shapes], self.compression,
                            op=self.op, predivide=self.predivide, rules=self.rules,
                            group=self.group, update_rule=self.update_rule)

    def plan_summaries(self) -> list:
        """compression="auto": each plan's :meth:`AdaptiveSchedule.plan_summary` (JSON-able)."""
        with self._lock:
            return [p.adaptive.plan_summary() for p in self._plans.values()
                    if p.adaptive is not None] or list(self.pending_plans)

    def request_replan(self, step: int) -> None:
        """compression="auto": plan again from the ``window`` steps starting at ``step``."""
        with self._lock:
            for p in self._plans.values():
                if p.adaptive is not None:
                    p.adaptive.replan_soon(step)

    # -- across a change of world (cgx.tensorflow.elastic) ------------------------------

    def state_dict(self) -> dict:
        """Every plan's state (residuals, levels, step), by its variables' names: this
        rank's own, kept in host memory at an elastic commit."""
        with self._lock:
            return {key: plan.state_dict() for key, plan in self._plans.items()}

    def load_state_dict(self, state: dict) -> None:
        """Put back :meth:`state_dict`'s plans (a plan not made yet gets it when made; a
        plan made since, which ``state`` does not hold, starts again as made)."""
        with self._lock:
            for key, plan in self._plans.items():
                if key not in state:  # the traced graph holds the plan: reset it in place
                    plan.load_state_dict(self._new_plan(key).state_dict())
            for key, plan_state in state.items():
                plan = self._plans.get(key)
                if plan is not None:
                    plan.load_state_dict(plan_state)
                else:
                    self._pending_states[key] = plan_state

    def discard_step(self) -> None:
        """Forget the buckets in flight: their collectives failed (a rank was lost)."""
        with self._lock:
            self._inflight.clear()
            self._step_of.clear()

    def world_changed(self, step: int) -> None:
        """The ranks changed: ``compression="auto"`` decides again from ``step``."""
        self.discard_step()
        with self._lock:
            for plan in self._plans.values():
                plan.world_changed(step)

    def owed_residual(self) -> float:
        """What this rank's error feedback still owes: the sum of |residual| over every
        tensor of every plan (0.0 without error feedback)."""
        with self._lock:
            owed = [p.residual(n) for p in self._plans.values() for n in p.names]
        return float(sum(float(r.abs().sum()) for r in owed if r is not None))

    def compression_plan(self) -> list[dict]:
        """Rows of the current per-layer plan (see ``GradientPlan.compression_plan``)."""
        with self._lock:
            return [row for plan in self._plans.values() for row in plan.compression_plan()]

    def exchange_trials(self) -> list[dict]:
        """``Compression.auto(objective="time")`` and ``Compression.planned()``: the rounds
        of trials of every plan (see :meth:`cgx.policy.trials.TrialDecider.rounds`)."""
        with self._lock:
            return [r for plan in self._plans.values() if plan.decider is not None
                    for r in plan.decider.rounds()]

    @tf.autograph.experimental.do_not_convert
    def __call__(self, grads: Sequence, variables: Sequence, names: Optional[Sequence] = None,
                 step=None, local=frozenset(), scale_local: bool = True,
                 reduced=frozenset()) -> list:
        """The reduced ``grads`` (None stays None), eagerly or as graph ops.

        Args:
            grads: one gradient (tensor, IndexedSlices or None) per variable.
            variables: the variables (or tensors) differentiated; give the shapes.
            names: one name per variable (default: :func:`variable_name`).
            step: optional int tensor, the stochastic-rounding step (an
                optimizer's ``iterations``, so that it survives checkpoints).
            local: ids of rank-local variables: their gradients are not reduced, only
                divided by the number of ranks if ``scale_local`` (Horovod's rule).
            reduced: ids of variables whose gradients are averaged already (the
                sufficient-factor exchange ran in backward): passed through as they are.
        """
        grads = list(grads)
        if len(grads) != len(variables):
            raise ValueError(f"got {len(grads)} gradients for {len(variables)} variables")
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        if replicas > 1:
            # Each replica would issue its own exchange, in an order no rank controls.
            raise ValueError(f"cgx exchanges gradients between processes, one model replica "
                             f"each; this tf.distribute strategy runs {replicas} replicas in "
                             "this process. Drop the strategy and start one process per device")
        if names is None:
            names = [variable_name(v) for v in variables]
        # not reduced here: rank-local, or averaged already
        kept = [i for i, v in enumerate(variables) if id(v) in local or id(v) in reduced]
        if kept:
            return self._with_kept(grads, variables, names, step, kept, local, scale_local)
        if group_size(self.group) == 1:  # Average and Sum over one rank change nothing
            return [g if g is None or not isinstance(g, tf.IndexedSlices) or
                    not self.sparse_as_dense else tf.convert_to_tensor(g) for g in grads]
        sparse = {i for i, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)} \
            if not self.sparse_as_dense else set()
        dense = [None if g is None or i in sparse else
                 tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                 for i, g in enumerate(grads)]
        out = self._reduce_dense(dense, variables, names, step)
        for i in sorted(sparse):  # after the dense exchange, in variable order
            out[i] = allreduce(grads[i], op=self.op, prescale_factor=1.0 / self.predivide,
                               postscale_factor=self.predivide,
                               name=f"{self.label}.sparse.{names[i] or i}",
                               process_set=self.process_set)
        return out

    def _with_kept(self, grads, variables, names, step, kept, local, scale_local) -> list:
        """The others reduced, the ``kept`` gradients as they are (rank-local ones divided
        by the number of ranks when ``scale_local``, Horovod's rule)."""
        rest = sorted(set(range(len(grads))) - set(kept))
        out = [None] * len(grads)
        outs = self([grads[i] for i in rest], [variables[i] for i in rest],
                    [names[i] for i in rest], step)
        for i, g in zip(rest, outs):
            out[i] = g
        size = group_size(self.group)
        for i in kept:
            g = grads[i]
            if g is not None and scale_local and size > 1 and id(variables[i]) in local:
                g = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape) \
                    if isinstance(g, tf.IndexedSlices) else g / size
            out[i] = g
        return out

    def _reduce_dense(self, dense, variables, names, step) -> list:
        keep = [i for i, g in enumerate(dense) if g is not None]
        if not keep:
            return dense
        if self._user is not None:
            pairs = {i: self._user.compress(dense[i]) for i in keep}
            payloads = list(dense)
            for i in keep:
                payloads[i] = pairs[i][0]
            reduced = self._exchange(payloads, variables, names, keep, step, use_var_shape=False)
            for i in keep:
                reduced[i] = self._user.decompress(reduced[i], pairs[i][1])
            return reduced
        return self._exchange(dense, variables, names, keep, step, use_var_shape=True)

    def _exchange(self, dense, variables, names, keep, step, use_var_shape) -> list:
        sub = [tf.convert_to_tensor(dense[i]) for i in keep]
        shapes = []
        for i, g in zip(keep, sub):
            shape = g.shape
            if not shape.is_fully_defined() and use_var_shape:
                shape = tf.TensorShape(getattr(variables[i], "shape", None))
            if not shape.is_fully_defined():
                raise ValueError(f"the gradient of {names[i] or f'source {i}'} has shape "
                                 f"{shape}; cgx reduces gradients of static shape")
            shapes.append(shape)
        plan = self.plan(unique_names([names[i] for i in keep], self.label),
                         [s.as_list() for s in shapes], [g.dtype.name for g in sub])
        reduced = self._overlapped(plan, sub, shapes, self._buckets(keep, variables, shapes),
                                   step)
        out = list(dense)
        for i, r in zip(keep, reduced):
            out[i] = r
        return out

    def _buckets(self, keep: list, variables: list, shapes: list) -> list[list[int]]:
        """The fused buckets of the gradients ``keep`` (positions in ``keep``): the user's
        groups, ``num_groups`` equal ones, or by size in ready order in graph mode; one
        call when eager (backward is over)."""
        user = None
        if self.group_ids is not None:
            at = {id(variables[i]): k for k, i in enumerate(keep)}
            user = [[at[v] for v in g if v in at] for g in self.group_ids]
        if tf.executing_eagerly() and user is None and not self.num_groups:
            return [list(range(len(keep)))]
        return compose_buckets([4 * s.num_elements() for s in shapes],
                               runtime.config().fusion_buffer_bytes, user_groups=user,
                               num_groups=self.num_groups)

    def _overlapped(self, plan: GradientPlan, sub: list, shapes: list, buckets: list,
                    step) -> list:
        """One start op per bucket (chained: the same order on every rank), one finish op."""
        label = self.label
        steps = [] if step is None else [tf.cast(step, tf.int64)]
        token = tf.zeros([], tf.int64)
        tickets = []
        for k, bucket in enumerate(buckets):
            def start(*xs, k=k, bucket=bucket):
                # xs: the bucket's gradients, the previous start's ticket (an input only to
                # order the starts), the step when the caller has one
                if k == 0:  # a new exchange: one step for all its buckets
                    st = int(xs[-1].numpy()) if step is not None else plan.step
                    self._step_of[id(plan)] = st
                else:
                    st = self._step_of[id(plan)]
                StepRecorder(plan, session.reducer()).ready(bucket, st, row=label)
                work = [self._buffers.copy((id(plan), i), x)
                        for i, x in zip(bucket, xs[:len(bucket)])]
                handle = session.submit(plan.reduce, work, name=f"{label}.bucket{k}", step=st,
                                        indices=bucket, label=label)
                ticket = next(self._tickets)
                with self._lock:
                    self._inflight[ticket] = (handle, work)
                return [tf.constant(ticket, tf.int64)]

            inputs = [sub[i] for i in bucket] + [token] + steps
            token = run_collective(start, inputs, [tf.int64], [tf.TensorShape([])],
                                   f"{label}.start{k}")[0]
            tickets.append(token)

        def finish(*ids):
            out: list = [None] * len(sub)
            # What the step waits for after its backward: the exposed communication.
            with StepRecorder(plan, session.reducer()).waiting():
                for ticket, bucket in zip(ids, buckets):
                    with self._lock:
                        handle, _ = self._inflight.pop(int(ticket.numpy()))
                    for i, o in zip(bucket, handle.wait(session.wait_timeout())):
                        out[i] = o
            if step is None:  # the plan's own step counter: one per exchange, as when eager
                plan.step = self._step_of[id(plan)] + 1
            return [to_tf(o) for o in out]

        return run_collective(finish, tickets, [g.dtype for g in sub], shapes, f"{label}.finish")


# Tapes are usually wrapped anew at every step (Horovod's idiom); the exchange
# (its plans, error-feedback residuals, compressor state, step counters) must
# outlive them, so tapes with equal settings share one. cgx compressors' reprs
# spell out every option, so a compressor built anew each step with the same
# options still finds the first one's state.
_exchanges: dict = {}
_exchanges_lock = threading.Lock()


def _shared_exchange(compression, op, predivide, rules, process_set=global_process_set,
                     sparse_as_dense: bool = False, num_groups: int = 0,
                     group_ids=None) -> GradientExchange:
    key = (repr(compression), op, float(predivide), repr(rules),
           getattr(process_set, "process_set_id", 0), bool(sparse_as_dense), num_groups,
           group_ids)
    with _exchanges_lock:
        ex = _exchanges.get(key)
        if ex is None:
            ex = GradientExchange(compression, op, predivide, rules,
                                  label=f"tape{len(_exchanges)}", process_set=process_set,
                                  sparse_as_dense=sparse_as_dense, num_groups=num_groups,
                                  group_ids=group_ids)
            _exchanges[key] = ex
        return ex


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns gradients averaged over all ranks.

    Same use as ``horovod.tensorflow.DistributedGradientTape``; everything
    but ``gradient`` is the wrapped tape's.

    Args:
        gradtape: a ``tf.GradientTape`` (recorded, or used as a context manager
            through this wrapper).
        compression: ``Compression.none`` (default: ``CGX_COMPRESSION`` decides; unset,
            the deciding exchange; ``quantize``: 4-bit per variable with ``CGX_*``
            defaults),
            ``Compression.exact``, ``fp16``, ``bf16``, ``quantize(...)``,
            ``topk(...)``, ``powersgd(...)``, or a Horovod-style TF compressor.
        sparse_as_dense: False (Horovod's default): ``tf.IndexedSlices`` gradients
            (embeddings) stay IndexedSlices, their values and indices all-gathered
            uncompressed; True: made dense and compressed with the others.
        op: ``Average`` (default) or ``Sum``.
        gradient_predivide_factor: with Average, divide by this before the sum
            and by ``size / factor`` after.
        num_groups, groups: fused buckets as in Horovod: ``num_groups`` equal groups, or
            ``groups`` lists of variables (the others form one more); by size otherwise.
        process_set: reduce over the ranks of this process set only.
        scale_local_gradients: divide the gradients of sources registered with
            :meth:`register_local_source` by the number of ranks (Horovod's default).
        named_variables: optional ``(name, variable)`` pairs (or a dict name ->
            variable) naming the sources for layer rules; by default a Keras
            variable's ``path`` or a tf.Variable's name.
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``).

    Example::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    """

    def __init__(self, gradtape, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False, op=Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                 process_set=global_process_set, scale_local_gradients: bool = True, *,
                 named_variables=None, rules=None):
        if isinstance(gradtape, DistributedGradientTape):
            raise ValueError("this tape is already a DistributedGradientTape; wrap it once")
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"gradtape must be a tf.GradientTape, got {type(gradtape).__name__}")
        resolve_process_set(process_set)  # raises now if this rank may not use it
        num_groups, group_ids = variable_groups(num_groups, groups)
        ExchangeOptions.checked("DistributedGradientTape", op=op,
                                gradient_predivide_factor=gradient_predivide_factor,
                                num_groups=num_groups, process_set=process_set, rules=rules)
        self._tape = gradtape
        self._names = names_by_id(named_variables, "named_variables")
        self._exchange = _shared_exchange(compression, op, gradient_predivide_factor, rules,
                                          process_set, sparse_as_dense, num_groups, group_ids)
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.scale_local_gradients = bool(scale_local_gradients)
        self._local_sources: set = set()  # ids of rank-local sources

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient on this rank (model-parallel layers): not reduced, only
        divided by the number of ranks when ``scale_local_gradients`` (Horovod's rule)."""
        self._local_sources.add(id(source))

    def get_local_and_global_gradients(self, target, sources, output_gradients=None,
                                       use_generic_names=False):
        """``gradient()``, split into ([(local source, grad)], [(global source, grad)])."""
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        pairs = list(zip(sources, grads))
        return ([(s, g) for s, g in pairs if id(s) in self._local_sources],
                [(s, g) for s, g in pairs if id(s) not in self._local_sources])

    @property
    def tape(self) -> tf.GradientTape:
        """The wrapped ``tf.GradientTape``."""
        return self._tape

    @tf.autograph.experimental.do_not_convert
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE, use_generic_names=False):
        """``tape.gradient(...)``, then averaged (or summed) over all ranks."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients,
                                    unconnected_gradients=unconnected_gradients)
        flat_sources = tf.nest.flatten(sources, expand_composites=False)
        flat_grads = tf.nest.flatten(grads, expand_composites=False)
        names = [self._names.get(id(s)) or variable_name(s) for s in flat_sources]
        reduced = self._exchange(flat_grads, flat_sources, names, local=self._local_sources,
                                 scale_local=self.scale_local_gradients)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        # Only reached for names this class does not define: watch, reset, jacobian, ...
        if name == "_tape":
            raise AttributeError(name)
        return getattr(self._tape, name)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",
                                   compression=Compression.none, sparse_as_dense=False,
                                   op=Average, gradient_predivide_factor=1.0, num_groups=0,
                                   groups=None, process_set=global_process_set,
                                   local_layers=None, scale_local_gradients=True):
    """A :class:`DistributedGradientTape` that leaves the gradients of ``local_layers``
    (Keras layers whose weights differ per rank, e.g. model-parallel parts) on this rank.

    Example::

        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[expert])
    """
    import keras
    if local_layers is None:
        local_layers = []
    elif isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    elif not all(isinstance(layer, keras.layers.Layer) for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape
