"""The planner: per tensor, the option with the lowest simulated step time; fusion boundaries.

1. Tensors are launched in gradient-ready order and cut into fusion groups at a byte
   threshold; a few thresholds are tried and the best plan kept.
2. A sweep over the groups forward, then one backward: each tensor, largest first within its group, gets the option with the
   shortest simulated step, the rest fixed. Options beaten by another on both compute
   and network time are not tried. Ties go to the earliest option, exact first, so a
   tensor whose exchange hides under backward stays exact (Espresso's pruning, as a
   consequence: compressing it buys no time, so it gets no compression error). Whether
   a tensor hides is judged in the whole timeline, not alone: its traffic may delay
   others.

Where the cores are shared, every option's CPU work (``Option.cpu_s``) adds to one
total that bounds the step below (see ``cgx.policy.planner.simulator``); a swap changes it by
the two options' difference.

Changing one tensor changes one group's cost. The lanes before the group and, folded
into one max-plus functional, the effect of the groups after it are kept while a sweep
moves, so trying an option costs O(1) and a sweep O(tensors x options + groups).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional, Sequence

from cgx.policy.planner.costs import DEFAULT_BITS, CostModel, Option, OptionMaker, TensorProfile
from cgx.policy.planner.simulator import GroupCost, Lanes, SimulatedStep, advance, simulate

DEFAULT_FUSION_MB = (4.0, 16.0, 64.0)


def fusion_groups(tensors: Sequence[TensorProfile], order: Sequence[int],
                  fusion_bytes: float) -> list[list[int]]:
    """Consecutive tensors (in ``order``) until their float32 bytes reach ``fusion_bytes``."""
    groups, cur, size = [], [], 0
    for i in order:
        cur.append(i)
        size += 4 * tensors[i].numel
        if size >= fusion_bytes:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


class _Group:
    """A fusion group's cost, updatable one tensor at a time.

    Communication is ``sum(alpha)`` over its calls (one per option and collective in use)
    plus ``beta x bytes`` of every member: a swap changes the linear part by the two
    options' difference and the alphas only where a call appears or disappears.
    """

    __slots__ = ("ready", "compress", "decompress", "comm", "users", "alpha", "cpu")

    def __init__(self, members, tensors, choice, alpha):
        self.alpha = alpha  # collective -> seconds per call
        self.ready = max(tensors[i].ready_s for i in members)
        users: dict[tuple, int] = {}  # (option name, collective) -> members using that call
        compress = decompress = comm = cpu = 0.0
        for i in members:
            o = choice[i]
            compress += o.compress_s
            decompress += o.decompress_s
            cpu += o.cpu_s
            comm += o.linear_s
            for key in o.calls:
                n = users.get(key, 0)
                if not n:
                    comm += alpha[key[1]]
                users[key] = n + 1
        self.users, self.compress, self.decompress, self.comm = users, compress, decompress, comm
        self.cpu = cpu

    def _comm_delta(self, old: Optional[Option], new: Option) -> float:
        delta = new.linear_s - (old.linear_s if old is not None else 0.0)
        users, alpha = self.users, self.alpha
        if old is not None:
            for key in old.calls:
                if users[key] == 1:
                    delta -= alpha[key[1]]
        for key in new.calls:
            if not users.get(key):
                delta += alpha[key[1]]
        return delta

    def cost(self) -> GroupCost:
        return GroupCost(self.ready, self.compress, self.comm, self.decompress, self.cpu)

    def swap(self, old: Optional[Option], new: Option) -> None:
        self.comm += self._comm_delta(old, new)
        users = self.users
        if old is not None:
            for key in old.calls:
                users[key] -= 1
            self.compress -= old.compress_s
            self.decompress -= old.decompress_s
            self.cpu -= old.cpu_s
        for key in new.calls:
            users[key] = users.get(key, 0) + 1
        self.compress += new.compress_s
        self.decompress += new.decompress_s
        self.cpu += new.cpu_s


@dataclasses.dataclass
class ExchangePlan:
    """The planner's decision: an option per tensor, the fusion groups, the predicted step."""

    tensors: list[TensorProfile]
    options: list[list[Option]]  # per tensor, the options considered (exact first)
    choice: list[int]  # per tensor, the index of its option in ``options``
    groups: list[list[int]]
    fusion_bytes: float
    timeline: SimulatedStep
    model: CostModel
    backward_s: float
    tail_s: float
    decision_s: float  # seconds the planner took

    @property
    def chosen(self) -> list[Option]:
        return [opts[c] for opts, c in zip(self.options, self.choice)]

    @property
    def step_s(self) -> float:
        return self.timeline.step_s

    def alternatives(self, i: int) -> list[tuple[str, float]]:
        """Predicted step time if tensor ``i`` took each of its options, the rest as planned."""
        chosen = self.chosen
        out = []
        for opt in self.options[i]:
            trial = list(chosen)
            trial[i] = opt
            out.append((opt.name, simulate(self.tensors, trial, self.groups, self.model,
                                           self.backward_s, self.tail_s).step_s))
        return out


