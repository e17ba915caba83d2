"""Which strategy each gradient travels with: a cost model, a step simulator, a greedy planner.

Reference: Z. Wang, H. Lin, Y. Zhu, T. S. E. Ng, "ByteComp: Revisiting Gradient Compression
in Distributed Training" (Espresso), EuroSys 2023: compressing a tensor whose communication
already hides under computation gains nothing and costs compute; predict the step's timeline
from an alpha-beta network model, measured compression throughput and the backward's
gradient-ready times, then give each tensor (largest first) the option with the lowest
simulated step time.

* :mod:`cgx.policy.planner.costs`: the alpha-beta model per collective, compressor throughput,
  and every option a tensor has (exact, fp16, SRA or allgather of 2..8-bit codes,
  sufficient factors for a fully connected layer when Poseidon's rule allows).
* :mod:`cgx.policy.planner.simulator`: one step's timeline for a choice of options and fusion
  groups (pure Python, O(groups)).
* :mod:`cgx.policy.planner.strategy`: the planner (sweeps, fusion boundaries) and the
  per-tensor table of its decisions.
* :mod:`cgx.policy.planner.calibration`: the link's alpha-beta per collective (agreed by every
  rank), the quantizer's throughput, the backward's gradient-ready times.
* :mod:`cgx.policy.planner.scaling`: predicted speed-up over DDP fp32 for 2-64 nodes, from layer
  profiles (VGG-11, ResNet-50, BERT-base as plain lists); ``python -m cgx.policy.planner.scaling``.
* ``python -m cgx.policy.planner MODULE:FACTORY --input ...``: the decision table for a model.
"""

from cgx.policy.planner.costs import AlphaBeta, Collective, CostModel, Option, TensorProfile, options_for
from cgx.policy.planner.simulator import SimulatedStep, simulate
from cgx.policy.planner.strategy import ExchangePlan, format_exchange, plan

__all__ = ["AlphaBeta", "Collective", "CostModel", "Option", "TensorProfile", "options_for",
           "SimulatedStep", "simulate", "ExchangePlan", "format_exchange", "plan"]
