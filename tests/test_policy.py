"""``cgx.policy.resolve``: every spelling of ``compression=`` becomes one frozen policy."""

from __future__ import annotations

import dataclasses

import pytest

from cgx.policy.update_rule import UpdateRule
from cgx.compression import Compression
from cgx.config import CompressionMode, Config, Rounding
from cgx.policy import ExchangePolicy, GradMode, resolve
from cgx.quant.codec import QuantSpec

FIXED = Config(compression=CompressionMode.QUANTIZE)


@pytest.mark.parametrize("given,mode", [
    (Compression.exact, GradMode.EXACT), (Compression.none, GradMode.QUANTIZE),
    (None, GradMode.QUANTIZE), (Compression.quantize(bits=2), GradMode.QUANTIZE),
    (Compression.fp16, GradMode.SUMMABLE), (Compression.bf16(), GradMode.SUMMABLE),
    (Compression.topk(0.1), GradMode.PER_TENSOR), (Compression.powersgd(rank=2),
                                                   GradMode.PER_TENSOR),
    ("auto", GradMode.AUTO), (Compression.auto(objective="time"), GradMode.AUTO),
    (Compression.planned(), GradMode.PLANNED)])
def test_every_spelling_has_a_mode(given, mode):
    policy = resolve(given, FIXED)
    assert isinstance(policy, ExchangePolicy) and policy.mode is mode
    assert policy.chooses == (mode in (GradMode.AUTO, GradMode.PLANNED))
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.mode = GradMode.EXACT


def test_the_default_follows_cgx_compression():
    assert resolve(None, Config()).mode is GradMode.AUTO  # decide: the deciding exchange
    assert resolve(None, Config(bits=32)).mode is GradMode.EXACT
    assert resolve(None, FIXED.replace(bits=3)).quant_spec == \
        QuantSpec(3, 1024, Rounding.STOCHASTIC)


def test_a_quantizer_sets_the_level_its_error_feedback_warmup_rotation_and_seed():
    comp = Compression.quantize(bits=3, bucket_size=256, rounding="nearest", seed=9,
                                error_feedback=True, warmup_steps=4, rotate=True)
    policy = resolve(comp, FIXED)
    assert policy.quant_spec == QuantSpec(3, 256, Rounding.NEAREST, rotate=True)
    assert policy.error_feedback and policy.warmup_steps == 4 and policy.seed == 9
    assert not resolve(Compression.quantize(bits=3), FIXED).error_feedback
    assert resolve(Compression.exact, FIXED.replace(seed=5)).seed == 5


def test_auto_keeps_residuals_by_the_update_rule_and_an_override_wins():
    assert resolve("auto", FIXED, UpdateRule.LINEAR).error_feedback
    assert not resolve("auto", FIXED, UpdateRule.ADAPTIVE).error_feedback
    settings = Compression.auto()
    forced = resolve(settings, FIXED, UpdateRule.ADAPTIVE, error_feedback=True)
    assert forced.error_feedback and settings.error_feedback is None  # the caller's untouched
    # a fixed setting's override is the configured default's
    assert resolve(None, FIXED, error_feedback=True).error_feedback
    assert not resolve(Compression.quantize(bits=4), FIXED, error_feedback=True).error_feedback


def test_bad_input_is_refused_with_the_accepted_forms():
    with pytest.raises(TypeError, match="compression must be a cgx compressor"):
        resolve(3, FIXED)