NEG = float("-inf")
# F(lanes) = max(k, a + compress_free, b + network_free, e + decompress_free): the step's end
# as a function of the lanes before a group. `advance` is max-plus linear in the lanes, so
# the groups after any point fold into one such functional.
Functional = tuple[float, float, float, float]


def _terminal(backward_s: float, tail_s: float) -> Functional:
    return (backward_s + tail_s, NEG, tail_s, tail_s)


def _compose(g: GroupCost, f: Functional) -> Functional:
    """The functional of ``g`` followed by ``f``."""
    k, a, b, e = f
    cc = g.compress + g.comm
    ccd = cc + g.decompress
    cd = g.comm + g.decompress
    return (max(k, a + g.ready + g.compress, b + g.ready + cc, e + g.ready + ccd),
            max(a + g.compress, b + cc, e + ccd), max(b + g.comm, e + cd), e + g.decompress)


def _apply(f: Functional, lanes: Lanes) -> float:
    return max(f[0], f[1] + lanes[0], f[2] + lanes[1], f[3] + lanes[2])


def _worth_trying(opts: list[Option], alpha: dict) -> list[int]:
    """Indices of the options to try: exact, and any option no other beats on compute,
    (uncontended) network time and CPU taken from the compute (``alpha``: seconds per
    call, per collective)."""
    cost = []
    for o in opts:
        net = o.linear_s
        for _, kind in o.calls:
            net += alpha[kind]
        cost.append((o.compress_s + o.decompress_s, net, o.cpu_s))
    keep = [0]
    for j in range(1, len(opts)):
        cj, nj, uj = cost[j]
        for i, (ci, ni, ui) in enumerate(cost):
            if i != j and ci <= cj and ni <= nj and ui <= uj and (
                    ci < cj or ni < nj or ui < uj or i < j):
                break  # option i is at least as good on every count
        else:
            keep.append(j)
    return keep


