"""The one config object: every variable parsed, every bad value named."""

import pytest

from cgx.config import (ENV_VARS, AutoObjective, CompensationChoice, CompressionMode, Config,
                        Hierarchy, ReductionType, Rounding, TorchBackend, TransportKind,
                        validate_bits, validate_bucket_size)
from cgx.errors import ConfigError


def test_defaults():
    """Every default, as README's configuration table states it."""
    cfg = Config.from_env({})
    assert (cfg.bits, cfg.bucket_size, cfg.minimal_size) == (4, 1024, 1024)
    assert cfg.rounding is Rounding.STOCHASTIC and cfg.skip_1d and not cfg.error_feedback
    assert cfg.compensation is CompensationChoice.AUTO and cfg.seed == 0
    assert cfg.layer_config is None and cfg.compression is CompressionMode.DECIDE
    assert (cfg.auto_alpha, cfg.auto_window, cfg.auto_adjust_every) == (1.0, 10, 1000)
    assert cfg.auto_objective is AutoObjective.BYTES
    assert cfg.fusion_buffer_mb == 64.0 and cfg.fusion_buffer_bytes == 64 << 20
    assert cfg.inner_reduction is ReductionType.SRA and cfg.hierarchical is Hierarchy.AUTO
    assert cfg.cross_reduction is ReductionType.SRA
    assert (cfg.pipeline_chunk_mb, cfg.cpu_threads) == (16.0, 1)
    assert cfg.transport is TransportKind.AUTO and cfg.backend is TorchBackend.AUTO
    assert cfg.timeline is None
    assert (cfg.start_timeout_s, cfg.timeout_s, cfg.stall_warning_s) == (120.0, 300.0, 60.0)
    assert cfg.check_consistency and not cfg.verbose and cfg.stats_every == 100
    assert cfg.quantization_enabled
    assert cfg == Config()


