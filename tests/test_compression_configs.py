"""Compressors and policies describe themselves and are rebuilt from that description.

Every constructor argument is set to a value other than its default, the object goes
through its config (and JSON, as Keras saves it), and the rebuilt object must *behave*
the same: compressors give the same payloads for the same inputs; policies hold the same
settings (every attribute, the trial settings included). Comparing config with config
could not see a field the config drops.
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

from cgx.compression import (AutoCompression, Compression, ErrorFeedback, PlannedCompression,
                             PowerSGDCompressor, QuantizeCompressor, TopKCompressor, configs)
from cgx.compression.casts import BF16Compressor, FP16Compressor

# Every constructor argument, none at its default.
NON_DEFAULT = {
    QuantizeCompressor: dict(bits=3, bucket_size=512, rounding="nearest", seed=7, rotate=True),
    TopKCompressor: dict(density=0.05),
    PowerSGDCompressor: dict(rank=3, min_compression_rate=1.5, start_step=2, warm_start=False,
                             error_feedback=False, orthogonalization_epsilon=1e-8, seed=5),
    FP16Compressor: dict(predivide=4.0),
    BF16Compressor: dict(predivide=2.0),
    AutoCompression: dict(alpha=1.5, families=("quantize", "topk"), window=3, adjust_every=9,
                          warmup_steps=2, bits=(2, 4), bucket_sizes=(256,), densities=(0.02,),
                          ranks=(2,), rounding="nearest", error_feedback=True, planner=True,
                          assume_gbit=2.5, objective="time", trial_steps=4, recheck_every=50,
                          drift_tolerance=0.3, model_plans=1, trial_warmup_steps=1,
                          trial_runoffs=0),
    PlannedCompression: dict(bits=2, bucket_size=256, calibrate_steps=3, assume_gbit=1.0,
                             error_feedback=True, replan_every=7, drift_tolerance=0.5,
                             trials=False, trial_steps=2, trial_warmup_steps=1,
                             trial_runoffs=1),
}


def _round_trip(obj):
    return configs.from_config(json.loads(json.dumps(configs.to_config(obj))))


@pytest.mark.parametrize("cls", list(NON_DEFAULT), ids=lambda c: c.__name__)
def test_every_argument_is_set_off_its_default(cls):
    """The table above really sets every argument (else a dropped one could hide)."""
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items()
              if n != "self"}
    skipped = {"device_profile"} if cls is PlannedCompression else set()
    assert set(NON_DEFAULT[cls]) == set(params) - skipped
    for name, value in NON_DEFAULT[cls].items():
        assert value != params[name].default, name


def _payloads(comp, steps=2):
    torch.manual_seed(0)
    g = torch.randn(24, 40)
    out = []
    for _ in range(steps):
        payload, ctx = comp.compress(g.clone(), name="layer")
        out.append(comp.decompress(payload, ctx))
    return out


@pytest.mark.parametrize("cls", [QuantizeCompressor, TopKCompressor, PowerSGDCompressor,
                                 FP16Compressor, BF16Compressor], ids=lambda c: c.__name__)
def test_compressors_rebuilt_behave_the_same(cls):
    comp = cls(**NON_DEFAULT[cls])
    back = _round_trip(comp)
    assert type(back) is cls
    for a, b in zip(_payloads(comp), _payloads(back)):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_wrapped_and_warmed_up_compressors_round_trip():
    comp = Compression.quantize(bits=2, bucket_size=256, error_feedback=True, seed=3,
                                warmup_steps=5, rotate=True)
    back = _round_trip(comp)
    assert isinstance(back, ErrorFeedback) and back.warmup_steps == 5
    for a, b in zip(_payloads(comp, 3), _payloads(back, 3)):  # the residuals feed back alike
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [AutoCompression, PlannedCompression], ids=lambda c: c.__name__)
def test_policies_rebuilt_hold_the_same_settings(cls):
    policy = cls(**NON_DEFAULT[cls])
    back = _round_trip(policy)
    assert type(back) is cls
    assert vars(back) == vars(policy)


def test_stateless_classes_come_back_as_themselves():
    for comp in (Compression.none, Compression.exact, Compression.fp16, Compression.bf16):
        assert _round_trip(comp) is comp


def test_a_user_compressor_cannot_describe_itself():
    class Mine:
        @staticmethod
        def compress(t):
            return t, None

        @staticmethod
        def decompress(t, ctx):
            return t

    from cgx.compression import as_compressor
    with pytest.raises(TypeError, match="cannot describe itself|cannot be described"):
        configs.to_config(as_compressor(Mine))
    with pytest.raises(ValueError, match="unknown compression type 'zip'"):
        configs.from_config({"type": "zip"})
    with pytest.raises(ValueError, match="'type' key"):
        configs.from_config(["fp16"])


def test_a_registered_family_is_rebuilt_from_its_config():
    class Halve(QuantizeCompressor):
        config_type = "halve-test"

    configs.register(Halve)
    try:
        back = _round_trip(Halve(bits=5))
        assert type(back) is Halve and back.bits == 5
    finally:
        configs.TYPES.pop("halve-test")
