"""``Compression`` for ``horovod.tensorflow`` users: the cast compressors also take TF tensors.

Horovod's TensorFlow compressors work on TF tensors
(``payload, ctx = hvd.Compression.fp16.compress(t)`` in a custom loop or a
user compressor). cgx's core compressors work on torch tensors; these thin
subclasses add the TF case (a ``tf.cast``, in eager mode and in graphs) and
hand everything else to the core. Passed as ``compression=`` they behave
exactly like the core ones.
"""

from __future__ import annotations

import tensorflow as tf

from cgx import compression as core
from cgx.compression.base import default_instance_method


def _is_tf(x) -> bool:
    return isinstance(x, (tf.Tensor, tf.Variable))


class _TFCast:
    """TF-tensor ``compress``/``decompress`` for a cast compressor (mixed in first)."""

    tf_wire_dtype = None  # tf.float16 / tf.bfloat16; None: no cast

    @default_instance_method
    def compress(self, tensor, name=None):
        """``(tensor cast to the wire type, ctx)``; for TF tensors too, as Horovod's."""
        if not _is_tf(tensor):
            return super().compress(tensor, name)
        x = tf.convert_to_tensor(tensor)
        if self.tf_wire_dtype is None or not x.dtype.is_floating:
            return x, x.dtype
        factor = self.predivide or 1.0
        if factor != 1.0:
            return tf.cast(tf.cast(x, tf.float32) / factor, self.tf_wire_dtype), (x.dtype, factor)
        return tf.cast(x, self.tf_wire_dtype), x.dtype

    @default_instance_method
    def decompress(self, payload, ctx):
        """Back to the original dtype (times the predivide factor)."""
        if not _is_tf(payload):
            return super().decompress(payload, ctx)
        dtype, factor = ctx if isinstance(ctx, tuple) else (ctx, 1.0)
        if factor != 1.0:
            return tf.cast(tf.cast(payload, tf.float32) * factor, dtype)
        return tf.cast(payload, dtype)


class NoneCompressor(_TFCast, core.NoneCompressor):
    """Horovod's ``Compression.none``; TF tensors pass through."""


class ExactCompressor(_TFCast, core.ExactCompressor):
    """``Compression.exact``; TF tensors pass through."""


class FP16Compressor(_TFCast, core.FP16Compressor):
    """Horovod's ``Compression.fp16``; TF tensors are cast with ``tf.cast``."""

    tf_wire_dtype = tf.float16


class BF16Compressor(_TFCast, core.BF16Compressor):
    """``Compression.bf16``; TF tensors are cast with ``tf.cast``."""

    tf_wire_dtype = tf.bfloat16


class Compression(core.Compression):
    """``horovod.tensorflow.Compression``: ``none``, ``fp16`` (and cgx's ``exact``, ``bf16``,
    ``quantize``, ``topk``, ``powersgd``, ``auto``). ``quantize(..., rotate=True)`` is the
    core's rotated quantizer: the Keras exchange reduces with the same specs."""

    none = NoneCompressor
    exact = ExactCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor
