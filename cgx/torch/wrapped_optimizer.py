"""An optimizer that wraps another and shares its parameter groups and state.

Horovod's ``DistributedOptimizer`` *is* the user's optimizer to LR schedulers,
``GradScaler`` and checkpoints: they read and write ``param_groups`` and ``state``.
:class:`WrappedOptimizer` adopts the wrapped optimizer's objects (shared, not
copied), so one set of groups is seen by all, also after the wrapped optimizer's
``load_state_dict()`` replaces them.
"""

from __future__ import annotations

import torch


class WrappedOptimizer(torch.optim.Optimizer):
    """Shares ``param_groups``, ``state`` and ``defaults`` with ``self.optimizer``.

    Subclasses call :meth:`_adopt` first, and may override :meth:`_before_groups_read`
    (called before ``param_groups`` is handed out).
    """

    def _adopt(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizer = optimizer
        torch.optim.Optimizer.__setstate__(self, {"defaults": optimizer.defaults,
                                                  "state": optimizer.state,
                                                  "param_groups": optimizer.param_groups})

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer (not modified)."""
        return self._optimizer

    def _before_groups_read(self) -> None:
        """Subclasses: finish what must be done before anybody reads the groups."""

    @property
    def param_groups(self) -> list:
        """The wrapped optimizer's parameter groups."""
        self._before_groups_read()
        return self._groups()

    @param_groups.setter
    def param_groups(self, value) -> None:
        inner = self.__dict__.get("_optimizer")
        if inner is not None:
            inner.param_groups = value

    def _groups(self) -> list:
        # Always the wrapped optimizer's own list: its load_state_dict() replaces it.
        inner = self.__dict__.get("_optimizer")
        return inner.param_groups if inner is not None else []

    def _all_params(self) -> list:
        return [p for g in self._groups() for p in g["params"]]

    @property
    def state(self):
        """The wrapped optimizer's state (shared, also after its ``load_state_dict()``)."""
        inner = self.__dict__.get("_optimizer")
        return inner.state if inner is not None else {}

    @state.setter
    def state(self, value) -> None:
        inner = self.__dict__.get("_optimizer")
        if inner is not None:
            inner.state = value
