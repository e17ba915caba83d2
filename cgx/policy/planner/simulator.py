"""One training step's timeline for a given strategy (pure Python, O(fusion groups)).

The model, kept small enough to be evaluated thousands of times per plan:

* backward produces tensor ``t`` at ``t.ready_s`` and ends at ``backward_s``;
* a fusion group starts when its last tensor is ready; its tensors that share an option
  travel together (one call per collective: one ``alpha``, the bytes summed), options
  differing within a group make separate calls;
* three lanes, each first-come first-served in group order: compression (the engine
  thread), the network, decompression;
* the step ends when backward and every group's decompression are done, plus ``tail_s``
  (the optimizer update);
* where the cores are shared (``CostModel.contention > 0``), the step lasts at least the
  compute plus the exchange's CPU work (``Option.cpu_s``): lanes that overlap backward
  in time still take its core.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from cgx.policy.planner.costs import CostModel, Option, TensorProfile


@dataclasses.dataclass(frozen=True)
class GroupCost:
    ready: float
    compress: float
    comm: float
    decompress: float
    cpu: float = 0.0  # taken from the compute (Option.cpu_s summed)


def group_cost(members: Sequence[int], tensors: Sequence[TensorProfile],
               choice: Sequence[Option], model: CostModel) -> GroupCost:
    ready = max(tensors[i].ready_s for i in members) if members else 0.0
    comp = dec = cpu = 0.0
    calls: dict[tuple, int] = {}
    for i in members:
        opt = choice[i]
        comp += opt.compress_s
        dec += opt.decompress_s
        cpu += opt.cpu_s
        for kind, nbytes in opt.wire:
            calls[(opt.name, kind)] = calls.get((opt.name, kind), 0) + nbytes
    comm = sum(model.comm(kind, nbytes) for (_, kind), nbytes in calls.items())
    return GroupCost(ready, comp, comm, dec, cpu)


@dataclasses.dataclass(frozen=True)
class SimulatedStep:
    """Predicted step: its length, and per group (compress start, comm end, decompress end);
    ``cpu_s``: the exchange's CPU work taken from the compute (0 without contention)."""

    step_s: float
    backward_s: float
    tail_s: float
    groups: tuple[tuple[float, float, float], ...]
    cpu_s: float = 0.0

    @property
    def exposed_s(self) -> float:
        """Time the step waits for the exchange after backward (with contention, including
        the compute's slow-down by the exchange's CPU work)."""
        return self.step_s - self.backward_s - self.tail_s


Lanes = tuple[float, float, float]  # when compression, network and decompression are free


def advance(lanes: Lanes, g: GroupCost) -> tuple[Lanes, tuple[float, float, float]]:
    """Run one group through the three lanes."""
    cpu, net, dec = lanes
    c0 = max(g.ready, cpu)
    c1 = c0 + g.compress
    n1 = max(c1, net) + g.comm
    d1 = max(n1, dec) + g.decompress
    return (c1, n1, d1), (c0, n1, d1)


def finish(lanes: Lanes, backward_s: float, tail_s: float, cpu_s: float = 0.0) -> float:
    return max(backward_s + cpu_s, lanes[1], lanes[2]) + tail_s


def simulate(tensors: Sequence[TensorProfile], choice: Sequence[Option],
             groups: Sequence[Sequence[int]], model: CostModel, backward_s: float,
             tail_s: float = 0.0) -> SimulatedStep:
    """The predicted step for ``choice[i]`` per tensor and ``groups`` (lists of tensor indices,
    in the order they are launched)."""
    if len(choice) != len(tensors):
        raise ValueError(f"{len(choice)} options for {len(tensors)} tensors")
    lanes: Lanes = (0.0, 0.0, 0.0)
    spans = []
    cpu = 0.0
    for members in groups:
        g = group_cost(members, tensors, choice, model)
        lanes, span = advance(lanes, g)
        spans.append(span)
        cpu += g.cpu
    return SimulatedStep(finish(lanes, backward_s, tail_s, cpu), backward_s, tail_s, tuple(spans),
                    cpu)
