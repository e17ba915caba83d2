"""Per-layer rules: which tensors are compressed, and how."""

import pytest

from cgx.config import Config, Rounding
from cgx.errors import ConfigError
from cgx.rules import LayerRules, parse_rules


def test_defaults_follow_config():
    rules = LayerRules(Config(bits=4, bucket_size=512, minimal_size=100))
    assert rules.spec_for("fc.weight", (20, 10)).bits == 4
    assert rules.spec_for("fc.weight", (20, 10)).bucket_size == 512
    assert rules.spec_for("fc.weight", (5, 10)) is None  # below minimal_size
    assert rules.spec_for("fc.bias", (4096,)) is None  # 1-D skipped by default
    assert LayerRules(Config(skip_1d=False, minimal_size=0)).spec_for("b", (4096,)) is not None
    assert LayerRules(Config(bits=32)).spec_for("fc.weight", (200, 100)) is None
    assert rules.spec_for("x", (0, 10)) is None


def test_rules_first_match_glob_and_regex(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("layers:\n"
                    "  - {pattern: 'emb.*', exclude: true}\n"
                    "  - {pattern: 're:^head\\.(weight|bias)$', bits: 8, rounding: nearest}\n"
                    "  - {pattern: '*.weight', bits: 2, bucket_size: 128}\n")
    rules = LayerRules.from_config(Config(minimal_size=0), str(path))
    assert rules.spec_for("emb.weight", (100, 100)) is None
    head = rules.spec_for("head.bias", (10,))  # explicit bits compress even a bias
    assert head.bits == 8 and head.rounding is Rounding.NEAREST
    conv = rules.spec_for("conv.weight", (64, 3, 3, 3))
    assert (conv.bits, conv.bucket_size) == (2, 128)
    assert rules.spec_for("conv.bias", (64,)) is None
    # CGX_COMPRESSION_CONFIG is the same file through the config.
    env_rules = LayerRules.from_config(Config.from_env({"CGX_COMPRESSION_CONFIG": str(path)}))
    assert env_rules.spec_for("emb.weight", (100, 100)) is None


@pytest.mark.parametrize("source,match", [
    ({"layerz": []}, "unknown top-level"),
    ("/does/not/exist.yaml", "does not exist"),
    ([{"pattern": "a", "bitz": 3}], "unknown key"),
    ([{"bits": 3}], "'pattern' must be"),
    ([{"pattern": "re:("}], "bad regular expression"),
    ([{"pattern": "a", "exclude": "yes"}], "'exclude' must be true or false"),
    ([{"pattern": "a", "bits": 9}], "bits=9"),
    ([{"pattern": "a", "bucket_size": 100}], "multiple of 8"),
    ([{"pattern": "a", "rounding": "up"}], "rounding 'up'"),
    (["a"], "must be a mapping"),
    (42, "expected a list of rules"),
])
def test_rule_validation(source, match):
    with pytest.raises(ConfigError, match=match):
        parse_rules(source)


def test_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("layers: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse_rules(str(path))
