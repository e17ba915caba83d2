"""``Compression.planned(...)``: the settings of the planned exchange.

This object only holds and validates the settings; the work is done by
:mod:`cgx.policy.planner` (calibration, the simulator, the planner) through
:class:`cgx.policy.planner.schedule.PlannedSchedule`, driven by the gradient plan of
``DistributedOptimizer``.
"""

from __future__ import annotations

from typing import Optional

from cgx.compression.policy import Policy
from cgx.compression.trial_settings import TrialSettings


class PlannedCompression(Policy):
    """Per tensor, exact or quantized, whichever the planner predicts makes the step shorter.

    The first ``calibrate_steps`` steps run the uniform quantized exchange while the
    backward's gradient-ready times are recorded; then every rank measures the link
    (alpha-beta per collective) and the quantizer, the ranks agree on the profile, and
    each tensor gets its option (see :mod:`cgx.policy.planner`). A tensor whose exchange hides
    under backward stays exact: it costs no time and gets no compression error.

    Args:
        bits, bucket_size: the quantized option's level (default 4 bits, bucket 1024).
        calibrate_steps: steps traced before the plan (>= 2: the first is warm-up).
        assume_gbit: plan for a link of this rate (Gbit/s per rank) instead of the
            measured one: e.g. to see what a slower production network would get.
        error_feedback: keep the quantization residuals of compressed tensors.
        replan_every: steps between drift checks after the plan (0: never re-plan).
            A check compares the measured step (first gradient ready to the end of the
            exchange; the slowest rank's median since the last check) with the plan's
            prediction; beyond ``drift_tolerance`` the link and the quantizer are measured
            again and the plan remade. A ratio the model keeps missing after a re-plan is
            taken as its bias: from then on only a change of the ratio triggers a re-plan.
        drift_tolerance: relative drift that triggers a re-plan (default 0.25).
        trials: after each plan, let the step clock decide (:mod:`cgx.policy.trials.planned_decider`):
            all exact (fused), all at the fixed level and the planner's plan each run
            ``trial_steps`` measured steps (after ``trial_warmup_steps``), the ranks agree
            on the times, the fastest is kept. The kept plan is then checked every
            ``replan_every`` steps: a step off its trial by more than ``drift_tolerance``,
            or a link probe that moved, re-plans and tries again. False: the planner's
            plan travels as predicted, checked against its prediction.
        trial_steps, trial_warmup_steps: see ``trials``.
        trial_runoffs: extra turns for the plans measured within 10% of the fastest, their
            times pooled; after the first, only for those still tied with it (0: none).
        device_profile: for CUDA gradients, where compression may run
            (:class:`cgx.policy.planner.placement.DeviceProfile`: the GPU's kernels or the host's
            C path on pinned copies, per tensor, weighed by the planner; see
            docs/placement.md). None (default): measured on the GPU at each plan
            (``calibrate_device``, about a second); for CPU gradients, no choice. Given
            for CPU gradients, the plan weighs it all the same and each tensor's codec
            runs where the plan says (the host for a CPU tensor either way).
    """

    name = "planned"

    def __init__(self, bits: int = 4, bucket_size: int = 1024, calibrate_steps: int = 5,
                 assume_gbit: Optional[float] = None, error_feedback: bool = False,
                 replan_every: int = 50, drift_tolerance: float = 0.25, trials: bool = True,
                 trial_steps: int = 3, trial_warmup_steps: int = 3, device_profile=None,
                 trial_runoffs: int = 3):
        from cgx.config import validate_bits, validate_bucket_size
        self.bits = validate_bits(bits, "Compression.planned bits")
        if self.bits > 8:
            raise ValueError(f"bits={bits} must be in 1..8: the planner weighs exact against "
                             "quantized itself")
        self.bucket_size = validate_bucket_size(bucket_size, "Compression.planned bucket_size")
        if isinstance(calibrate_steps, bool) or not isinstance(calibrate_steps, int) \
                or calibrate_steps < 2:
            raise ValueError(f"calibrate_steps={calibrate_steps!r} must be an int >= 2 (the "
                             "first traced step is a warm-up)")
        from cgx.config import validate_gbit
        validate_gbit(assume_gbit, "assume_gbit")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"error_feedback must be True or False, got {error_feedback!r}")
        if isinstance(replan_every, bool) or not isinstance(replan_every, int) or replan_every < 0:
            raise ValueError(f"replan_every={replan_every!r} must be an int >= 0 (steps between "
                             "drift checks; 0 never re-plans)")
        if isinstance(drift_tolerance, bool) or not isinstance(drift_tolerance, (int, float)) \
                or not drift_tolerance > 0:
            raise ValueError(f"drift_tolerance={drift_tolerance!r} must be > 0 (e.g. 0.25: "
                             "re-plan when the measured step is 25% off the prediction)")
        self.calibrate_steps = calibrate_steps
        self.replan_every = replan_every
        self.drift_tolerance = float(drift_tolerance)
        self.assume_gbit = None if assume_gbit is None else float(assume_gbit)
        self.error_feedback = error_feedback
        self.device_profile = device_profile  # checked by cgx.policy.planner.schedule
        if not isinstance(trials, bool):
            raise TypeError(f"trials must be True or False, got {trials!r}")
        self.trials = TrialSettings(steps=trial_steps, warmup_steps=trial_warmup_steps,
                                    runoffs=trial_runoffs,
                                    recheck_every=replan_every,
                                    drift_tolerance=self.drift_tolerance) if trials else None

    def to_config(self) -> dict:
        """Every constructor argument but ``device_profile`` (measured on the GPU at each
        plan when not given; a given one is not saved, with a warning)."""
        if self.device_profile is not None:
            import warnings
            warnings.warn("Compression.planned(device_profile=...) is not part of its config: "
                          "a rebuilt one measures the device again", stacklevel=3)
        t = self.trials or TrialSettings()
        return {"bits": self.bits, "bucket_size": self.bucket_size,
                "calibrate_steps": self.calibrate_steps, "assume_gbit": self.assume_gbit,
                "error_feedback": self.error_feedback, "replan_every": self.replan_every,
                "drift_tolerance": self.drift_tolerance, "trials": self.trials is not None,
                "trial_steps": t.steps, "trial_warmup_steps": t.warmup_steps,
                "trial_runoffs": t.runoffs}

    def __repr__(self) -> str:
        return (f"PlannedCompression(bits={self.bits}, bucket_size={self.bucket_size}, "
                f"calibrate_steps={self.calibrate_steps}, assume_gbit={self.assume_gbit}, "
                f"error_feedback={self.error_feedback}, replan_every={self.replan_every}, "
                f"drift_tolerance={self.drift_tolerance}, trials={self.trials})")
