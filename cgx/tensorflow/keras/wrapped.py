"""What a Keras optimizer that wraps another reads from it.

cgx's Keras wrappers (``DistributedOptimizer``, ``DiLoCo``) keep the user's optimizer
as ``inner_optimizer``: its learning rate, iteration counter and hyperparameters
(``momentum``, ``beta_1``, ...) are read and written through the wrapper, as Keras
callbacks and LR schedules expect.
"""

from __future__ import annotations


class DelegatesToInner:
    """Mixin for a ``keras.optimizers.Optimizer`` subclass that sets ``inner_optimizer``
    last in its ``__init__`` (attribute reads fall through to it from then on)."""

    def __getattr__(self, name):
        # Only reached for attributes this object lacks: public hyperparameters
        # (momentum, beta_1, ...) are the wrapped optimizer's.
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or name.startswith("_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")
        return getattr(inner, name)

    @property
    def variables(self):
        return self._variables[:] + self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)
