"""One configuration object, fed by environment variables.

Every ``CGX_*`` variable (and the Horovod variables cgx honours) is parsed and
validated here and nowhere else. Training recipes change compression without a
code change::

    CGX_COMPRESSION_QUANTIZATION_BITS=4 CGX_COMPRESSION_BUCKET_SIZE=1024 \\
        cgxrun -np 2 python train.py

Code can also build a :class:`Config` directly, or override fields of the
environment's config with ``Config.from_env().replace(bits=8)``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Mapping, Optional

from cgx.errors import ConfigError

# Quantization levels cgx packs natively. 32 means "no quantization" (as in the
# original CGX), which is also what CGX_COMPRESSION_QUANTIZATION_BITS=32 selects.
MIN_BITS, MAX_BITS, NO_QUANTIZATION_BITS = 1, 8, 32
MAX_BUCKET_SIZE = 1 << 24


class Rounding(enum.Enum):
    """How a value between two quantization levels picks its code.

    NEAREST:    q = floor((x - min) / unit + 0.5); error <= unit / 2, biased.
    STOCHASTIC: q = floor((x - min) / unit + r), r ~ U[0, 1) from a counter-based
                hash of (seed, step, tensor id, element index); unbiased,
                error < unit, reproducible on every rank.
    """

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


class ReductionType(enum.Enum):
    """Algorithm of a compressed allreduce (``CGX_INNER_REDUCTION_TYPE``).

    SRA:       scatter-reduce-allgather; two quantizations per element.
    RING:      ring reduce-scatter + allgather; requantizes at every hop.
    ALLGATHER: every rank gathers everyone's compressed buffer and reduces locally.
    """

    SRA = "sra"
    RING = "ring"
    ALLGATHER = "allgather"


class TransportKind(enum.Enum):
    """Engine that moves bytes between ranks (``CGX_TRANSPORT``)."""

    AUTO = "auto"  # Horovod if launched under it and importable, else torch.distributed
    TORCH = "torch"  # torch.distributed (Gloo on CPU, NCCL on GPU)
    MPI = "mpi"  # mpi4py communicators
    HOROVOD = "horovod"  # Horovod's own collectives


class TorchBackend(enum.Enum):
    """torch.distributed backend that ``cgx.init()`` creates (``CGX_BACKEND``).

    Only used when cgx creates the process group itself; a group the user
    already initialized is reused as it is.
    """

    AUTO = "auto"  # nccl on cuda:local_rank when CUDA is available, else gloo on CPU
    GLOO = "gloo"  # CPU tensors, also on machines with GPUs
    NCCL = "nccl"  # CUDA tensors on cuda:local_rank; needs a CUDA build and a GPU


class CompressionMode(enum.Enum):
    """What ``compression=Compression.none`` (the default) means (``CGX_COMPRESSION``)."""

    DECIDE = "decide"  # the deciding exchange: Compression.auto(objective="time") with the
    # CGX_AUTO_* settings; where no whole-model plan can be made, as QUANTIZE
    QUANTIZE = "quantize"  # uniform CGX quantization with the CGX_COMPRESSION_* settings
    AUTO = "auto"  # per-layer levels within an error budget (Compression.auto, cgx.policy.levels)


class AutoObjective(enum.Enum):
    """What ``Compression.auto`` minimizes within its error budget (``CGX_AUTO_OBJECTIVE``)."""

    BYTES = "bytes"  # the bytes sent (L-GreCo's knapsack)
    TIME = "time"  # the measured step: the model proposes plans, trials keep the fastest


class CompensationChoice(enum.Enum):
    """How quantization's dropped values come back when error feedback is on
    (``CGX_COMPENSATION``; the algorithms: ``cgx.exchange.compensation``)."""

    AUTO = "auto"  # by the optimizer: moving average under Adam-type ones, classic otherwise;
    # Compression.auto measures it per layer (cgx.policy.levels.probe)
    CLASSIC = "classic"  # all of it, added to the next step's values
    MOVING_AVERAGE = "moving_average"  # a moving average of it, clipped to the bucket's range


class Hierarchy(enum.Enum):
    """Two-level reduction: inside a node, then across nodes (``CGX_HIERARCHICAL``)."""

    AUTO = "auto"  # on when there are several nodes with several ranks each (calls with
    # error-feedback residuals reduce flat: two levels quantize more than once)
    ON = "on"  # always (error feedback refused)
    OFF = "off"


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int,
         extra: str = "") -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip(), 0)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; expected a whole number "
                          f"in [{lo}, {hi}]{extra}") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range; expected [{lo}, {hi}]{extra}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; expected a value in "
                          f"[{lo}, {hi}]") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range; expected [{lo}, {hi}]")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def _enum(env: Mapping[str, str], name: str, cls: type[enum.Enum], default: enum.Enum):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return cls(raw.strip().lower())
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise ConfigError(f"{name}={raw!r} is not valid; expected one of: {allowed} "
                          "(case-insensitive)") from None


def validate_gbit(value, what: str):
    """A link rate in Gbit/s (> 0) or None (measure the link); errors say what to pass."""
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and value > 0):
        raise ValueError(f"{what}={value!r} must be a rate > 0 in Gbit/s, or None to measure "
                         "the link")
    return None if value is None else float(value)


MIN_SECRET_LENGTH = 32


def validate_job_secret(value: Optional[str]) -> Optional[str]:
    """CGX_JOB_SECRET: None, or at least 32 printable characters (its value is never shown)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigError(f"job_secret (CGX_JOB_SECRET) must be a string, got "
                          f"{type(value).__name__}")
    if len(value) < MIN_SECRET_LENGTH or not value.isprintable() or value != value.strip():
        raise ConfigError(f"CGX_JOB_SECRET holds {len(value)} characters; expected at least "
                          f"{MIN_SECRET_LENGTH} printable ones without surrounding spaces, e.g. "
                          "the output of python -c 'import secrets; print(secrets.token_hex(32))'"
                          " (or unset it and let cgxrun draw one)")
    return value


