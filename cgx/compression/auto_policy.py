"""``Compression.auto(...)``: the settings of per-layer adaptive compression.

This object only holds and validates the settings; the work is done by
:mod:`cgx.policy.levels` (statistics, candidates, the solver, the schedule), driven
by the gradient plan of ``DistributedOptimizer``.
"""

from __future__ import annotations

from typing import Optional, Sequence

from cgx.compression.base import OFFERED_FAMILIES
from cgx.compression.policy import Policy
from cgx.compression.trial_settings import TrialSettings
from cgx.config import AutoObjective, CompressionMode, Config, Rounding

FAMILIES = ("quantize", "topk", "powersgd")  # families cgx.policy.levels chooses from by default
CASTS = ("fp16", "bf16")  # 16-bit casts: offered too, by default with objective="time"
# "exact" alone: every layer travels exact through auto's path (it measures and plans, and
# exact is the only level): a check of that path against the plain exact exchange.
EXACT = "exact"


Objective = AutoObjective  # what auto minimizes within its error budget


def _objective(value) -> Objective:
    try:
        return value if isinstance(value, Objective) else Objective(str(value).lower())
    except ValueError:
        raise ValueError(f"objective={value!r}; expected 'bytes' (fewest bytes within the "
                         "error budget) or 'time' (the fastest measured step within it)") from None


def _check_families(families) -> tuple:
    """``families`` as a tuple of names (cgx's lower-case, a registered family's as
    registered); ValueError naming the allowed ones."""
    fams = (families,) if isinstance(families, str) else tuple(families)
    if not fams:
        raise ValueError("families is empty; name at least one, e.g. families=('quantize',)")
    own, out = tuple(OFFERED_FAMILIES), []
    for f in fams:
        name = str(getattr(f, "value", f))
        if name.lower() in FAMILIES + CASTS + (EXACT,):
            out.append(name.lower())
        elif name in own:
            out.append(name)
        else:
            raise ValueError(f"unknown compressor family {f!r} for Compression.auto; "
                             f"expected one of: {', '.join(FAMILIES + CASTS + own)}, or "
                             f"families=('{EXACT}',) for no compression at all (a family of "
                             "your own: configs.register it, with auto_levels)")
    return tuple(out)


def _check_levels(fams, bits, bucket_sizes, densities, ranks) -> tuple:
    """The candidate levels, validated: ``(bits, bucket_sizes, densities, ranks)``."""
    from cgx.config import validate_bits, validate_bucket_size
    bits = tuple(validate_bits(int(b), "Compression.auto bits") for b in bits)
    if not bits or any(b > 8 for b in bits):
        raise ValueError(f"bits={bits!r} must name levels in 1..8")
    bucket_sizes = tuple(validate_bucket_size(int(b), "Compression.auto bucket_sizes")
                         for b in bucket_sizes)
    if not bucket_sizes:
        raise ValueError("bucket_sizes is empty; e.g. (512, 1024)")
    from cgx.compression.topk import check_density
    densities = tuple(check_density(d) for d in densities)
    if "topk" in [str(f).lower() for f in fams] and not densities:
        raise ValueError("densities is empty; e.g. (0.001, 0.01)")
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"ranks={tuple(ranks)!r} must be ints >= 1 (columns of the "
                             "PowerSGD factors)")
    ranks = tuple(ranks)
    if "powersgd" in [str(f).lower() for f in fams] and not ranks:
        raise ValueError("ranks is empty; e.g. (1, 2, 4)")
    return bits, bucket_sizes, densities, ranks


class AutoCompression(Policy):
    """Per-layer levels chosen within an error budget (L-GreCo); see :mod:`cgx.policy.levels`.

    Args:
        alpha: the plan's total error may be at most ``alpha`` times the error of
            the uniform default (``CGX_COMPRESSION_QUANTIZATION_BITS`` /
            ``..._BUCKET_SIZE``); > 0. 1.0: as accurate as the default, fewer bytes.
        families: compressor families a layer may pick from: ``"quantize"``,
            ``"topk"``, ``"powersgd"``, ``"fp16"``, ``"bf16"`` (default: the first three,
            the mixed mode, and with ``objective="time"`` the two 16-bit casts too, so that
            the deciding mode weighs what DDP's fp16/bf16 hooks send; one family alone
            compares with L-GreCo's single-family modes). Without error
            feedback (Adam-type optimizers), top-k and PowerSGD are offered only when
            quantization is not (they are biased without it; see
            :func:`cgx.policy.levels.candidates.offered_families`). ``("exact",)``:
            exact is every layer's only candidate (uncompressed float32 throughout, by the
            same exchange path: a check of auto's machinery against the exact exchange).
            A summable family of your own is offered by its ``config_type`` once
            registered (:func:`cgx.compression.configs.register`) with levels
            (:meth:`cgx.compression.Compressor.auto_levels`); it carries no residuals.
        window: steps whose gradients are accumulated for the statistics (> 0).
        adjust_every: re-plan every this many steps (>= window).
        warmup_steps: exact exchange for the first steps (as PyTorch's
            ``start_powerSGD_iter`` and DeepSpeed's ``freeze_step``).
        bits, bucket_sizes: the quantization levels to choose from.
        densities: the top-k levels (fractions kept).
        ranks: the PowerSGD levels (columns of the factors).
        rounding: rounding of what is sent (default: ``CGX_COMPRESSION_ROUNDING``).
        planner: before each plan, let the planner (:mod:`cgx.policy.planner`) mark the layers
            for which compressing saves no time (their exchange hides under backward, or
            is cheaper than compressing; from the traced ready times and the measured
            link): they stay exact, and their share of the error budget goes to the others.
        assume_gbit: with ``planner``: plan for a link of this rate instead of measuring it.
        objective: ``"bytes"`` (default): the plan sending the fewest bytes within the budget.
            ``"time"``: the fastest step within the budget: at each plan, the model
            (the planner's simulated step with auto's measured errors) proposes plans -
            fewest bytes, the planner's, both combined - and beside them the two
            baselines, every tensor exact in fused buckets (what DDP does) and the uniform
            default; each within the budget runs ``trial_steps`` steps, the ranks agree
            on the measured steps and the fastest is kept (fewest bytes among ties);
            re-tried when the kept plan's step drifts (see :mod:`cgx.policy.trials`).
        trial_steps, recheck_every, drift_tolerance: with ``objective="time"``: measured
            steps per tried plan (>= 1), steps between checks of the kept plan (0: never),
            the relative change of its step that starts new trials.
        trial_warmup_steps: with ``objective="time"``: steps between a round's setup and the
            first plan's turn (>= 0).
        trial_runoffs: with ``objective="time"``: extra turns for the plans measured within
            10% of the fastest, times pooled; after the first, only for those the clock
            still cannot tell from it (>= 0 passes; 0: none).
        model_plans: with ``objective="time"``: how many of the model's plans are tried
            beside the two baselines (>= 0).
        error_feedback: keep residuals, in every family (None: by the optimizer's update
            rule, on under SGD, off under Adam-type optimizers; for an optimizer cgx
            does not know, ``CGX_COMPRESSION_ERROR_FEEDBACK``; see
            :mod:`cgx.policy.update_rule`). A quantized layer's compensation is then
            measured per layer (:mod:`cgx.policy.levels.probe`): with None, between none,
            classic feedback and a moving average; with True, between the last two
            (``CGX_COMPENSATION=classic`` or ``moving_average`` fixes the form). With
            ``objective="time"``, None means
            ``CGX_COMPRESSION_ERROR_FEEDBACK``, as for the fixed default: residuals cost
            every plan step time (on 2 CPU cores, a quarter of VGG-11's 4-bit step)).
    """

    name = "auto"

    def __init__(self, alpha: float = 1.0, families: Optional[Sequence[str]] = None,
                 window: int = 10, adjust_every: int = 1000, warmup_steps: int = 0,
                 bits: Sequence[int] = (2, 3, 4, 5, 6, 8),
                 bucket_sizes: Sequence[int] = (128, 512, 1024, 4096),
                 densities: Sequence[float] = (0.001, 0.004, 0.01, 0.04),
                 ranks: Sequence[int] = (1, 2, 4, 8, 16),
                 rounding: "Optional[Rounding | str]" = None,
                 error_feedback: Optional[bool] = None, planner: bool = False,
                 assume_gbit: Optional[float] = None, objective: "Objective | str" = "bytes",
                 trial_steps: int = 3, recheck_every: int = 200, drift_tolerance: float = 0.2,
                 model_plans: int = 2, trial_warmup_steps: int = 3, trial_runoffs: int = 3):
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ValueError(f"alpha={alpha!r} must be a number > 0: the plan's error may be "
                             "alpha times the uniform default's (1.0: as accurate)")
        objective = _objective(objective)
        fams = _check_families(families if families is not None else
                               FAMILIES + CASTS * (objective is Objective.TIME))
        for name, v, lo in (("window", window, 1), ("adjust_every", adjust_every, 1),
                            ("warmup_steps", warmup_steps, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} must be an int >= {lo}")
        if adjust_every < window:
            raise ValueError(f"adjust_every={adjust_every} is shorter than window={window}: "
                             "each plan needs a full window of statistics")
        bits, bucket_sizes, densities, ranks = _check_levels(fams, bits, bucket_sizes,
                                                             densities, ranks)
        if rounding is not None and not isinstance(rounding, Rounding):
            try:
                rounding = Rounding(str(rounding).lower())
            except ValueError:
                raise ValueError(f"rounding={rounding!r}; expected 'nearest' or "
                                 "'stochastic'") from None
        if not isinstance(planner, bool):
            raise TypeError(f"planner must be True or False, got {planner!r}")
        from cgx.config import validate_gbit
        validate_gbit(assume_gbit, "assume_gbit")
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True, False or None, got "
                            f"{error_feedback!r}")
        self.objective = objective
        self.trials = TrialSettings(steps=trial_steps, recheck_every=recheck_every,
                                    drift_tolerance=drift_tolerance,
                                    warmup_steps=trial_warmup_steps, runoffs=trial_runoffs)
        if isinstance(model_plans, bool) or not isinstance(model_plans, int) or model_plans < 0:
            raise ValueError(f"model_plans={model_plans!r} must be an int >= 0 (the model's "
                             "plans tried beside the exact and uniform baselines)")
        self.model_plans = model_plans
        self.alpha = float(alpha)
        self.families = fams
        self.window, self.adjust_every, self.warmup_steps = window, adjust_every, warmup_steps
        self.bits, self.bucket_sizes = bits, bucket_sizes
        self.densities, self.ranks = densities, ranks
        self.rounding, self.error_feedback = rounding, error_feedback
        self.planner = planner
        self.assume_gbit = None if assume_gbit is None else float(assume_gbit)

    def to_config(self) -> dict:
        """Every constructor argument (``AutoCompression(**to_config())`` is these settings)."""
        t = self.trials
        return {"alpha": self.alpha, "families": list(self.families), "window": self.window,
                "adjust_every": self.adjust_every, "warmup_steps": self.warmup_steps,
                "bits": list(self.bits), "bucket_sizes": list(self.bucket_sizes),
                "densities": list(self.densities), "ranks": list(self.ranks),
                "rounding": None if self.rounding is None else self.rounding.value,
                "error_feedback": self.error_feedback, "planner": self.planner,
                "assume_gbit": self.assume_gbit, "objective": self.objective.value,
                "trial_steps": t.steps, "recheck_every": t.recheck_every,
                "drift_tolerance": t.drift_tolerance, "model_plans": self.model_plans,
                "trial_warmup_steps": t.warmup_steps, "trial_runoffs": t.runoffs}

    def __repr__(self) -> str:
        return (f"AutoCompression(alpha={self.alpha:g}, families={self.families}, "
                f"window={self.window}, adjust_every={self.adjust_every}, "
                f"warmup_steps={self.warmup_steps}, bits={self.bits}, "
                f"bucket_sizes={self.bucket_sizes}, densities={self.densities}, "
                f"ranks={self.ranks}, rounding="
                f"{None if self.rounding is None else self.rounding.value}, "
                f"error_feedback={self.error_feedback}, planner={self.planner}, "
                f"assume_gbit={self.assume_gbit}, objective={self.objective.value!r}, "
                f"trials={self.trials}, model_plans={self.model_plans})")


def default_policy(cfg: Config) -> Optional[AutoCompression]:
    """What ``Compression.none`` (the default ``compression=``) stands for in a gradient
    exchange under ``cfg.compression`` (``CGX_COMPRESSION``): the deciding exchange
    (``decide``, the default), auto with ``CGX_AUTO_OBJECTIVE`` (``auto``), each with the
    ``CGX_AUTO_*`` settings; None for ``quantize`` (the uniform CGX_COMPRESSION_* level), and
    for ``decide`` when ``CGX_COMPRESSION_QUANTIZATION_BITS=32`` turns compression off (the
    budget, the uniform level's error, is then zero: only exact could be kept)."""
    if cfg.compression is CompressionMode.QUANTIZE or (
            cfg.compression is CompressionMode.DECIDE and not cfg.quantization_enabled):
        return None
    objective = AutoObjective.TIME if cfg.compression is CompressionMode.DECIDE \
        else cfg.auto_objective
    return AutoCompression(alpha=cfg.auto_alpha, window=cfg.auto_window,
                           adjust_every=cfg.auto_adjust_every, objective=objective)
