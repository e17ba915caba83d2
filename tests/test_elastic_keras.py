"""hvd.elastic for TensorFlow and Keras without an elastic job: KerasState and
TensorFlowState commit, restore and sync; the callbacks' commits and counters; failed
collectives found behind TensorFlow's errors. Real ranks changing world:
tests/test_elastic_training.py.
"""

import os

import numpy as np
import pytest

from spawn import run_gloo

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
pytest.importorskip("cgx.tensorflow", exc_type=ImportError)  # before TensorFlow
import tensorflow as tf  # noqa: E402
keras = pytest.importorskip("keras")

import cgx.tensorflow.keras as hvd  # noqa: E402
from cgx import runtime, session  # noqa: E402
from cgx.elastic import run as run_mod  # noqa: E402
from cgx.errors import CommunicationError  # noqa: E402
from cgx.launch.elastic_env import ElasticEnv  # noqa: E402
from cgx.tensorflow import elastic as tf_elastic  # noqa: E402
from cgx.tensorflow import failures  # noqa: E402
from cgx.tensorflow._bridge import run_collective  # noqa: E402


def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 8)).astype("float32")
    return x, (x[:, :3].argmax(1)).astype("int64")


# -- a failed collective behind TensorFlow's error ---------------------------------------

def _graph_op_raising(error):
    def body(x):
        raise error

    @tf.function
    def step(x):
        return run_collective(body, [x], [tf.float32], [tf.TensorShape([2])], "probe")[0]

    return step


def test_a_failed_collective_in_a_graph_is_found_behind_tensorflows_error():
    failures.clear()
    with pytest.raises(tf.errors.OpError) as info:
        _graph_op_raising(CommunicationError("rank 2 is gone"))(tf.zeros(2))
    found = failures.failure_behind(info.value)
    assert isinstance(found, CommunicationError) and "rank 2 is gone" in str(found)


def test_a_program_error_in_a_graph_is_not_a_failure():
    failures.clear()
    with pytest.raises(tf.errors.OpError) as info:
        _graph_op_raising(ValueError("bad shape"))(tf.zeros(2))
    assert failures.failure_behind(info.value) is None


class _Member:
    def __init__(self):
        self.spec = ElasticEnv(addr="h", port=1, run_id="r", min_np=1, max_np=4)
        self.round, self.closed = 0, False

    def close(self):
        self.closed = True


def test_run_rolls_back_on_a_failure_inside_fit_and_raises_program_errors(monkeypatch):
    member = _Member()
    monkeypatch.setattr(run_mod, "membership", lambda: member)
    resets = []

    def reinit():
        resets.append(1)
        member.round += 1

    monkeypatch.setattr(session, "reinit", reinit)
    monkeypatch.setattr(runtime, "rank", lambda: 0)
    monkeypatch.setattr(runtime, "size", lambda: 1)
    state = hvd.elastic.ObjectState(tries=0)
    outcomes = iter([CommunicationError("peer gone"), None])

    @hvd.elastic.run
    def train(state):
        state.tries += 1
        error = next(outcomes)
        if error is not None:  # as model.fit raises it: a TF error from the graph
            _graph_op_raising(error)(tf.zeros(2))
        return "done"

    assert train(state) == "done" and len(resets) == 1
    assert state.tries == 1  # rolled back to the commit (0), then one more try

    @hvd.elastic.run
    def wrong(state):
        _graph_op_raising(ValueError("bad shape"))(tf.zeros(2))

    with pytest.raises(tf.errors.OpError, match="bad shape"):
        wrong(state)
    assert len(resets) == 1


# -- the callbacks ----------------------------------------------------------------------