def _decide(i, opts, tries, choice, current, grp, lanes_before, after, cpu_floor) -> float:
    """Give tensor ``i`` its best option, ties to the earliest (exact first); return the
    change of the total CPU work. ``cpu_floor``: the step's lower bound from the compute
    and every other option's CPU work (the current one's included). ``advance``,
    ``_apply`` and the communication delta are inlined: this is the planner's inner loop."""
    c_free, n_free, d_free = lanes_before
    k, a, b, e = after
    old = current[i]
    cur = choice[i]
    users, alpha = grp.users, grp.alpha
    ready = grp.ready
    start = ready if ready > c_free else c_free
    comp0 = grp.compress - old.compress_s
    dec0 = grp.decompress - old.decompress_s
    comm0 = grp.comm - old.linear_s
    floor0 = cpu_floor - old.cpu_s
    for key in old.calls:  # the calls only the old option made disappear with it
        if users[key] == 1:
            comm0 -= alpha[key[1]]
    best_j, best_t = -1, 0.0
    for j in tries:
        if j == cur:
            comp, comm, dec = grp.compress, grp.comm, grp.decompress
        else:
            o = opts[j]
            comp = comp0 + o.compress_s
            dec = dec0 + o.decompress_s
            comm = comm0 + o.linear_s
            for key in o.calls:
                if not users.get(key):
                    comm += alpha[key[1]]
        c1 = start + comp
        n1 = (c1 if c1 > n_free else n_free) + comm
        d1 = (n1 if n1 > d_free else d_free) + dec
        t = k
        if a + c1 > t:
            t = a + c1
        if b + n1 > t:
            t = b + n1
        if e + d1 > t:
            t = e + d1
        floor = floor0 + opts[j].cpu_s
        if floor > t:
            t = floor
        if best_j < 0 or t < best_t * (1 - 1e-9):
            best_j, best_t = j, t
    if best_j == cur:
        return 0.0
    new = opts[best_j]
    grp.swap(old, new)
    current[i], choice[i] = new, best_j
    return new.cpu_s - old.cpu_s


class _Sweeper:
    """The sweeps of one fusion grouping: forward, then backward, each tensor (largest first
    within its group) taking its best option with the rest fixed.

    Going forward, the lanes before the group are extended one group at a time and the
    groups after it are unchanged since the last backward sweep (their folded functional
    is kept); going backward, the other way round. A decision is O(options), a sweep
    O(tensors x options + groups).
    """

    def __init__(self, tensors, options, tries_of, groups, alpha, backward_s, tail_s):
        self.options, self.tries_of = options, tries_of
        self.choice = [0] * len(tensors)
        self.current = [opts[0] for opts in options]
        self.state = [_Group(members, tensors, self.current, alpha) for members in groups]
        self.by_size = [sorted(members, key=lambda k: -tensors[k].numel) for members in groups]
        self.terminal = _terminal(backward_s, tail_s)
        self.base = backward_s + tail_s
        self.cpu = sum(o.cpu_s for o in self.current)

    def _suffixes(self) -> list[Functional]:
        G = len(self.state)
        out = [self.terminal] * (G + 1)
        for g in range(G - 1, -1, -1):
            out[g] = _compose(self.state[g].cost(), out[g + 1])
        return out

    def step_s(self) -> float:
        return max(_apply(self._suffixes()[0], (0.0, 0.0, 0.0)), self.base + self.cpu)

    def forward(self) -> None:
        after = self._suffixes()
        lanes: Lanes = (0.0, 0.0, 0.0)
        for g, grp in enumerate(self.state):
            for i in self.by_size[g]:
                if len(self.tries_of[i]) > 1:
                    self.cpu += _decide(i, self.options[i], self.tries_of[i], self.choice,
                                        self.current, grp, lanes, after[g + 1],
                                        self.base + self.cpu)
            lanes = advance(lanes, grp.cost())[0]

    def backward(self) -> None:
        G = len(self.state)
        before: list[Lanes] = [(0.0, 0.0, 0.0)] * (G + 1)
        for g in range(G):
            before[g + 1] = advance(before[g], self.state[g].cost())[0]
        f = self.terminal
        for g in range(G - 1, -1, -1):
            grp = self.state[g]
            for i in self.by_size[g]:
                if len(self.tries_of[i]) > 1:
                    self.cpu += _decide(i, self.options[i], self.tries_of[i], self.choice,
                                        self.current, grp, before[g], f, self.base + self.cpu)
            f = _compose(grp.cost(), f)


