"""Per-layer adaptive compression: which level each layer gets, within an error budget.

Reference: I. Markov, K. Alimohammadi, E. Frantar, D. Alistarh, "L-GreCo: Layerwise-adaptive
Gradient Compression for Efficient Data-parallel Deep Learning", MLSys 2024.

Layers differ by orders of magnitude in size and in how much compression hurts
them. Over a window of steps cgx measures, on sampled steps' gradients, the
error of what every candidate level would send (:mod:`.stats`, combined over
all ranks), and picks per layer the level that minimizes the bytes sent subject to
a total error of at most ``alpha`` times that of the uniform default
(:mod:`.solver`, a knapsack dynamic program with backtracking). The plan is
recomputed every ``adjust_every`` steps (:mod:`.schedule`); every rank derives
the same plan from the same allreduced table.

Candidates (:mod:`.candidates`): quantization (bits 2..8 x bucket sizes
128..4096), top-k densities, PowerSGD ranks, and exact for layers where nothing
else fits; by default a layer may pick any family (the mixed mode), or one
family alone (L-GreCo's single-family modes). Error feedback, in every family,
follows the optimizer's update rule (:mod:`.compensation`). Used by
``DistributedOptimizer``, the DDP hook and Keras via
``compression=Compression.auto(...)``, ``"auto"`` or ``CGX_COMPRESSION=auto``.
"""

from cgx.policy.levels.candidates import Candidate, Family, candidates_for
from cgx.policy.update_rule import UpdateRule, update_rule_of
from cgx.policy.levels.schedule import AdaptiveSchedule, AutoCompression, format_levels
from cgx.policy.levels.solver import LevelChoice, solve

__all__ = ["Candidate", "Family", "candidates_for", "UpdateRule", "update_rule_of", "AdaptiveSchedule", "AutoCompression",
           "format_levels", "LevelChoice", "solve"]
