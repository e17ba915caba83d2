"""Keras mixed precision with cgx: a loss-scale optimizer whose overflow check spans all ranks.

Keras's ``LossScaleOptimizer`` skips a step when *its rank's* gradients are not
finite. Around a ``DistributedOptimizer`` that is a hang: the rank that saw an
overflow skips the gradient exchange, the others wait in it. This subclass
takes the check over every rank (one 4-byte MIN allreduce per step), so that
all ranks skip the same steps and lower the scale together, as the single-process
recipe does. ``cgx.tensorflow.keras.DistributedOptimizer`` uses it on its own
under a ``mixed_float16`` policy, or when handed a Keras ``LossScaleOptimizer``.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from cgx.collectives.functional import Min


@keras.saving.register_keras_serializable(package="cgx")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """``keras.optimizers.LossScaleOptimizer`` with a global overflow check (same arguments)."""

    def check_finite(self, grads):
        from cgx.tensorflow.ops import allreduce
        local = super().check_finite(grads)
        # One tiny exact collective: every rank takes the same branch of the step.
        everywhere = allreduce(tf.cast(local, tf.int32), op=Min, name="loss_scale.finite")
        return tf.cast(everywhere, tf.bool)
