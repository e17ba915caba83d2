"""Train an MLP on scikit-learn's digits with Keras 3, written exactly like a Horovod script.

Only the import differs from Horovod (`import cgx.tensorflow.keras as hvd`).
Launch with any launcher:

    cgxrun -np 2 python examples/keras_digits.py
    torchrun --nproc-per-node 2 examples/keras_digits.py
    mpirun -np 2 python examples/keras_digits.py
    horovodrun -np 2 python examples/keras_digits.py

By default cgx decides how gradients travel (the deciding exchange: trials keep the
fastest measured plan within 4-bit's error budget); change that with the CGX_*
variables (e.g. CGX_COMPRESSION=quantize for fixed 4-bit: layers of at least 1024
values, biases exact) or --compression.
"""

import argparse
import dataclasses
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: fewer banners

import cgx.tensorflow.keras as hvd  # noqa: E402  (loads TensorFlow)
import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32  # per rank: the global batch is batch_size * hvd.size()
    lr: float = 0.02  # per rank; scaled by hvd.size() below, as Horovod recommends
    warmup_epochs: int = 2  # ramp the scaled lr up from lr over these epochs
    hidden: int = 256
    compression: str = "env"  # env (CGX_* variables), fp16, exact, topk, powersgd
    checkpoint: str = ""  # a .keras path: rank 0 keeps the best model there
    seed: int = 42


def parse() -> TrainConfig:
    cfg = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(cfg):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    return TrainConfig(**vars(p.parse_args()))


def main():
    cfg = parse()
    hvd.init()
    keras.utils.set_random_seed(cfg.seed + hvd.rank())  # rank 0's weights win below

    # Data: every rank loads the set (tiny) and keeps its shard.
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    test_x, test_y = x[:300], y[:300]
    x, y = x[300:][hvd.rank()::hvd.size()], y[300:][hvd.rank()::hvd.size()]

    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(cfg.hidden, activation="relu"),
                              keras.layers.Dense(10)])
    compression = {"env": hvd.Compression.none, "fp16": hvd.Compression.fp16,
                   "exact": hvd.Compression.exact, "topk": hvd.Compression.topk(0.05),
                   "powersgd": hvd.Compression.powersgd(rank=4)}[cfg.compression]
    opt = keras.optimizers.SGD(cfg.lr * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, compression=compression)
    # The gradient exchange runs as a Python op inside Keras' train step: XLA
    # cannot compile it (Keras picks XLA by itself on GPUs with jit_compile="auto").
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)

    callbacks = [
        # Start every rank from rank 0's weights and optimizer state.
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Average epoch metrics over ranks, before anything reads them.
        hvd.callbacks.MetricAverageCallback(),
        # Large-batch training: ramp the lr up from cfg.lr to cfg.lr * size.
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=cfg.lr * hvd.size(),
                                                 warmup_epochs=cfg.warmup_epochs,
                                                 verbose=1),
    ]
    if cfg.checkpoint:
        callbacks.append(hvd.callbacks.BestModelCheckpoint(monitor="val_loss",
                                                           filepath=cfg.checkpoint))
    model.fit(x, y, batch_size=cfg.batch_size, epochs=cfg.epochs, callbacks=callbacks,
              validation_data=(test_x, test_y), verbose=2 if hvd.rank() == 0 else 0)

    # Every rank holds the same weights; the evaluation is local (no collective).
    _, acc = model.evaluate(test_x, test_y, verbose=0)
    if hvd.rank() == 0:
        stats = hvd.stats()
        print(f"test accuracy {100 * acc:.1f}%  |  sent {stats.wire_bytes / 1e6:.2f} MB "
              f"in {stats.calls} reductions")
    hvd.shutdown()


if __name__ == "__main__":
    main()
