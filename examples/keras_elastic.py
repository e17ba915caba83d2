"""Elastic Keras training with Horovod's API: an MLP on scikit-learn's digits that keeps
training when a rank is lost and takes in ranks that join.

    cgxrun -np 3 --min-np 2 --max-np 4 python examples/keras_elastic.py
    cgxrun -np 3 --min-np 2 --host-discovery-script ./hosts.sh python examples/keras_elastic.py

Kill one of the ranks (``kill -9 <pid>``): the others roll back to the last commit, form a
world of the ranks left and go on, resuming the epoch at the committed batch. A host the
discovery script adds gets a rank, which joins at the next commit and receives the model
and the optimizer by broadcast. ``--log DIR`` writes every step of every rank (its world,
the loss and a digest of the weights) to ``DIR/<pid>.jsonl``.
"""

import argparse
import hashlib
import json
import os
import time

import numpy as np
from sklearn.datasets import load_digits

import cgx.tensorflow.keras as hvd
import keras


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per rank: scaled by the world size")
    p.add_argument("--commit-every", type=int, default=5, help="batches between commits")
    p.add_argument("--compression", default="default",
                   help="default (cgx's: the deciding exchange), 4bit, 4bit-ef (with error "
                        "feedback), exact, auto")
    p.add_argument("--step-sleep", type=float, default=0.0,
                   help="seconds to pause after each step (to watch a run, or in tests)")
    p.add_argument("--log", default="", help="write each step to DIR/<pid>.jsonl")
    return p.parse_args()


def compression_of(name: str):
    return {"default": hvd.Compression.none,  # cgx's default: the deciding exchange
            "4bit": hvd.Compression.quantize(bits=4),
            "4bit-ef": hvd.Compression.quantize(bits=4, error_feedback=True),
            "exact": hvd.Compression.exact, "auto": "auto"}.get(name, name)


def digest(model) -> str:
    flat = np.concatenate([w.ravel() for w in model.get_weights()])
    return hashlib.sha1(flat.tobytes()).hexdigest()[:16]


class StepLog(keras.callbacks.Callback):
    """One line per step: what this rank holds after it (and an optional pause)."""

    def __init__(self, state, path, pause):
        super().__init__()
        self.state, self.pause = state, pause
        self.out = open(path, "a") if path else None

    def on_train_batch_end(self, batch, logs=None):
        if self.out:
            self.out.write(json.dumps({
                "pid": os.getpid(), "rank": hvd.rank(), "size": hvd.size(),
                "step": int(self.model.optimizer.iterations.numpy()),
                "loss": float(logs["loss"]), "digest": digest(self.model),
                "epoch": self.state.epoch, "host": os.environ.get("HOROVOD_HOSTNAME"),
                "start_rank": int(os.environ.get("HOROVOD_RANK", "-1")),
                "commits": self.state.commits,
                "dropped": self.state.dropped_owed, "t": time.time()}) + "\n")
            self.out.flush()
        time.sleep(self.pause)


def epoch_data(x, y, epoch, skip, batch_size):
    """This rank's shard of the epoch (the same order on every rank, cut by the current
    world), without its first ``skip`` batches (done before a rollback)."""
    order = np.random.default_rng(epoch).permutation(len(x))
    steps = len(x) // hvd.size() // batch_size
    skip = min(skip, steps)  # counted in a smaller world's (longer) epochs
    mine = order[hvd.rank()::hvd.size()][:steps * batch_size][skip * batch_size:]
    return x[mine], y[mine]


def main():
    args = parse()
    hvd.init()
    keras.utils.set_random_seed(0)
    data = load_digits()
    x, y = (data.data / 16.0).astype("float32"), data.target.astype("int64")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9)
    model.compile(optimizer=hvd.DistributedOptimizer(
        opt, compression=compression_of(args.compression)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    state = hvd.elastic.KerasState(model, epoch=0, batch=0)

    def rescale():  # the world changed: the same per-rank lr, scaled by the new size
        model.optimizer.learning_rate.assign(args.lr * hvd.size())

    state.register_reset_callbacks([rescale])
    log = os.path.join(args.log, f"{os.getpid()}.jsonl") if args.log else ""
    callbacks = [hvd.elastic.CommitStateCallback(state, batches_per_commit=args.commit_every),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state),
                 StepLog(state, log, args.step_sleep)]

    @hvd.elastic.run
    def train(state):
        history = None
        while state.epoch < args.epochs:
            xs, ys = epoch_data(x, y, state.epoch, state.batch, args.batch_size)
            history = model.fit(xs, ys, batch_size=args.batch_size, shuffle=False,
                                initial_epoch=state.epoch, epochs=state.epoch + 1,
                                callbacks=callbacks, verbose=0)
        losses = history.history.get("loss", []) if history else []
        return losses[-1] if losses else float("nan")

    final = train(state)
    if hvd.rank() == 0:
        print(f"done: {int(model.optimizer.iterations.numpy())} steps, world of {hvd.size()}, "
              f"last loss {final:.3f}", flush=True)


if __name__ == "__main__":
    main()
