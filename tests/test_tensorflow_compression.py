"""horovod.tensorflow's Compression on TF tensors (eager and in graphs), and Keras configs."""

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)
import tensorflow as tf  # noqa: E402

import cgx.tensorflow as hvd  # noqa: E402


@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("name,wire", [("fp16", tf.float16), ("bf16", tf.bfloat16),
                                       ("none", tf.float32), ("exact", tf.float32)])
def test_cast_compressors_take_tf_tensors(name, wire, graph):
    comp = getattr(hvd.Compression, name)
    x = tf.constant([1.5, -2.25, 3.0e4], tf.float32)

    def roundtrip(t):
        payload, ctx = comp.compress(t)  # on the class, as Horovod scripts do
        return payload, comp.decompress(payload, ctx)

    payload, back = (tf.function(roundtrip) if graph else roundtrip)(x)
    assert payload.dtype == wire
    assert back.dtype == tf.float32
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=1e-2)
    ints = tf.constant([1, 2], tf.int32)  # non-float tensors pass through, as in Horovod
    p, c = comp.compress(ints)
    assert p.dtype == tf.int32 and comp.decompress(p, c).dtype == tf.int32


def test_predivide_and_torch_tensors_still_work():
    import torch
    comp = hvd.Compression.fp16(predivide=4.0)
    p, c = comp.compress(tf.constant([8.0, 4.0]))
    np.testing.assert_allclose(p.numpy(), [2.0, 1.0])
    np.testing.assert_allclose(comp.decompress(p, c).numpy(), [8.0, 4.0])
    tp, tc = hvd.Compression.fp16.compress(torch.tensor([1.0, 2.0]))
    assert tp.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(tp, tc).dtype == torch.float32


def test_keras_configs_round_trip_tf_compressors_and_auto():
    from cgx.tensorflow.keras._serialization import compression_from_config, compression_to_config
    for comp in (hvd.Compression.fp16, hvd.Compression.exact, hvd.Compression.bf16(predivide=2.0),
                 hvd.Compression.auto(alpha=1.5, window=3, adjust_every=9)):
        cfg = compression_to_config(comp)
        assert cfg is not None
        back = compression_from_config(cfg)
        assert compression_to_config(back) == cfg