def plan(tensors: Sequence[TensorProfile], model: CostModel, backward_s: float, *,
         tail_s: float = 0.0, fusion_mb: Sequence[float] = DEFAULT_FUSION_MB,
         bits: Sequence[int] = DEFAULT_BITS, families: Optional[Sequence[str]] = None,
         exact_only: Optional[Sequence[bool]] = None) -> ExchangePlan:
    """Choose every tensor's option and the fusion threshold with the shortest predicted step.

    Args:
        tensors: the gradients, with ready times from backward's start.
        model: the cost model (see :class:`CostModel`; calibrated or assumed).
        backward_s: backward's length.
        tail_s: work after the exchange (the optimizer update).
        fusion_mb: fusion thresholds to try, in MB of float32.
        bits / families: the options offered (see :func:`options_for`).
        exact_only: per tensor, True where only the exact option is allowed (e.g. the
            layer rules keep it exact).
    """
    t0 = time.perf_counter()
    tensors = list(tensors)
    if not tensors:
        raise ValueError("plan() needs at least one tensor")
    if not fusion_mb:
        raise ValueError("fusion_mb needs at least one threshold (MB of float32 per group)")
    if exact_only is not None and len(exact_only) != len(tensors):
        raise ValueError(f"exact_only has {len(exact_only)} entries for {len(tensors)} tensors")
    # Tensors of one shape share their options (models repeat shapes: blocks, heads).
    cache: dict[tuple, tuple[list[Option], list[int]]] = {}
    options, tries_of = [], []
    options_for = OptionMaker(model, bits, families)
    alpha = {kind: ab.alpha for kind, ab in model.links.items()}
    for k, t in enumerate(tensors):
        key = (t.numel, t.shape, t.rows, exact_only is not None and exact_only[k])
        if key not in cache:
            opts = options_for(t)
            if key[3]:
                opts = opts[:1]
            cache[key] = (opts, _worth_trying(opts, alpha))
        options.append(cache[key][0])
        tries_of.append(cache[key][1])
    order = sorted(range(len(tensors)), key=lambda i: tensors[i].ready_s)
    # Every threshold gets a forward sweep; the best then gets the backward sweep too
    # (a second round changes nothing on the brute-force instances of benchmarks/planner.py).
    best = None
    for mb in fusion_mb:
        groups = fusion_groups(tensors, order, mb * 1e6)
        sweeper = _Sweeper(tensors, options, tries_of, groups, alpha, backward_s, tail_s)
        sweeper.forward()
        step = sweeper.step_s()
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, sweeper, groups, mb * 1e6)
    _, sweeper, groups, fusion_bytes = best
    sweeper.backward()
    choice = sweeper.choice
    chosen = [opts[c] for opts, c in zip(options, choice)]
    timeline = simulate(tensors, chosen, groups, model, backward_s, tail_s)
    return ExchangePlan(tensors, options, choice, groups, fusion_bytes, timeline, model, backward_s,
                tail_s, time.perf_counter() - t0)


def format_exchange(p: ExchangePlan, limit: Optional[int] = None) -> str:
    """A markdown table: per tensor, the chosen option, its bytes, and the predicted step time
    of each alternative (the rest of the plan fixed)."""
    lines = [f"Predicted step {1e3 * p.step_s:.1f} ms (backward {1e3 * p.backward_s:.1f} ms, "
             f"exposed communication {1e3 * p.timeline.exposed_s:.1f} ms), "
             f"{len(p.groups)} fusion groups of <= {p.fusion_bytes / 1e6:g} MB, "
             f"decided in {1e3 * p.decision_s:.1f} ms", "",
             "| tensor | values | ready ms | chosen | MB sent | step ms with each option |",
             "|---|---:|---:|---|---:|---|"]
    order = sorted(range(len(p.tensors)), key=lambda i: -p.tensors[i].numel)
    for i in order[:limit]:
        t, opt = p.tensors[i], p.chosen[i]
        alts = ", ".join(f"{name} {1e3 * s:.1f}" for name, s in p.alternatives(i))
        lines.append(f"| {t.name} | {t.numel:,} | {1e3 * t.ready_s:.1f} | {opt.name} | "
                     f"{opt.bytes_sent / 1e6:.2f} | {alts} |")
    if limit is not None and len(order) > limit:
        lines.append(f"| ({len(order) - limit} smaller tensors) | | | | | |")
    return "\n".join(lines)