class _Seen(hvd.elastic.ObjectState):
    """An ObjectState that records (epoch, batch) at each commit."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def commit(self):
        self.seen.append((self.epoch, self.batch))
        super().commit()


@pytest.mark.parametrize("reverse", [False, True])
def test_commits_see_the_updated_counters_whatever_the_callback_order(reverse):
    model, (x, y) = _mlp(), _data()
    state = _Seen(epoch=0, batch=0)
    cbs = [hvd.elastic.CommitStateCallback(state, batches_per_commit=2),
           hvd.elastic.UpdateBatchStateCallback(state),
           hvd.elastic.UpdateEpochStateCallback(state)]
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=cbs[::-1] if reverse else cbs)
    # 5 batches an epoch: commits after batches 2 and 4, and at each epoch's end
    assert state.seen == [(0, 2), (0, 4), (1, 0), (1, 2), (1, 4), (2, 0)]
    assert (state.epoch, state.batch) == (2, 0)


def test_an_epoch_resumed_at_the_committed_batch_keeps_the_counts():
    model, (x, y) = _mlp(), _data()
    state = _Seen(epoch=1, batch=3)  # as restored after a rollback in epoch 1
    cbs = [hvd.elastic.CommitStateCallback(state, batches_per_commit=1),
           hvd.elastic.UpdateBatchStateCallback(state),
           hvd.elastic.UpdateEpochStateCallback(state)]
    while state.epoch < 3:  # one fit per epoch, resumed at state.batch
        skip = state.batch * 8
        model.fit(x[skip:], y[skip:], batch_size=8, initial_epoch=state.epoch,
                  epochs=state.epoch + 1, shuffle=False, verbose=0, callbacks=cbs)
    # 2 batches left of epoch 1, then epoch 2's 5; an epoch's last commit is its end's
    assert state.seen == [(1, 4), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4), (3, 0)]
    assert (state.epoch, state.batch) == (3, 0)
    # Horovod's single fit over the epochs left counts the same epochs
    state = _Seen(epoch=1, batch=0)
    cb = hvd.elastic.UpdateEpochStateCallback(state)
    model.fit(x, y, batch_size=8, epochs=3 - state.epoch, verbose=0, callbacks=[cb])
    assert state.epoch == 3


def test_bad_arguments_and_an_unbuilt_model_are_refused():
    with pytest.raises(ValueError, match="batches_per_commit"):
        hvd.elastic.CommitStateCallback(hvd.elastic.ObjectState(), batches_per_commit=0)
    unbuilt = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="built first"):
        hvd.elastic.KerasState(unbuilt)
    with pytest.raises(ValueError, match="needs the variables"):
        tf_elastic.TensorFlowState()


# -- on 2 real ranks: KerasState with cgx's optimizer ----------------------------------

def _keras_state_world(rank, world):
    import cgx.tensorflow.keras as hvd
    from cgx.config import Config
    hvd.init(Config(minimal_size=0))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2,
        compression=hvd.Compression.quantize(bits=2, error_feedback=True)),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    out = {}
    state = hvd.elastic.KerasState(model, epoch=0)  # builds the optimizer
    out["built"] = model.optimizer.built
    x, y = _data(seed=rank)
    model.fit(x[:24], y[:24], batch_size=8, shuffle=False, verbose=0)  # 3 passes: 1 pending
    opt = model.optimizer
    state.epoch = 1
    state.commit()
    committed = ([w.copy() for w in model.get_weights()],
                 [np.array(v) for v in opt.variables], opt.owed_residual())
    model.fit(x[24:], y[24:], batch_size=8, shuffle=False, verbose=0)
    state.epoch = 2
    out["moved"] = not all(np.array_equal(a, b) for a, b in zip(committed[0],
                                                                  model.get_weights()))
    state.restore()  # as after a failed collective
    out["weights_back"] = all(np.array_equal(a, b) for a, b in zip(committed[0],
                                                                     model.get_weights()))
    out["opt_back"] = all(np.array_equal(a, np.array(b))
                          for a, b in zip(committed[1], opt.variables))
    out["owed"] = (committed[2], opt.owed_residual())
    out["epoch"] = state.epoch
    # the rank with more commits is the senior: its model wins, accumulators stay own
    if rank == 1:
        model.set_weights([w + 1.0 for w in model.get_weights()])
        state.commit()
        out["senior"] = np.concatenate([w.ravel() for w in model.get_weights()])
    else:
        model.optimizer._pending.assign(0)  # as a rank that joined mid-accumulation
    model.optimizer._accumulators[0].assign(tf.fill(model.optimizer._accumulators[0].shape,
                                                    float(rank)))
    plans = list(opt._exchange._plans.values())
    if rank == 0:  # the exchange's shared state (its step) is synced from the senior too
        for plan in plans:
            plan.step += 50
    owed_before_sync = opt.owed_residual()
    state.sync()
    out["plan_steps"] = [p.step for p in plans]
    out["own_residuals"] = opt.owed_residual() == owed_before_sync
    out["after_sync"] = np.concatenate([w.ravel() for w in model.get_weights()])
    out["accumulator"] = float(np.array(model.optimizer._accumulators[0]).ravel()[0])
    out["pending"] = int(np.array(model.optimizer._pending))
    out["commits"] = state.commits
    state.on_reset()
    out["retrace"] = model.train_function is None
    out["tf1"] = _tf1_session_state(rank)
    return out


def _tf1_session_state(rank):
    """TensorFlowState in a tf.compat.v1 session: sync from rank 0, then restore."""
    with tf.Graph().as_default():
        v = tf.compat.v1.Variable([1.0 + rank, 2.0], use_resource=True)
        with tf.compat.v1.Session() as sess:
            sess.run(v.initializer)
            state = tf_elastic.TensorFlowState([v], session=sess, step=rank)
            state.sync()
            synced = (sess.run(v).tolist(), state.step)
            sess.run(v.assign([5.0, 6.0]))
            state.step = 7
            state.restore()
            return synced, (sess.run(v).tolist(), state.step)


@pytest.mark.multiproc
def test_keras_state_restores_the_commit_and_syncs_from_the_senior_rank():
    r0, r1 = run_gloo(_keras_state_world, 2)
    for r in (r0, r1):
        assert r["built"] and r["moved"] and r["weights_back"] and r["opt_back"]
        owed_at_commit, owed_now = r["owed"]
        assert owed_at_commit > 0 and owed_now == pytest.approx(owed_at_commit)
        assert r["epoch"] == 1 and r["commits"] == 2 and r["retrace"]
        assert r["pending"] == 1  # the shared pass count
    np.testing.assert_array_equal(r0["after_sync"], r1["senior"])  # the senior's won
    np.testing.assert_array_equal(r1["after_sync"], r1["senior"])
    assert r0["plan_steps"] == r1["plan_steps"] and r0["own_residuals"] and r1["own_residuals"]
    for r in (r0, r1):  # rank 0's values, kept as the commit
        assert r["tf1"] == (([1.0, 2.0], 0), ([1.0, 2.0], 0))
    assert (r0["accumulator"], r1["accumulator"]) == (0.0, 1.0)  # each rank's own
