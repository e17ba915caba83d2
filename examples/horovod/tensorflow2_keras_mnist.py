"""Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py with the import swapped.

Changes from Horovod 0.28.1's script: ``import cgx.tensorflow.keras as hvd``; generated
MNIST-shaped data instead of the download (digits drawn as noisy class templates, so the
model has something to learn); Keras 3 spellings (no ``experimental_run_tf_function``,
``.keras`` checkpoints); ``--epochs``/``--steps-per-epoch`` flags (Horovod's values are the
defaults).

    cgxrun -np 2 python examples/horovod/tensorflow2_keras_mnist.py --epochs 2
"""

import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf
import cgx.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description='Keras MNIST (generated data)')
parser.add_argument('--epochs', type=int, default=24)
parser.add_argument('--steps-per-epoch', type=int, default=500)
parser.add_argument('--checkpoint-dir', default=tempfile.gettempdir())
args = parser.parse_args()

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
gpus = tf.config.experimental.list_physical_devices('GPU')
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')


def generated_mnist(n, seed):
    """n 28x28 images of 10 fixed random templates plus noise, and their labels."""
    templates = np.random.default_rng(1234).uniform(0, 255, size=(10, 28, 28))
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n)
    images = np.clip(templates[labels] * 0.5 + rng.uniform(0, 128, size=(n, 28, 28)), 0, 255)
    return images.astype(np.uint8), labels


(mnist_images, mnist_labels) = generated_mnist(6000, seed=hvd.rank())

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32),
     tf.cast(mnist_labels, tf.int64))
)
dataset = dataset.repeat().shuffle(10000).batch(128)

mnist_model = tf.keras.Sequential([
    tf.keras.Input((28, 28, 1)),
    tf.keras.layers.Conv2D(32, [3, 3], activation='relu'),
    tf.keras.layers.Conv2D(64, [3, 3], activation='relu'),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(128, activation='relu'),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(
    opt, backward_passes_per_step=1, average_aggregated_gradients=True)

mnist_model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
                    optimizer=opt,
                    metrics=['accuracy'])

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),

    # Horovod: average metrics among workers at the end of every epoch.
    #
    # Note: This callback must be in the list before the ReduceLROnPlateau,
    # TensorBoard or other metrics-based callbacks.
    hvd.callbacks.MetricAverageCallback(),

    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = 1.0` ---> `lr = 1.0 * hvd.size()` during
    # the first three epochs. See https://arxiv.org/abs/1706.02677 for details.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=3, verbose=1),
]

# Horovod: save checkpoints only on worker 0 to prevent other workers from corrupting them.
if hvd.rank() == 0:
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(
        os.path.join(args.checkpoint_dir, 'checkpoint-{epoch}.keras')))

# Horovod: write logs on worker 0.
verbose = 1 if hvd.rank() == 0 else 0

# Train the model.
# Horovod: adjust number of steps based on number of GPUs.
history = mnist_model.fit(dataset, steps_per_epoch=args.steps_per_epoch // hvd.size(),
                          callbacks=callbacks, epochs=args.epochs, verbose=verbose)
print('final accuracy: %.4f' % history.history['accuracy'][-1], flush=True)
