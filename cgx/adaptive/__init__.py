"""Per-layer adaptive compression: which level each layer gets, within an error budget.

Reference: I. Markov, K. Alimohammadi, E. Frantar, D. Alistarh, "L-GreCo: Layerwise-adaptive
Gradient Compression for Efficient Data-parallel Deep Learning", MLSys 2024.

Layers differ by orders of magnitude in size and in how much compression hurts
them. Over a window of steps cgx accumulates each layer's gradient, measures the
error every candidate level would make on it (:mod:`.stats`, combined over all
ranks), and picks per layer the level that minimizes the bytes sent subject to
a total error of at most ``alpha`` times that of the uniform default
(:mod:`.solver`, a knapsack dynamic program with backtracking). The plan is
recomputed every ``adjust_every`` steps (:mod:`.schedule`); every rank derives
the same plan from the same allreduced table.

What this package offers today: the quantization family (bits 2..8 x bucket
sizes 128..4096, and exact for layers where nothing else fits), in
``DistributedOptimizer`` via ``compression=Compression.auto(...)``, ``"auto"``
or ``CGX_COMPRESSION=auto``.
"""

from cgx.adaptive.candidates import Candidate, Family, candidates_for
from cgx.adaptive.schedule import AdaptiveSchedule, AutoCompression, format_plan
from cgx.adaptive.solver import Plan, solve

__all__ = ["Candidate", "Family", "candidates_for", "AdaptiveSchedule", "AutoCompression",
           "format_plan", "Plan", "solve"]
