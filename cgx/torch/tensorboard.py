"""cgx's communication statistics in TensorBoard (``torch.utils.tensorboard``)."""

from __future__ import annotations

from typing import Optional

from cgx import session
from cgx.stats import scalars


class StatsLogger:
    """Writes the communication statistics since the last call as TensorBoard scalars.

    Args:
        writer: a ``torch.utils.tensorboard.SummaryWriter`` (log it on one rank, or
            give each rank its own log directory).

    Example::

        from torch.utils.tensorboard import SummaryWriter
        logger = cgx.torch.StatsLogger(SummaryWriter("runs/cgx"))
        for step in ...:
            ...
            if step % 50 == 0:
                logger.log(step)   # cgx/bytes_sent_per_step, cgx/compression_ratio, ...
    """

    def __init__(self, writer):
        if not hasattr(writer, "add_scalar"):
            raise TypeError(f"writer must be a SummaryWriter (with add_scalar), got "
                            f"{type(writer).__name__}")
        self.writer = writer
        self._last = None

    def log(self, step: int, stats: Optional[object] = None) -> dict:
        """Write the scalars of what happened since the previous ``log``; returns them."""
        now = stats if stats is not None else session.stats()
        values = scalars(now, since=self._last)
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self._last = now
        return values
