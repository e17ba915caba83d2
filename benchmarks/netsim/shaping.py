"""Validation of the ``tc ... tbf`` parameters (rate, burst, latency).

The strings are handed to ``tc`` unchanged once they pass, so the accepted
units are a subset of tc's own (see tc(8), "PARAMETERS"). Each parser returns
the value in base units so callers can compute expected transfer times.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# tc's rate units. Careful: tc reads "bps" as *bytes* per second, "bit" as bits.
_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
    "tbps": 8 * 10**12,
}
# tc's size units (tc uses powers of 1024 for these).
_SIZE_UNITS = {
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "kbit": 1024 // 8,
    "mbit": 1024**2 // 8,
    "gbit": 1024**3 // 8,
}
_TIME_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0,
    "ms": 1e-3, "msec": 1e-3, "msecs": 1e-3,
    "us": 1e-6, "usec": 1e-6, "usecs": 1e-6,
}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

# A tbf bucket smaller than one full Ethernet frame never lets a packet through.
MIN_BURST_BYTES = 1600
# Default bucket: DESIGN.md's 256 KiB, or 2 ms worth of the rate if that is more.
# The kernel refills the bucket only when its timer fires, and on a busy 2-core
# machine that is late: at 10 Gbit/s a 256 KiB bucket (0.2 ms) let raw TCP reach
# only ~6.7 Gbit/s here, a 2.5 MB one the unshaped (CPU-bound) rate.
DEFAULT_BURST_BYTES = 256 * 1024
DEFAULT_BURST_S = 0.002


def _split(value: object, what: str, example: str) -> tuple[float, str]:
    if not isinstance(value, str):
        raise TypeError(
            f"{what} must be a string such as {example!r}, got {type(value).__name__} {value!r}")
    match = _NUMBER_UNIT.match(value)
    if match is None:
        raise ValueError(f"{what} {value!r} is not '<number><unit>', e.g. {example!r}")
    return float(match.group(1)), match.group(2).lower()


def parse_rate(rate: str) -> int:
    """Bits per second of a tc rate string.

    Args:
        rate: a number and one of tc's units: ``bit kbit mbit gbit tbit`` (bits/s,
            powers of 1000) or ``bps kbps mbps gbps tbps`` (tc reads these as
            *bytes*/s).

    Returns:
        The rate in bits per second (> 0).

    Example:
        >>> parse_rate("1gbit")
        1000000000
    """
    number, unit = _split(rate, "rate", "1gbit")
    if unit not in _RATE_UNITS:
        raise ValueError(
            f"rate {rate!r} has unit {unit or '(none)'!r}; expected one of "
            f"{', '.join(_RATE_UNITS)} (e.g. '100mbit', '1gbit', '10gbit'), "
            "or rate=None for an unshaped link"
        )
    bits = int(round(number * _RATE_UNITS[unit]))
    if bits <= 0:
        raise ValueError(f"rate {rate!r} is zero; give a positive rate, or rate=None for an unshaped link")
    return bits


def parse_size(size: str, what: str = "burst") -> int:
    """Bytes of a tc size string: ``b``, ``kb``/``k``, ``mb``/``m``, ``gb``/``g``, ``kbit``, ...

    tc counts these in powers of 1024.
    """
    number, unit = _split(size, what, "256kb")
    if unit not in _SIZE_UNITS:
        raise ValueError(f"{what} {size!r} has unit {unit or '(none)'!r}; "
                         f"expected one of {', '.join(_SIZE_UNITS)} (e.g. '256kb')")
    return int(round(number * _SIZE_UNITS[unit]))


def parse_time(value: str, what: str = "latency") -> float:
    """Seconds of a tc time string (``s``, ``ms``, ``us`` and their long forms)."""
    number, unit = _split(value, what, "50ms")
    if unit not in _TIME_UNITS:
        raise ValueError(f"{what} {value!r} has unit {unit or '(none)'!r}; "
                         f"expected one of {', '.join(_TIME_UNITS)} (e.g. '50ms')")
    seconds = number * _TIME_UNITS[unit]
    if seconds <= 0:
        raise ValueError(f"{what} {value!r} must be positive")
    return seconds


@dataclass(frozen=True)
class Shaping:
    """One tbf setting, validated. ``rate=None`` means the link is not shaped.

    ``burst=None`` picks 256 KiB, or 2 ms of the rate when that is larger
    (2.5 MB at 10 Gbit/s; see ``DEFAULT_BURST_S``). ``latency`` is tbf's
    queue bound (how long a packet may wait for tokens before it is dropped),
    *not* an added propagation delay: netem, which would add delay, is not
    available on our machines.
    """

    rate: Optional[str] = "1gbit"
    burst: Optional[str] = None
    latency: str = "50ms"

    def __post_init__(self) -> None:
        if self.rate is None:
            return
        parse_rate(self.rate)
        burst = parse_size(self.effective_burst, "burst")
        if burst < MIN_BURST_BYTES:
            raise ValueError(
                f"burst {self.burst!r} is {burst} bytes; tbf needs at least one full frame "
                f"({MIN_BURST_BYTES} bytes), e.g. '256kb'"
            )
        parse_time(self.latency, "latency")

    @property
    def effective_burst(self) -> str:
        """The burst handed to tc (``burst``, or the default described above)."""
        if self.burst is not None:
            return self.burst
        if self.rate is None:
            return f"{DEFAULT_BURST_BYTES // 1024}kb"
        nbytes = max(DEFAULT_BURST_BYTES, parse_rate(self.rate) / 8 * DEFAULT_BURST_S)
        return f"{int(nbytes // 1024)}kb"

    @property
    def bits_per_second(self) -> Optional[int]:
        """The shaped rate in bits/s, or None when unshaped."""
        return None if self.rate is None else parse_rate(self.rate)

    def tc_args(self) -> list[str]:
        """The ``tbf`` arguments of ``tc qdisc add dev X root ...``."""
        if self.rate is None:
            raise ValueError("an unshaped link (rate=None) has no tbf qdisc")
        return ["tbf", "rate", self.rate, "burst", self.effective_burst, "latency", self.latency]

    def describe(self) -> str:
        if self.rate is None:
            return "unshaped"
        return f"tbf rate {self.rate} burst {self.effective_burst} latency {self.latency}"