def validate_bits(bits: int, where: str = "bits") -> int:
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise ConfigError(f"{where} must be an int, got {type(bits).__name__}")
    if not (MIN_BITS <= bits <= MAX_BITS or bits == NO_QUANTIZATION_BITS):
        raise ConfigError(f"{where}={bits} is not supported; expected {MIN_BITS}..{MAX_BITS} "
                          f"(or {NO_QUANTIZATION_BITS} for no quantization)")
    return bits


def validate_bucket_size(bucket_size: int, where: str = "bucket_size") -> int:
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise ConfigError(f"{where} must be an int, got {type(bucket_size).__name__}")
    if not 8 <= bucket_size <= MAX_BUCKET_SIZE or bucket_size % 8:
        raise ConfigError(f"{where}={bucket_size} is not supported; expected a multiple of 8 in "
                          f"[8, {MAX_BUCKET_SIZE}] (each bucket's codes fill whole bytes), "
                          "e.g. 512, 1024 or 2048")
    return bucket_size


@dataclasses.dataclass(frozen=True)
class Config:
    """Every knob of cgx, with its environment variable and default.

    Build it from the environment with :meth:`from_env`; fields are validated
    in ``__post_init__`` so a hand-made Config is checked the same way.
    """

    # --- quantization (CGX) --------------------------------------------------
    bits: int = 4  # CGX_COMPRESSION_QUANTIZATION_BITS: 1..8, 32 = off
    bucket_size: int = 1024  # CGX_COMPRESSION_BUCKET_SIZE: values sharing one (unit, min)
    minimal_size: int = 1024  # CGX_COMPRESSION_MINIMAL_SIZE: smaller tensors go uncompressed
    rounding: Rounding = Rounding.STOCHASTIC  # CGX_COMPRESSION_ROUNDING
    skip_1d: bool = True  # CGX_COMPRESSION_SKIP_1D: biases/norms go uncompressed
    error_feedback: bool = False  # CGX_COMPRESSION_ERROR_FEEDBACK: keep residuals
    compensation: CompensationChoice = CompensationChoice.AUTO  # CGX_COMPENSATION
    seed: int = 0  # CGX_SEED: stochastic-rounding seed (same on every rank)
    layer_config: Optional[str] = None  # CGX_COMPRESSION_CONFIG: YAML of per-layer rules
    compression: CompressionMode = CompressionMode.DECIDE  # CGX_COMPRESSION: decide | quantize | auto
    auto_alpha: float = 1.0  # CGX_AUTO_ALPHA: auto's error budget, x the uniform default's
    auto_window: int = 10  # CGX_AUTO_WINDOW: steps of statistics per plan
    auto_adjust_every: int = 1000  # CGX_AUTO_ADJUST_EVERY: steps between plans
    auto_objective: AutoObjective = AutoObjective.BYTES  # CGX_AUTO_OBJECTIVE: bytes | time

    # --- collectives ---------------------------------------------------------
    fusion_buffer_mb: float = 64.0  # CGX_FUSION_BUFFER_SIZE_MB (else HOROVOD_FUSION_THRESHOLD bytes)
    inner_reduction: ReductionType = ReductionType.SRA  # CGX_INNER_REDUCTION_TYPE
    cross_reduction: ReductionType = ReductionType.SRA  # CGX_CROSS_REDUCTION_TYPE
    hierarchical: Hierarchy = Hierarchy.AUTO  # CGX_HIERARCHICAL
    pipeline_chunk_mb: float = 16.0  # CGX_PIPELINE_CHUNK_MB: largest pipeline block (compress/send overlap)
    cpu_threads: int = 1  # CGX_CPU_THREADS: threads for CPU (de)compression

    # --- runtime -------------------------------------------------------------
    transport: TransportKind = TransportKind.AUTO  # CGX_TRANSPORT
    backend: TorchBackend = TorchBackend.AUTO  # CGX_BACKEND: torch.distributed backend
    # CGX_START_TIMEOUT_S (else HOROVOD_START_TIMEOUT): how long init() waits for
    # the other ranks to publish rank 0's address before it fails.
    start_timeout_s: float = 120.0
    timeline: Optional[str] = None  # CGX_TIMELINE (else HOROVOD_TIMELINE): Chrome trace path
    # CGX_TIMEOUT_S: a collective that has not finished after this many seconds fails
    # on every rank, naming the ranks that did not take part; applies to the process
    # groups cgx creates too. Minutes, not Horovod's "wait forever".
    timeout_s: float = 300.0
    # CGX_STALL_WARNING_S (else HOROVOD_STALL_CHECK_TIME_SECONDS): warn (once per
    # interval) while a collective waits this long for other ranks; 0 turns it off.
    stall_warning_s: float = 60.0
    # CGX_CHECK_CONSISTENCY: ranks agree on each collective's name, shapes, dtypes,
    # op and compression before it runs (a mismatch is a clear error on every rank).
    check_consistency: bool = True
    verbose: bool = False  # CGX_VERBOSE: log decisions; a one-screen summary at shutdown
    # CGX_STATS_EVERY: every this many steps, measure each compressed layer's relative
    # compression error (one extra local quantize pass of that step); 0: never.
    stats_every: int = 100
    # CGX_JOB_SECRET: the job's secret; cgx.init() admits only ranks that prove they know
    # it (HMAC challenge-response on the rendezvous store, cgx.launch.gate). cgxrun draws
    # one per job; unset: nobody is checked. Kept out of repr() and printed output.
    job_secret: Optional[str] = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        validate_bits(self.bits, "bits (CGX_COMPRESSION_QUANTIZATION_BITS)")
        validate_bucket_size(self.bucket_size, "bucket_size (CGX_COMPRESSION_BUCKET_SIZE)")
        if self.minimal_size < 0:
            raise ConfigError(f"minimal_size={self.minimal_size} must be >= 0")
        if not 0 < self.fusion_buffer_mb <= 4096:
            raise ConfigError(f"fusion_buffer_mb={self.fusion_buffer_mb} must be in (0, 4096]")
        if not 0 < self.pipeline_chunk_mb <= 4096:
            raise ConfigError(f"pipeline_chunk_mb={self.pipeline_chunk_mb} must be in (0, 4096]")
        if not 1 <= self.cpu_threads <= 256:
            raise ConfigError(f"cpu_threads={self.cpu_threads} must be in [1, 256]")
        if not 0 < self.timeout_s <= 7 * 24 * 3600:
            raise ConfigError(f"timeout_s={self.timeout_s} must be in (0, 604800]")
        if not 0 <= self.stall_warning_s <= 7 * 24 * 3600:
            raise ConfigError(f"stall_warning_s={self.stall_warning_s} must be in [0, 604800]")
        if not 0 < self.start_timeout_s <= 7 * 24 * 3600:
            raise ConfigError(f"start_timeout_s={self.start_timeout_s} must be in (0, 604800]")
        validate_job_secret(self.job_secret)
        if not self.auto_alpha > 0:
            raise ConfigError(f"auto_alpha={self.auto_alpha} must be > 0 (CGX_AUTO_ALPHA)")
        if not 1 <= self.auto_window <= self.auto_adjust_every:
            raise ConfigError(f"auto_window={self.auto_window} must be in [1, auto_adjust_every="
                              f"{self.auto_adjust_every}] (CGX_AUTO_WINDOW, CGX_AUTO_ADJUST_EVERY)")
        for name, cls in (("rounding", Rounding), ("compression", CompressionMode),
                          ("inner_reduction", ReductionType),
                          ("cross_reduction", ReductionType), ("hierarchical", Hierarchy),
                          ("transport", TransportKind), ("backend", TorchBackend)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a cgx.config.{cls.__name__}, "
                                  f"got {getattr(self, name)!r}")

    @property
    def quantization_enabled(self) -> bool:
        return self.bits != NO_QUANTIZATION_BITS

    @property
    def fusion_buffer_bytes(self) -> int:
        return int(self.fusion_buffer_mb * (1 << 20))

    def replace(self, **changes) -> "Config":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> "Config":
        """Parse and validate every cgx variable of ``env`` (default ``os.environ``).

        Raises:
            ConfigError: naming the variable, the value and the allowed range.
        """
        env = os.environ if env is None else env
        fusion_mb, start_timeout, stall = _with_horovod_names(env, cls)
        timeline = env.get("CGX_TIMELINE") or env.get("HOROVOD_TIMELINE") or None
        bits, bucket = _quantization_level(env, cls)
        return cls(
            bits=bits,
            bucket_size=bucket,
            minimal_size=_int(env, "CGX_COMPRESSION_MINIMAL_SIZE", cls.minimal_size, 0, 1 << 40),
            rounding=_enum(env, "CGX_COMPRESSION_ROUNDING", Rounding, cls.rounding),
            skip_1d=_bool(env, "CGX_COMPRESSION_SKIP_1D", cls.skip_1d),
            error_feedback=_bool(env, "CGX_COMPRESSION_ERROR_FEEDBACK", cls.error_feedback),
            compensation=_enum(env, "CGX_COMPENSATION", CompensationChoice, cls.compensation),
            seed=_int(env, "CGX_SEED", cls.seed, 0, 2**32 - 1),
            layer_config=env.get("CGX_COMPRESSION_CONFIG") or None,
            compression=_enum(env, "CGX_COMPRESSION", CompressionMode, cls.compression),
            auto_alpha=_float(env, "CGX_AUTO_ALPHA", cls.auto_alpha, 1e-6, 1e6),
            auto_window=_int(env, "CGX_AUTO_WINDOW", cls.auto_window, 1, 1 << 30),
            auto_adjust_every=_int(env, "CGX_AUTO_ADJUST_EVERY", cls.auto_adjust_every, 1,
                                   1 << 30),
            auto_objective=_enum(env, "CGX_AUTO_OBJECTIVE", AutoObjective, cls.auto_objective),
            fusion_buffer_mb=fusion_mb,
            inner_reduction=_enum(env, "CGX_INNER_REDUCTION_TYPE", ReductionType,
                                  cls.inner_reduction),
            cross_reduction=_enum(env, "CGX_CROSS_REDUCTION_TYPE", ReductionType,
                                  cls.cross_reduction),
            hierarchical=_enum(env, "CGX_HIERARCHICAL", Hierarchy, cls.hierarchical),
            pipeline_chunk_mb=_float(env, "CGX_PIPELINE_CHUNK_MB", cls.pipeline_chunk_mb,
                                     0.0625, 4096.0),
            cpu_threads=_int(env, "CGX_CPU_THREADS", cls.cpu_threads, 1, 256),
            transport=_enum(env, "CGX_TRANSPORT", TransportKind, cls.transport),
            backend=_enum(env, "CGX_BACKEND", TorchBackend, cls.backend),
            start_timeout_s=start_timeout,
            timeline=timeline,
            timeout_s=_float(env, "CGX_TIMEOUT_S", cls.timeout_s, 1.0, 7 * 24 * 3600.0),
            stall_warning_s=stall,
            check_consistency=_bool(env, "CGX_CHECK_CONSISTENCY", cls.check_consistency),
            verbose=_bool(env, "CGX_VERBOSE", cls.verbose),
            stats_every=_int(env, "CGX_STATS_EVERY", cls.stats_every, 0, 1 << 30),
            job_secret=env.get("CGX_JOB_SECRET") or None,
        )


