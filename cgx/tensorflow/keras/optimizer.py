"""``DistributedOptimizer`` for Keras 3 (TensorFlow backend).

A real ``keras.optimizers.Optimizer`` subclass that wraps another optimizer,
the way ``keras.optimizers.LossScaleOptimizer`` does: the wrapped optimizer
keeps its variables, learning rate, iterations and update rule; this class
only averages the gradients over all ranks before handing them on. Keras
calls ``apply_gradients`` -> :meth:`DistributedOptimizer.apply` inside its
compiled train step, so the gradient exchange becomes one op of that
``tf.function`` (see ``cgx.tensorflow.gradients``).

With ``backward_passes_per_step=N`` the gradients of N batches are summed
locally into accumulator variables (part of this optimizer's state, so they
are checkpointed and broadcast with it) and exchanged once, on every N-th
batch; the wrapped optimizer's ``iterations`` still counts every batch, as
with Horovod.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.utils import tracking  # LossScaleOptimizer's tool: build() adds no attributes

from cgx.policy.update_rule import update_rule_of
from cgx.comm.base import ReduceOp
from cgx.compression import Compression, fixed
from cgx.exchange import ExchangeOptions, check_wrapped_once
from cgx.tensorflow.gradients import GradientExchange, cgx_compression, variable_groups
from cgx.tensorflow.keras._serialization import compression_from_config, compression_to_config
from cgx.ops import Average
from cgx.tensorflow.ops import resolve_process_set
from cgx.process_sets import global_process_set
from cgx.runtime import config_in_use
from cgx.tensorflow.ops import tf_side_compressor
from cgx.tensorflow.keras.wrapped import DelegatesToInner


@keras.saving.register_keras_serializable(package="cgx")
class DistributedOptimizer(DelegatesToInner, keras.optimizers.Optimizer):
    """Wraps a Keras optimizer so that it applies gradients averaged over all ranks.

    Same arguments as ``horovod.tensorflow.keras.DistributedOptimizer``.

    Args:
        optimizer: a Keras 3 optimizer (reachable as ``.inner_optimizer``;
            its hyperparameters are read through this wrapper too).
        name: default ``"Distributed" + the wrapped class name``.
        compression: ``Compression.none`` (default: ``CGX_COMPRESSION`` decides; unset,
            the deciding exchange; ``quantize``: 4-bit per variable with ``CGX_*``
            defaults; layer rules on variable paths such as
            ``"sequential/dense/kernel"``),
            ``Compression.exact``, ``fp16``, ``bf16``, ``quantize(...)``,
            ``topk(...)``, ``powersgd(...)``, or a Horovod-style TF compressor.
        sparse_as_dense: False (Horovod's default): ``tf.IndexedSlices`` gradients stay
            sparse (values and indices all-gathered, uncompressed); True: made dense
            and compressed with the others. With ``backward_passes_per_step > 1``
            they are always made dense (accumulated in dense variables).
        gradient_predivide_factor: with Average, divide by this before the sum
            and by ``size / factor`` after.
        op: ``Average`` (default) or ``Sum``.
        backward_passes_per_step: batches whose gradients are summed locally
            before one exchange and one update.
        average_aggregated_gradients: divide those summed gradients by
            ``backward_passes_per_step``.
        num_groups, groups: fused buckets as in Horovod: ``num_groups`` equal groups, or
            ``groups`` lists of variables (the others form one more); by size otherwise.
        scale_local_gradients: divide the gradients of variables registered with
            :meth:`register_local_var` by the number of ranks (Horovod's default).
        rules: per-layer rules (dict, list or YAML path, see ``cgx.rules``).
        sufficient_factors: the model, to exchange the gradients of its ``Dense`` layers
            as sufficient factors (Poseidon) whenever that moves fewer bytes:
            ``K x P x (M + N) < M x N`` for K rows per rank, P ranks and an N x M kernel.
            Each layer's product gets a custom gradient that all-gathers every rank's
            inputs and output gradients during backward and rebuilds the exact averaged
            kernel and bias gradients; otherwise it reduces the layer with
            ``compression`` (a fixed one: not ``"auto"`` or ``planned()``; the default
            under ``CGX_COMPRESSION=decide`` is then the uniform ``CGX_COMPRESSION_*``
            quantization, for these layers and the optimizer's other ones). A kernel
            also used outside its layer (tied, read by another layer or loss term) is
            reduced as usual, decided alike on every rank. See
            ``cgx.tensorflow.keras.sufficient_factors``.

    Example::

        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    """

    cgx_exchanges_gradients = True  # variables.MARKER: how cgx finds it inside wrappers

    def __new__(cls, optimizer=None, *args, **kwargs):
        # Mixed precision: Keras would wrap this optimizer in its own LossScaleOptimizer,
        # whose per-rank overflow check makes one rank skip the exchange the others wait
        # in. Return cgx's LossScaleOptimizer around a DistributedOptimizer instead.
        from cgx.tensorflow.keras.loss_scale import LossScaleOptimizer
        if cls is DistributedOptimizer and not kwargs.pop("_no_loss_scale", False):
            if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
                inner = DistributedOptimizer(optimizer.inner_optimizer, *args,
                                             _no_loss_scale=True, **kwargs)
                return LossScaleOptimizer(inner, initial_scale=float(
                    optimizer.dynamic_scale.numpy()),
                    dynamic_growth_steps=optimizer.dynamic_growth_steps)
            if keras.config.dtype_policy().name == "mixed_float16" and \
                    isinstance(optimizer, keras.optimizers.Optimizer):
                return LossScaleOptimizer(DistributedOptimizer(optimizer, *args,
                                                               _no_loss_scale=True, **kwargs))
        return super().__new__(cls)

    def __init__(self, optimizer, name=None, device_dense: str = "", device_sparse: str = "",
                 compression=Compression.none, sparse_as_dense: bool = False,
                 gradient_predivide_factor: float = 1.0, op=Average,
                 backward_passes_per_step: int = 1, average_aggregated_gradients: bool = False,
                 num_groups: int = 0, groups=None, process_set=global_process_set,
                 scale_local_gradients: bool = True, *, rules=None, sufficient_factors=None,
                 _no_loss_scale: bool = False):
        check_wrapped_once(optimizer, DistributedOptimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise TypeError(f"optimizer must be a Keras 3 optimizer (keras.optimizers.*), got "
                            f"{type(optimizer).__module__}.{type(optimizer).__name__}; tf_keras "
                            "(legacy Keras 2) optimizers are not supported")
        resolve_process_set(process_set)  # raises now if this rank may not use it
        opts = ExchangeOptions.checked(
            "DistributedOptimizer", op=op, gradient_predivide_factor=gradient_predivide_factor,
            backward_passes_per_step=backward_passes_per_step, sparse_as_dense=sparse_as_dense,
            num_groups=variable_groups(num_groups, groups)[0], process_set=process_set,
            rules=rules)
        if not isinstance(average_aggregated_gradients, bool):
            raise TypeError(f"average_aggregated_gradients must be True or False, got "
                            f"{average_aggregated_gradients!r}")
        compression = cgx_compression(compression)  # "auto": saved in the config as such
        tf_side_compressor(compression)  # TypeError for what cannot be a compressor
        super().__init__(learning_rate=0.0,
                         name=name or f"Distributed{type(optimizer).__name__}")
        self._compression = compression
        self._sparse_as_dense = opts.sparse_as_dense
        self._predivide = opts.predivide
        self._op = opts.op
        self._passes_per_step = opts.backward_passes_per_step
        self._average_aggregated = average_aggregated_gradients
        # Plain copies: Keras's attribute tracking wraps containers assigned to it.
        self._rules = _plain(rules)
        self._process_set = process_set
        self._scale_local = bool(scale_local_gradients)
        self._local_vars: set = set()  # ids of variables registered as rank-local
        # Ids only: Keras would track variables held in lists assigned to it.
        self._num_groups, self._group_ids = variable_groups(num_groups, groups)
        if sufficient_factors is not None:  # one layer at a time: no whole-model plan
            compression = fixed(compression, config_in_use())
        self._exchange = self._new_exchange(compression, update_rule_of(optimizer))
        self._factors = None
        if sufficient_factors is not None:
            from cgx.tensorflow.keras.sufficient_factors import FactorLayers, check_compression
            check_compression(compression)
            self._factors = FactorLayers(sufficient_factors, compression=compression, op=op,
                                         predivide=gradient_predivide_factor,
                                         rules=_plain(rules),
                                         group=resolve_process_set(process_set),
                                         update_rule=update_rule_of(optimizer),
                                         label=self.name)
        # Set last: attribute reads fall through to the wrapped optimizer from here on.
        self.inner_optimizer = optimizer

    # -- building and applying ----------------------------------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        super().build(var_list)
        if self._passes_per_step > 1:
            self._accumulators = [self.add_variable_from_reference(v, name="cgx_accumulator")
                                  for v in var_list]
            self._pending = self.add_variable(shape=(), dtype="int", name="cgx_pending_passes")

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None):
        """Average ``grads`` over all ranks (or accumulate them), then apply them."""
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError("apply() without variables needs a built optimizer; call "
                                 "optimizer.build(model.trainable_variables) first")
            trainable_variables = self._trainable_variables
        else:
            trainable_variables = list(trainable_variables)
            if not self.built:
                with keras.name_scope(self.name, caller=self):
                    self.build(trainable_variables)
                self.built = True
        if len(grads) != len(trainable_variables):
            raise ValueError(f"got {len(grads)} gradients for {len(trainable_variables)} "
                             "variables")
        if self._passes_per_step == 1:
            self.inner_optimizer.apply(self._reduce(grads, trainable_variables),
                                       trainable_variables)
        else:
            self._accumulate(grads, trainable_variables)

    def _reduce(self, grads, variables, proven=None):
        settled = ()
        if self._factors is not None:  # the Dense layers that sent factors (or tried to)
            grads, settled = self._factors.settle(grads, variables, proven)
        return self._exchange(grads, variables, step=self.inner_optimizer.iterations,
                              local=self._local_vars, scale_local=self._scale_local,
                              reduced=settled)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank (model-parallel layers): it is not reduced,
        only divided by the number of ranks when ``scale_local_gradients`` (Horovod's)."""
        self._local_vars.add(id(var))

    def _accumulate(self, grads, variables):
        accs = [self._accumulators[self._get_variable_index(v)] for v in variables]
        present = [g is not None for g in grads]
        if self._factors is not None:  # is each pass's factor gradient the average?
            self._factors.note(grads, variables)
        for g, acc in zip(grads, accs):
            if g is not None:
                acc.assign_add(tf.cast(tf.convert_to_tensor(g), acc.dtype))
        self._pending.assign_add(1)
        scale = 1.0 / self._passes_per_step if self._average_aggregated else 1.0

        def exchange_and_apply():
            agg = [tf.convert_to_tensor(a) * tf.cast(scale, a.dtype) if p else None
                   for a, p in zip(accs, present)]
            proven = self._factors.noted() if self._factors is not None else None
            self.inner_optimizer.apply(self._reduce(agg, variables, proven), variables)
            for a, p in zip(accs, present):
                if p:
                    a.assign(tf.zeros(a.shape, a.dtype))
            self._pending.assign(0)

        def count_only():
            # Horovod's convention: iterations count every batch, applied or not.
            self.inner_optimizer._iterations.assign_add(1)

        # The same branch on every rank: the counter advances identically everywhere.
        tf.cond(tf.convert_to_tensor(self._pending) >= self._passes_per_step, exchange_and_apply,
                count_only)

    def _dense_sparse(self) -> bool:
        return self._sparse_as_dense or self._passes_per_step > 1

    def compression_plan(self) -> list[dict]:
        """Per variable: layer, shape, family, level, bytes, error and share of the error
        budget of the current plan (``compression="auto"``; see ``cgx.policy.levels.format_levels``)."""
        return self._exchange.compression_plan()

    def exchange_trials(self) -> list[dict]:
        """``Compression.auto(objective="time")`` and ``Compression.planned()``: every round
        of trials so far (the plans tried, their measured and predicted step, bytes and
        error, the plan kept)."""
        return self._exchange.exchange_trials()

    def replan(self) -> None:
        """``compression="auto"``: make a new plan from the next ``window`` steps (call it on
        every rank at the same step, e.g. from ``callbacks.AdaptivePlanCallback``)."""
        self._exchange.request_replan(int(self.inner_optimizer.iterations.numpy()))

    def sufficient_factors_used(self) -> dict:
        """``sufficient_factors=``: Dense layer name -> whether its last exchange sent
        factors (False: reduced plainly, the factors being larger)."""
        return dict(self._factors.used) if self._factors is not None else {}

    def set_compression(self, compression) -> None:
        """Use ``compression`` from the next step on (e.g. after loading a saved model)."""
        compression = cgx_compression(compression)
        tf_side_compressor(compression)
        self._compression = compression
        if self._factors is not None:
            compression = fixed(compression, config_in_use())
            self._factors.set_compression(compression)
        self._exchange = self._new_exchange(compression, update_rule_of(self.inner_optimizer))

    # -- elastic training (cgx.tensorflow.elastic) -------------------------------------

    def exchange_state(self) -> dict:
        """This rank's own exchange state (error-feedback residuals, the plan's levels and
        steps), to keep at an elastic commit: it is not a Keras variable."""
        return self._exchange.state_dict()

    def load_exchange_state(self, state: dict) -> None:
        self._exchange.load_state_dict(state)

    def discard_step(self) -> None:
        """Forget the step in flight (its collectives failed: a rank was lost)."""
        self._exchange.discard_step()

    def world_changed(self) -> None:
        """The job's world changed: ``compression="auto"`` measures and decides again (a
        different number of ranks is a different link); residuals carry over."""
        self._exchange.world_changed(int(self.inner_optimizer.iterations.numpy()))

    def owed_residual(self) -> float:
        """What this rank's error feedback still owes: the sum of |residual| (0.0 without
        error feedback)."""
        return self._exchange.owed_residual()

    def _new_exchange(self, compression, update_rule) -> GradientExchange:
        return GradientExchange(compression, self._op, self._predivide, self._rules,
                                label=self.name, process_set=self._process_set,
                                sparse_as_dense=self._dense_sparse(), update_rule=update_rule,
                                num_groups=self._num_groups, group_ids=self._group_ids)

    # -- serialization ----------------------------------------------------------------

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "compression": compression_to_config(self._compression),
            "sparse_as_dense": self._sparse_as_dense,
            "gradient_predivide_factor": self._predivide,
            "op": self._op.value,
            "backward_passes_per_step": self._passes_per_step,
            "average_aggregated_gradients": self._average_aggregated,
            "num_groups": self._num_groups,
            "rules": self._rules if isinstance(self._rules, (str, type(None))) else
            _plain(self._rules),
            # compression="auto": the current per-layer plan, so that a model saved and
            # loaded again continues with it (load_model, ModelCheckpoint).
            "adaptive_plans": self._exchange.plan_summaries(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(config.pop("optimizer"),
                                                      custom_objects=custom_objects)
        config["compression"] = compression_from_config(config.get("compression"))
        config["op"] = ReduceOp(config.get("op", "average"))
        plans = config.pop("adaptive_plans", None) or []
        opt = cls(inner, _no_loss_scale=True, **config)
        opt._exchange.pending_plans = list(plans)
        return opt

    def __repr__(self) -> str:
        return (f"DistributedOptimizer({type(self.inner_optimizer).__name__}, "
                f"compression={self._compression!r}, op={self._op.value}, "
                f"backward_passes_per_step={self._passes_per_step})")


def _plain(rules):
    """Rules as plain lists/dicts (Keras may hand back tracked containers)."""
    if isinstance(rules, dict):
        return {k: _plain(v) for k, v in rules.items()}
    if isinstance(rules, (list, tuple)):
        return [_plain(v) for v in rules]
    return rules
