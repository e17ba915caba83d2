"""Which layers are compressed, and how: per-layer rules on top of the config.

Defaults come from the environment (``cgx.Config``): every tensor is
quantized with ``bits``/``bucket_size``/``rounding``, except tensors with
fewer than ``minimal_size`` values and, with ``skip_1d``, 1-D tensors
(biases, norms). Rules refine that per layer name, without code changes,
from a dict or a YAML file (``CGX_COMPRESSION_CONFIG=rules.yaml``)::

    # rules.yaml: the first matching rule wins; patterns are shell globs
    # (fnmatch) on parameter names, or regular expressions after "re:".
    layers:
      - pattern: "embedding.*"
        exclude: true            # travels uncompressed
      - pattern: "re:^classifier\\.(weight|bias)$"
        bits: 8
      - pattern: "*.conv*.weight"
        bits: 2
        bucket_size: 512

A rule may set ``exclude``, ``bits``, ``bucket_size`` and ``rounding``; a
rule that names a layer also overrides ``minimal_size``/``skip_1d`` for it
(an explicit ``bits`` compresses even a bias). Example::

    rules = LayerRules.from_config(Config.from_env())
    spec = rules.spec_for("fc1.weight", (256, 784))    # QuantSpec or None
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
from typing import Any, Mapping, Optional, Sequence

from cgx.quant.codec import QuantSpec
from cgx.config import Config, Rounding, validate_bits, validate_bucket_size
from cgx.errors import ConfigError

_KEYS = {"pattern", "exclude", "bits", "bucket_size", "rounding"}


@dataclasses.dataclass(frozen=True)
class Rule:
    """One name pattern and what it sets (None: keep the default)."""

    pattern: str
    exclude: bool = False
    bits: Optional[int] = None
    bucket_size: Optional[int] = None
    rounding: Optional[Rounding] = None

    def matches(self, name: str) -> bool:
        if self.pattern.startswith("re:"):
            return re.search(self.pattern[3:], name) is not None
        return fnmatch.fnmatchcase(name, self.pattern)


def _parse_rule(raw: Any, where: str) -> Rule:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: a rule must be a mapping like {{pattern: 'fc.*', bits: 8}}, "
                          f"got {raw!r}")
    unknown = set(raw) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)}; a rule may set "
                          f"{sorted(_KEYS)}")
    pattern = raw.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        raise ConfigError(f"{where}: 'pattern' must be a non-empty string (a glob, or 're:' "
                          "followed by a regular expression)")
    if pattern.startswith("re:"):
        try:
            re.compile(pattern[3:])
        except re.error as exc:
            raise ConfigError(f"{where}: bad regular expression {pattern[3:]!r}: {exc}") from None
    exclude = raw.get("exclude", False)
    if not isinstance(exclude, bool):
        raise ConfigError(f"{where}: 'exclude' must be true or false, got {exclude!r}")
    bits = raw.get("bits")
    if bits is not None:
        validate_bits(bits, f"{where}: bits")
    bucket = raw.get("bucket_size")
    if bucket is not None:
        validate_bucket_size(bucket, f"{where}: bucket_size")
    rounding = raw.get("rounding")
    if rounding is not None:
        try:
            rounding = Rounding(str(rounding).lower())
        except ValueError:
            raise ConfigError(f"{where}: rounding {rounding!r} is not one of "
                              f"{[r.value for r in Rounding]}") from None
    return Rule(pattern, exclude, bits, bucket, rounding)


class LayerRules:
    """Decides a :class:`QuantSpec` (or None: uncompressed) per named tensor.

    Args:
        config: defaults (bits, bucket size, rounding, minimal size, skip_1d).
        rules: rules in priority order (first match wins).
    """

    def __init__(self, config: Optional[Config] = None, rules: Sequence[Rule] = ()):
        self.config = config or Config.from_env()
        self.rules = tuple(rules)

    @classmethod
    def from_config(cls, config: Optional[Config] = None,
                    rules: "Optional[Mapping | str | os.PathLike | Sequence]" = None
                    ) -> "LayerRules":
        """Rules from ``rules`` (dict, list or YAML path), else from ``config.layer_config``."""
        config = config or Config.from_env()
        source = rules if rules is not None else config.layer_config
        return cls(config, parse_rules(source) if source is not None else ())

    def rule_for(self, name: Optional[str]) -> Optional[Rule]:
        if name is None:
            return None
        return next((r for r in self.rules if r.matches(name)), None)

    def spec_for(self, name: Optional[str], shape: Sequence[int]) -> Optional[QuantSpec]:
        """QuantSpec for the tensor ``name`` of ``shape``, or None to send it uncompressed."""
        cfg = self.config
        rule = self.rule_for(name)
        if rule is not None and rule.exclude:
            return None
        bits = rule.bits if rule and rule.bits is not None else cfg.bits
        if not 1 <= bits <= 8:  # 32 (config or rule): no quantization
            return None
        explicit = rule is not None and rule.bits is not None
        numel = math.prod(shape)
        if not explicit and (numel < cfg.minimal_size or (cfg.skip_1d and len(shape) <= 1)):
            return None
        if numel == 0:
            return None
        return QuantSpec(bits,
                         rule.bucket_size if rule and rule.bucket_size else cfg.bucket_size,
                         rule.rounding if rule and rule.rounding else cfg.rounding)


def parse_rules(source) -> list[Rule]:
    """Rules from a YAML file path, a dict with a ``layers`` list, or a list of rule dicts."""
    where = "layer rules"
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.exists(path):
            raise ConfigError(f"layer rules file {path!r} does not exist (CGX_COMPRESSION_CONFIG "
                              "or the `rules` argument names it)")
        import yaml

        with open(path) as f:
            try:
                source = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"layer rules file {path!r} is not valid YAML: {exc}") from None
        where = path
    if isinstance(source, Mapping):
        unknown = set(source) - {"layers"}
        if unknown:
            raise ConfigError(f"{where}: unknown top-level key(s) {sorted(unknown)}; expected "
                              "'layers' (a list of rules)")
        source = source.get("layers", [])
    if isinstance(source, (str, bytes)) or not isinstance(source, Sequence):
        raise ConfigError(f"{where}: expected a list of rules, got {type(source).__name__}")
    return [_parse_rule(r, f"{where}: rule {i}") for i, r in enumerate(source)]
