"""Reference-equivalence harness: N real ranks with an exact exchange == 1 process on all data.

With a mean loss over equal per-rank batches, averaging the ranks' gradients
gives exactly the gradient of the mean loss over their union. So a training
pattern run on N ranks with ``Compression.exact``, each rank taking its slice
of a global batch, must leave every rank with the parameters that one process
gets by running the same pattern on the whole global batch (to float32
rounding). Any divergence is a defect in how cgx follows the training code:
a gradient not reduced, reduced twice, read too early, a rank's state
copied over another's...

A pattern is ``pattern(hvd, shard) -> list of parameter tensors``: it builds
its model from a fixed seed, draws global batches from a fixed seed, and
trains on ``shard(global_batch)``; ``shard`` is the identity in the reference.

Usage (see test_equivalence_torch.py)::

    results = run_patterns(PATTERNS, world=2)      # {name: [rank0 params, rank1 params]}
    reference = run_patterns(PATTERNS, world=1)
    assert_equivalent(results, reference)
"""

from __future__ import annotations

import traceback

import torch

from spawn import run_gloo


def _rank_main(rank, world, module_name, names, variant=None):
    import importlib
    mod = importlib.import_module(module_name)

    def shard(t):
        return t.chunk(world)[rank] if world > 1 else t

    hvd = mod.init() if variant is None else mod.init(variant)
    out = {}
    for name in names:
        try:
            out[name] = [p.detach().clone().float() for p in mod.PATTERNS[name](hvd, shard)]
        except Exception:  # noqa: BLE001 - reported per pattern, with the traceback
            out[name] = traceback.format_exc()
    return out


def run_patterns(module_name: str, names, world: int, timeout: float = 600.0,
                 variant: "str | None" = None) -> dict:
    """Run the patterns ``names`` of ``module_name`` on ``world`` ranks; per pattern, per rank.

    ``variant``: given to the module's ``init(variant)``, which picks what the patterns'
    optimizers decide with (patterns_torch.VARIANTS); None calls ``init()``."""
    outs = run_gloo(_rank_main, world, module_name, list(names), variant, timeout=timeout)
    return {n: [o[n] for o in outs] for n in names}


def assert_equivalent(results: dict, reference: dict, rtol: float = 1e-4,
                      atol: float = 1e-5) -> None:
    """Every rank's parameters equal the reference's, per pattern (all failures listed)."""
    problems = []
    for name, per_rank in results.items():
        ref = reference[name][0]
        if isinstance(ref, str):
            problems.append(f"{name}: the reference failed:\n{ref}")
            continue
        for r, params in enumerate(per_rank):
            if isinstance(params, str):
                problems.append(f"{name}: rank {r} failed:\n{params}")
                continue
            if len(params) != len(ref):
                problems.append(f"{name}: rank {r} has {len(params)} tensors, reference "
                                f"{len(ref)}")
                continue
            for i, (p, q) in enumerate(zip(params, ref)):
                if not torch.allclose(p, q, rtol=rtol, atol=atol):
                    err = float((p - q).abs().max())
                    problems.append(f"{name}: rank {r} tensor {i} differs from the reference "
                                    f"by up to {err:.3g}")
    if problems:
        raise AssertionError("\n".join(problems))
