"""Keras mixed precision with cgx: a loss-scale optimizer whose overflow check spans all ranks.

Keras's ``LossScaleOptimizer`` skips a step when *its rank's* gradients are not
finite. Around a ``DistributedOptimizer`` that is a hang: the rank that saw an
overflow skips the gradient exchange, the others wait in it. This subclass
takes the check over every rank (one 4-byte MIN allreduce per step), so that
all ranks skip the same steps and lower the scale together, as the single-process
recipe does. ``cgx.tensorflow.keras.DistributedOptimizer`` uses it on its own
under a ``mixed_float16`` policy, or when handed a Keras ``LossScaleOptimizer``;
a Keras ``LossScaleOptimizer`` put around a ``DistributedOptimizer`` gets the same
global check once :func:`install_global_overflow_check` ran (``import
cgx.tensorflow.keras`` calls it; ``check_finite`` is extended for optimizers that wrap
a cgx one, recognized by the class attribute ``cgx.tensorflow.variables.MARKER``, and
only them).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from cgx.ops import Min
from cgx.tensorflow.variables import MARKER, distributed_inside  # noqa: F401 - re-exported


_keras_check_finite = keras.optimizers.LossScaleOptimizer.check_finite


def _check_finite_everywhere(self, grads):
    """Keras's check, agreed over all ranks when the optimizer inside is a cgx
    ``DistributedOptimizer`` (else Keras's own, untouched)."""
    local = _keras_check_finite(self, grads)
    if distributed_inside(self.inner_optimizer) is None:
        return local
    from cgx.tensorflow.ops import allreduce
    # One tiny exact collective: every rank takes the same branch of the step.
    everywhere = allreduce(tf.cast(local, tf.int32), op=Min, name="loss_scale.finite")
    return tf.cast(everywhere, tf.bool)


def install_global_overflow_check() -> None:
    """Give Keras's own ``LossScaleOptimizer`` the check over all ranks, for the optimizers
    that wrap a cgx one (others keep Keras's check). Called by ``cgx.tensorflow.keras``.

    A user who writes ``keras.optimizers.LossScaleOptimizer(hvd.DistributedOptimizer(opt))``
    (Horovod's documented order) then gets the global check too: without it, that is the
    hang described above.
    """
    keras.optimizers.LossScaleOptimizer.check_finite = _check_finite_everywhere


@keras.saving.register_keras_serializable(package="cgx")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """``keras.optimizers.LossScaleOptimizer`` with a global overflow check (same arguments)."""
