"""DiLoCo-style low-communication training: local steps, compressed outer updates.

Every rank takes H steps of its own inner optimizer; then the parameters' change since
the last sync (the outer gradient) is averaged over the ranks through cgx's compressed
allreduce (4-bit with error feedback by default) and applied by an outer optimizer
(Nesterov SGD, lr 0.7, momentum 0.9). With ``fragments=K`` the parameters are synced
in K groups at staggered steps, each exchange overlapping the following inner steps
(Streaming DiLoCo). Framework-free; ``cgx.torch.DiLoCo`` and
``cgx.tensorflow.keras.DiLoCo`` adapt it.

* :mod:`cgx.diloco.config`: :class:`DiLoCoConfig`, :class:`OuterSGD` (validated).
* :mod:`cgx.diloco.schedule`: the fragments and their sync steps.
* :mod:`cgx.diloco.loop`: :class:`OuterLoop`, the outer loop and its state.
* :mod:`cgx.diloco.auto`: ``sync_every="auto"`` from the link and the step time.

References: A. Douillard et al., "DiLoCo: Distributed Low-Communication Training of
Language Models" (2023); "Streaming DiLoCo with overlapping communication" (2025).
"""

from cgx.diloco.auto import RoundChoice, choose_sync_every, exchange_seconds
from cgx.diloco.config import AUTO, DiLoCoConfig, OuterSGD
from cgx.diloco.loop import LoopState, OuterLoop, ParamAccess
from cgx.diloco.schedule import FragmentSchedule, balanced_fragments

__all__ = ["AUTO", "DiLoCoConfig", "FragmentSchedule", "LoopState", "OuterLoop", "OuterSGD",
           "ParamAccess", "RoundChoice", "balanced_fragments", "choose_sync_every",
           "exchange_seconds"]
