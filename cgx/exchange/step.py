"""What every adapter reports about a step's exchange, written once.

Three things happen around every exchange, whatever starts it (the torch
optimizer's gradient hooks, the TF tape's start ops, DDP's bucket hook):

1. gradients become ready: the planned mode learns when (its simulated step
   starts from these ready times), and the timeline marks it (``ready`` on the
   bucket's row);
2. the reductions run on the engine thread (the plan's ``reduce``);
3. the training thread waits for what backward did not hide: that wait is the
   step's *exposed* communication (``cgx.stats``: ms exposed per step).

:class:`StepRecorder` does 1 and 3 for one adapter's plan.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterable, Optional

from cgx.collectives.reducer import ReduceStats


class StepRecorder:
    """Ready marks, the planner's ready times and the exposed time of one plan's steps.

    Args:
        plan: the :class:`cgx.exchange.GradientPlan` whose gradients these are.
        reducer: where statistics go and whose timeline marks the steps
            (``cgx.session.reducer()`` or a process set's).
    """

    def __init__(self, plan, reducer) -> None:
        self.plan = plan
        self.reducer = reducer

    def ready(self, indices: Iterable[int], step: int, row: str,
              label: Optional[str] = None) -> None:
        """Gradients ``indices`` of ``step`` are ready to travel (training thread).

        ``row`` is the timeline row (one per bucket or exchange); ``label`` names the
        mark (``ready`` by default), with the tensors' names as its argument.
        """
        indices = list(indices)
        planned = self.plan.planned
        if planned is not None:  # ready times: the plan's input, then drift checks
            for i in indices:
                planned.note_ready(i, step)
        timeline = self.reducer.timeline
        if timeline.enabled:
            timeline.instant(label or "ready", row=row,
                             args={"tensors": [self.plan.names[i] for i in indices]})

    @contextlib.contextmanager
    def waiting(self):
        """Around the training thread's wait for the step's reductions: the time spent
        inside is the step's exposed communication (one step in the statistics)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.reducer.add_stats(ReduceStats(steps=1,
                                               exposed_seconds=time.perf_counter() - t0))