def test_stall_warning_names():
    """CGX_STALL_WARNING_S, else Horovod's HOROVOD_STALL_CHECK_TIME_SECONDS; 0 or
    HOROVOD_STALL_CHECK_DISABLE turns it off (unless CGX_STALL_WARNING_S is set)."""
    stall = lambda env: Config.from_env(env).stall_warning_s  # noqa: E731
    assert stall({"HOROVOD_STALL_CHECK_TIME_SECONDS": "30"}) == 30.0
    assert stall({"HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "CGX_STALL_WARNING_S": "5"}) == 5.0
    assert stall({"CGX_STALL_WARNING_S": "0"}) == 0.0
    assert stall({"HOROVOD_STALL_CHECK_DISABLE": "1"}) == 0.0
    assert stall({"HOROVOD_STALL_CHECK_DISABLE": "1", "CGX_STALL_WARNING_S": "7"}) == 7.0
    assert Config.from_env({"CGX_STATS_EVERY": "0"}).stats_every == 0


def test_every_variable_is_read():
    env = {
        "CGX_COMPRESSION_QUANTIZATION_BITS": "8", "CGX_COMPRESSION_BUCKET_SIZE": "512",
        "CGX_COMPRESSION_MINIMAL_SIZE": "0", "CGX_COMPRESSION_ROUNDING": "Nearest",
        "CGX_COMPRESSION_SKIP_1D": "off", "CGX_COMPRESSION_ERROR_FEEDBACK": "yes",
        "CGX_COMPRESSION_CONFIG": "rules.yaml", "CGX_SEED": "0x10",
        "CGX_FUSION_BUFFER_SIZE_MB": "16", "CGX_INNER_REDUCTION_TYPE": "Ring",
        "CGX_CROSS_REDUCTION_TYPE": "allgather", "CGX_HIERARCHICAL": "on",
        "CGX_PIPELINE_CHUNK_MB": "2", "CGX_CPU_THREADS": "2", "CGX_TRANSPORT": "mpi",
        "CGX_TIMELINE": "t.json", "CGX_TIMEOUT_S": "60", "CGX_VERBOSE": "1",
    }
    cfg = Config.from_env(env)
    assert (cfg.bits, cfg.bucket_size, cfg.minimal_size, cfg.seed) == (8, 512, 0, 16)
    assert cfg.rounding is Rounding.NEAREST and not cfg.skip_1d and cfg.error_feedback
    assert cfg.layer_config == "rules.yaml" and cfg.fusion_buffer_mb == 16.0
    assert cfg.inner_reduction is ReductionType.RING
    assert cfg.cross_reduction is ReductionType.ALLGATHER
    assert cfg.hierarchical is Hierarchy.ON and cfg.pipeline_chunk_mb == 2.0
    assert cfg.cpu_threads == 2 and cfg.transport is TransportKind.MPI
    assert (cfg.timeline, cfg.timeout_s, cfg.verbose) == ("t.json", 60.0, True)
    # Every variable read here is documented for `cgxrun --help-env` and the README.
    assert set(env) <= set(ENV_VARS)


def test_horovod_fallbacks():
    cfg = Config.from_env({"HOROVOD_FUSION_THRESHOLD": str(32 << 20), "HOROVOD_TIMELINE": "h.json"})
    assert cfg.fusion_buffer_mb == 32.0 and cfg.timeline == "h.json"
    cfg = Config.from_env({"HOROVOD_FUSION_THRESHOLD": "1", "CGX_FUSION_BUFFER_SIZE_MB": "8",
                           "HOROVOD_TIMELINE": "h.json", "CGX_TIMELINE": "c.json"})
    assert cfg.fusion_buffer_mb == 8.0 and cfg.timeline == "c.json"  # CGX_* wins


def test_bits_32_turns_quantization_off():
    assert not Config.from_env({"CGX_COMPRESSION_QUANTIZATION_BITS": "32"}).quantization_enabled


@pytest.mark.parametrize("env,match", [
    ({"CGX_COMPRESSION_QUANTIZATION_BITS": "0"},
     r"CGX_COMPRESSION_QUANTIZATION_BITS=0 is out of range; expected \[1, 32\]"),
    ({"CGX_COMPRESSION_QUANTIZATION_BITS": "9"},
     r"CGX_COMPRESSION_QUANTIZATION_BITS=9 is out of range; expected \[1, 8\] \(or 32"),
    ({"CGX_COMPRESSION_QUANTIZATION_BITS": "33"}, r"=33 is out of range"),
    ({"CGX_COMPRESSION_QUANTIZATION_BITS": "four"},
     r"CGX_COMPRESSION_QUANTIZATION_BITS='four' is not an integer"),
    ({"CGX_COMPRESSION_BUCKET_SIZE": "0"}, r"CGX_COMPRESSION_BUCKET_SIZE=0 is out of range"),
    ({"CGX_COMPRESSION_BUCKET_SIZE": "100"},
     r"CGX_COMPRESSION_BUCKET_SIZE=100 is not a multiple of 8"),
    ({"CGX_COMPRESSION_BUCKET_SIZE": "1k"}, r"CGX_COMPRESSION_BUCKET_SIZE='1k' is not an integer"),
    ({"CGX_COMPRESSION_MINIMAL_SIZE": "-1"}, r"CGX_COMPRESSION_MINIMAL_SIZE=-1 is out of range"),
    ({"CGX_COMPRESSION_ROUNDING": "up"},
     r"CGX_COMPRESSION_ROUNDING='up' is not valid; expected one of: nearest, stochastic"),
    ({"CGX_COMPRESSION_SKIP_1D": "maybe"}, r"CGX_COMPRESSION_SKIP_1D='maybe' is not a boolean"),
    ({"CGX_SEED": "-3"}, r"CGX_SEED=-3 is out of range"),
    ({"CGX_FUSION_BUFFER_SIZE_MB": "0"}, r"CGX_FUSION_BUFFER_SIZE_MB=0.0 is out of range"),
    ({"CGX_FUSION_BUFFER_SIZE_MB": "lots"}, r"CGX_FUSION_BUFFER_SIZE_MB='lots' is not a number"),
    ({"HOROVOD_FUSION_THRESHOLD": "12"}, r"HOROVOD_FUSION_THRESHOLD=12 is out of range.*bytes"),
    ({"CGX_INNER_REDUCTION_TYPE": "tree"}, r"expected one of: sra, ring, allgather"),
    ({"CGX_HIERARCHICAL": "yes"}, r"CGX_HIERARCHICAL='yes' is not valid; expected one of: auto"),
    ({"CGX_TRANSPORT": "nccl"}, r"CGX_TRANSPORT='nccl' is not valid"),
    ({"CGX_PIPELINE_CHUNK_MB": "0.001"}, r"CGX_PIPELINE_CHUNK_MB=0.001 is out of range"),
    ({"CGX_CPU_THREADS": "0"}, r"CGX_CPU_THREADS=0 is out of range"),
    ({"CGX_TIMEOUT_S": "0.5"}, r"CGX_TIMEOUT_S=0.5 is out of range"),
])
def test_bad_values_name_the_variable_value_and_range(env, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_env(env)


@pytest.mark.parametrize("kwargs,match", [
    (dict(bits=0), r"bits \(CGX_COMPRESSION_QUANTIZATION_BITS\)=0 is not supported"),
    (dict(bits=True), "must be an int"),
    (dict(bucket_size=12), "multiple of 8"),
    (dict(bucket_size=8.0), "must be an int"),
    (dict(minimal_size=-1), "minimal_size=-1 must be >= 0"),
    (dict(fusion_buffer_mb=0), r"fusion_buffer_mb=0 must be in \(0, 4096\]"),
    (dict(pipeline_chunk_mb=5000), r"pipeline_chunk_mb=5000 must be in \(0, 4096\]"),
    (dict(cpu_threads=0), r"cpu_threads=0 must be in \[1, 256\]"),
    (dict(rounding="nearest"), "rounding must be a cgx.config.Rounding"),
    (dict(inner_reduction="sra"), "inner_reduction must be a cgx.config.ReductionType"),
])
def test_direct_construction_is_validated_too(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Config(**kwargs)


def test_replace_validates():
    assert Config().replace(bits=2).bits == 2
    with pytest.raises(ConfigError, match="bits"):
        Config().replace(bits=9)


def test_validators():
    assert validate_bits(32) == 32 and validate_bucket_size(8) == 8
    with pytest.raises(ConfigError, match="where=9"):
        validate_bits(9, "where")
    with pytest.raises(ConfigError, match=r"\[8, 16777216\]"):
        validate_bucket_size(1 << 25)
    assert issubclass(ConfigError, ValueError)  # generic handlers keep working