def _with_horovod_names(env: Mapping[str, str], defaults) -> tuple[float, float, float]:
    """Fusion buffer (MB), start timeout and stall warning (s): the CGX_ variable, else
    Horovod's (HOROVOD_FUSION_THRESHOLD, HOROVOD_START_TIMEOUT, HOROVOD_STALL_CHECK_*)."""
    fusion_mb = _float(env, "CGX_FUSION_BUFFER_SIZE_MB", -1.0, 0.0009765625, 4096.0)
    if fusion_mb < 0:
        hvd_bytes = _int(env, "HOROVOD_FUSION_THRESHOLD", 64 << 20, 1024, 4 << 30,
                         " bytes (Horovod's fusion threshold)")
        fusion_mb = hvd_bytes / (1 << 20)
    start_timeout = _float(env, "CGX_START_TIMEOUT_S", -1.0, 1.0, 7 * 24 * 3600.0)
    if start_timeout < 0:
        start_timeout = _float(env, "HOROVOD_START_TIMEOUT", defaults.start_timeout_s, 1.0,
                               7 * 24 * 3600.0)
    stall = _float(env, "CGX_STALL_WARNING_S", -1.0, 0.0, 7 * 24 * 3600.0)
    if stall < 0:
        stall = _float(env, "HOROVOD_STALL_CHECK_TIME_SECONDS", defaults.stall_warning_s, 0.0,
                       7 * 24 * 3600.0)
    if _bool(env, "HOROVOD_STALL_CHECK_DISABLE", False) and \
            env.get("CGX_STALL_WARNING_S") is None:
        stall = 0.0
    return fusion_mb, start_timeout, stall


