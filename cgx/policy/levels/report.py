"""What a plan shows and what a Keras checkpoint keeps of it: per-layer rows, their markdown
table, and the plan alone as JSON-able values (matched by layer name when loaded back).

The functions take the :class:`cgx.policy.levels.schedule.AdaptiveSchedule` (``s``).
"""

from __future__ import annotations

import math
from typing import Sequence

from cgx.policy.levels.candidates import Candidate, Family
from cgx.policy.update_rule import Compensation


def rows(s) -> list[dict]:
    """Per gradient: layer, shape, family, level, bytes, error, share of the budget."""
    out = []
    for i, (n, shape) in enumerate(zip(s.names, s.shapes)):
        c = s.plan[i]
        numel = math.prod(shape)
        row = {"layer": n, "shape": shape,
               "family": "exact" if c is None else c.family_name,
               "level": "exact (not planned)" if c is None else
               "exact (planner: no time saved)" if n in s.hidden else c.label,
               "bytes": 4 * numel if c is None else c.wire_bytes(shape),
               "error": 0.0, "share": 0.0,
               "compensation": s.compensation[n].value if n in s.compensation and
               c is not None and c.family is Family.QUANTIZE else ""}
        if c is not None and s._errors is not None and i in s._errors:
            errs, _ = s._errors[i]
            row["error"] = errs[s._position[i][c]]
            row["share"] = row["error"] / s.budget if s.budget > 0 else 0.0
        out.append(row)
    return out


def format_levels(rows: list[dict]) -> str:
    """A markdown table of :meth:`AdaptiveSchedule.rows`."""
    comp = any(r.get("compensation") for r in rows)  # measured per layer: one more column
    lines = ["| layer | shape | family | level | bytes | error | share of budget |"
             + (" compensation |" if comp else ""),
             "|---|---|---|---|---:|---:|---:|" + ("---|" if comp else "")]
    for r in rows:
        shape = "x".join(map(str, r["shape"])) or "scalar"
        lines.append(f"| {r['layer']} | {shape} | {r['family']} | {r['level']} | "
                     f"{r['bytes']:,} | {r['error']:.4g} | {100 * r['share']:.1f}% |"
                     + (f" {r.get('compensation') or '-'} |" if comp else ""))
    total = sum(r["bytes"] for r in rows)
    lines.append(f"| **total** | | | | **{total:,}** | | |" + (" |" if comp else ""))
    return "\n".join(lines)


def plan_summary(s) -> dict:
    """The plan alone, JSON-able (layer -> [family, bits, bucket]), with its schedule."""
    return {"next_plan": s.next_plan, "plans_made": s.plans_made,
            "plan": {n: c.as_list() for n, c in zip(s.names, s.plan) if c is not None},
            "compensation": {n: v.value for n, v in s.compensation.items()}}


def load_plan_summary(s, summary: dict) -> None:
    """Restore :func:`plan_summary` (by layer name, up to a leading scope)."""
    s.next_plan = int(summary["next_plan"])
    s.plans_made = int(summary["plans_made"])
    for i, n in enumerate(s.names):
        c = summary["plan"].get(n)
        if c is None:
            c = next((v for k, v in summary["plan"].items() if _same_layer(k, n)), None)
        if c is not None and s.candidates[i] is not None:
            cand = Candidate.from_list(c)
            if cand in s.candidates[i]:
                s.plan[i] = cand
        kept = summary.get("compensation", {})
        v = kept.get(n, next((v for k, v in kept.items() if _same_layer(k, n)), None))
        if v is not None:
            s.compensation[n] = Compensation(v)


def _same_layer(a: str, b: str) -> bool:
    """Two variable names of the same layer, up to a leading scope ("model/" + name)."""
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


def matches(summary: dict, names: Sequence[str]) -> bool:
    """True when every layer of a :meth:`AdaptiveSchedule.plan_summary` is among ``names``."""
    return all(any(_same_layer(k, n) for n in names) for k in summary["plan"])