def _quantization_level(env: Mapping[str, str], defaults) -> tuple[int, int]:
    """CGX_COMPRESSION_QUANTIZATION_BITS and CGX_COMPRESSION_BUCKET_SIZE, checked."""
    bits_extra = f" (or {NO_QUANTIZATION_BITS} for no quantization)"
    bits = _int(env, "CGX_COMPRESSION_QUANTIZATION_BITS", defaults.bits, MIN_BITS,
                NO_QUANTIZATION_BITS, bits_extra)
    if MAX_BITS < bits < NO_QUANTIZATION_BITS:
        raise ConfigError(f"CGX_COMPRESSION_QUANTIZATION_BITS={bits} is out of range; "
                          f"expected [{MIN_BITS}, {MAX_BITS}]{bits_extra}")
    bucket = _int(env, "CGX_COMPRESSION_BUCKET_SIZE", defaults.bucket_size, 8, MAX_BUCKET_SIZE,
                  " and a multiple of 8")
    if bucket % 8:
        raise ConfigError(f"CGX_COMPRESSION_BUCKET_SIZE={bucket} is not a multiple of 8; "
                          f"expected a multiple of 8 in [8, {MAX_BUCKET_SIZE}], e.g. 1024")
    return bits, bucket


# Documented list of variables, used by `cgxrun --help-env` and the README.
ENV_VARS = {
    "CGX_COMPRESSION_QUANTIZATION_BITS": "bits per value, 1..8; 32 disables quantization (default 4)",
    "CGX_COMPRESSION_BUCKET_SIZE": "values per (unit, min) bucket, multiple of 8 (default 1024)",
    "CGX_COMPRESSION_MINIMAL_SIZE": "tensors with fewer elements travel uncompressed (default 1024)",
    "CGX_COMPRESSION_ROUNDING": "nearest | stochastic (default stochastic)",
    "CGX_COMPRESSION_SKIP_1D": "1-D tensors (biases, norms) travel uncompressed (default 1)",
    "CGX_COMPRESSION_ERROR_FEEDBACK": "keep the quantization residual and add it next step (default 0)",
    "CGX_COMPENSATION": "auto | classic | moving_average: how error feedback adds the residual "
                        "back; auto: a moving average under Adam-type optimizers, and "
                        "Compression.auto measures it per layer (default auto)",
    "CGX_COMPRESSION_CONFIG": "YAML file of per-layer rules (exclude, bits, bucket size)",
    "CGX_SEED": "seed of stochastic rounding, the same on every rank (default 0)",
    "CGX_COMPRESSION": "decide | quantize | auto: what Compression.none means for a gradient "
                       "exchange; decide: trials keep the fastest measured plan within the "
                       "error budget (Compression.auto(objective='time')); quantize: uniform "
                       "CGX_COMPRESSION_* quantization; auto: per-layer levels with "
                       "CGX_AUTO_OBJECTIVE (default decide)",
    "CGX_AUTO_ALPHA": "auto: total error allowed, x the uniform default's (default 1.0)",
    "CGX_AUTO_WINDOW": "auto: steps of gradient statistics per plan (default 10)",
    "CGX_AUTO_ADJUST_EVERY": "auto: steps between plans (default 1000)",
    "CGX_AUTO_OBJECTIVE": "auto: bytes (fewest within the error budget) or time (trials keep "
                          "the fastest measured plan within it); default bytes",
    "CGX_FUSION_BUFFER_SIZE_MB": "fusion buffer size in MB (default 64; else HOROVOD_FUSION_THRESHOLD)",
    "CGX_INNER_REDUCTION_TYPE": "sra | ring | allgather, inside a node (default sra)",
    "CGX_CROSS_REDUCTION_TYPE": "sra | ring | allgather, across nodes (default sra)",
    "CGX_HIERARCHICAL": "auto | on | off: reduce inside nodes first (default auto)",
    "CGX_PIPELINE_CHUNK_MB": "largest pipeline block, MB of fp32 (compression overlaps sending; default 16)",
    "CGX_CPU_THREADS": "threads for CPU (de)compression (default 1)",
    "CGX_TRANSPORT": "auto | torch | mpi | horovod (default auto)",
    "CGX_BACKEND": "auto | gloo | nccl: torch.distributed backend cgx.init() creates "
                   "(default auto: nccl if CUDA is available, else gloo)",
    "CGX_START_TIMEOUT_S": "seconds cgx.init() waits for rank 0's address (default 120; "
                           "else HOROVOD_START_TIMEOUT)",
    "CGX_TIMELINE": "write a Chrome-trace timeline here (else HOROVOD_TIMELINE)",
    "CGX_TIMEOUT_S": "seconds before a stuck collective fails on every rank, naming the "
                     "missing ranks (default 300)",
    "CGX_STALL_WARNING_S": "warn while a collective waits this long for other ranks; 0: off "
                           "(default 60; else HOROVOD_STALL_CHECK_TIME_SECONDS)",
    "CGX_CHECK_CONSISTENCY": "ranks agree on names, shapes, dtypes, ops and compression before "
                             "a collective runs (default 1)",
    "CGX_VERBOSE": "log what cgx decides, and print a one-screen summary per rank at "
                   "shutdown (default 0)",
    "CGX_STATS_EVERY": "measure each compressed layer's relative compression error every N "
                       "steps (hvd.stats().layer_error; default 100, 0: never)",
    "CGX_JOB_SECRET": "the job's secret: only ranks that prove they know it (HMAC-SHA256 "
                      "challenge-response) join the job; cgxrun draws one per job, set the "
                      "same value on every host for multi-host --gloo launches; never printed "
                      "(default unset: nobody is checked; docs/security.md)",
}
