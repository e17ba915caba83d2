"""Command line of the slow-link simulator.

    python -m benchmarks.netsim selftest --rate 1gbit [--rate 10gbit --rate none]
    python -m benchmarks.netsim cleanup [--all] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Optional

from .errors import NetnsUnavailable
from .namespaces import NAMESPACE_PREFIX, cleanup_leftovers
from .network import SlowNetwork
from .shaping import Shaping


def _rate_arg(value: str) -> Optional[str]:
    if value.lower() in ("none", "unshaped", "off"):
        return None
    try:
        Shaping(rate=value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _summary(rate: Optional[str], n_ranks: int, results: list[dict[str, Any]],
             launch_s: float) -> dict[str, Any]:
    ar = [r["allreduce"] for r in results]
    nbytes = ar[0]["bytes"]
    # A collective is as slow as its slowest rank, repetition by repetition.
    ar_times = [max(ts) for ts in zip(*(a["times_s"] for a in ar))]
    ar_med = statistics.median(ar_times)
    # Ring/SRA allreduce: each rank sends (and receives) 2(N-1)/N of the buffer.
    wire_bits = 2 * (n_ranks - 1) / n_ranks * nbytes * 8
    sr = results[1]["sendrecv"]
    sr_med = statistics.median(sr["times_s"])
    rate_bps = Shaping(rate=rate).bits_per_second
    return {
        "rate": rate or "unshaped",
        "n_ranks": n_ranks,
        "bytes": nbytes,
        "allreduce_s": ar_med,
        "allreduce_min_s": min(ar_times),
        "allreduce_all_s": ar_times,
        "allreduce_gbit_s": wire_bits / ar_med / 1e9,
        "allreduce_ideal_s": wire_bits / rate_bps if rate_bps else None,
        "sendrecv_s": sr_med,
        "sendrecv_gbit_s": sr["bytes"] * 8 / sr_med / 1e9,
        "correct": all(a["correct"] for a in ar) and sr["correct"],
        "launch_s": launch_s,
    }


def selftest(args: argparse.Namespace) -> int:
    rates = args.rate or ["1gbit"]
    print(f"netsim selftest: {args.ranks} ranks, {args.size_mb:g} MB fp32 Gloo allreduce and one-way "
          f"send/recv, median of {args.reps} (tbf latency {args.latency})")
    header = (f"{'link':>10} {'burst':>7} {'allreduce':>10} {'busbw':>12} {'ideal':>8} "
              f"{'send/recv':>10} {'one-way':>12} {'launch':>8}")
    print(header)
    rows, ok = [], True
    for rate in rates:
        try:
            with SlowNetwork(n_ranks=args.ranks, rate=rate, burst=args.burst, latency=args.latency) as net:
                start = time.perf_counter()
                results = net.run_function(
                    "benchmarks.netsim.probes:selftest_probe",
                    {"size_mb": args.size_mb, "reps": args.reps}, timeout=args.timeout)
                launch_s = time.perf_counter() - start
        except NetnsUnavailable as err:
            print(f"skipped: {err.reason}", file=sys.stderr)
            return 2
        row = _summary(rate, args.ranks, results, launch_s)
        rows.append(row)
        ok = ok and row["correct"]
        ideal = f"{row['allreduce_ideal_s']:.3f} s" if row["allreduce_ideal_s"] else "-"
        row["burst"] = net.shaping.effective_burst if rate else "-"
        print(f"{row['rate']:>10} {row['burst']:>7} {row['allreduce_s']:>8.3f} s "
              f"{row['allreduce_gbit_s']:>6.2f} Gbit/s {ideal:>8} "
              f"{row['sendrecv_s']:>8.3f} s {row['sendrecv_gbit_s']:>6.2f} Gbit/s {launch_s:>6.1f} s"
              + ("" if row["correct"] else "  WRONG RESULT"))
    print("busbw: 2(N-1)/N x bytes x 8 / time, what each rank sent per second; ideal: that at the tbf rate "
          "(TCP/IP framing adds ~5%); launch: whole run incl. process start")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if ok else 1


def cleanup(args: argparse.Namespace) -> int:
    names = cleanup_leftovers(all_owners=args.all, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    print(f"{verb} {len(names)} namespace(s)" + (": " + " ".join(names) if names else ""))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.netsim",
        description="Simulated slow links between ranks (network namespaces + tbf).")
    sub = parser.add_subparsers(dest="command", required=True)

    st = sub.add_parser("selftest", help="measure Gloo allreduce and send/recv over the simulated link")
    st.add_argument("--rate", action="append", type=_rate_arg,
                    help="tbf rate such as 1gbit, 10gbit, 100mbit, or 'none' (repeatable; default 1gbit)")
    st.add_argument("--burst", default=None,
                    help="tbf bucket (default: 256kb, or 2 ms of the rate if more)")
    st.add_argument("--latency", default="50ms", help="tbf queue bound (not an added delay)")
    st.add_argument("--ranks", type=int, default=2)
    st.add_argument("--size-mb", type=float, default=100.0)
    st.add_argument("--reps", type=int, default=3)
    st.add_argument("--timeout", type=float, default=300.0,
                    help="seconds per rate before the ranks are stopped")
    st.add_argument("--json", help="also write the figures to this file")
    st.set_defaults(func=selftest)

    cl = sub.add_parser("cleanup",
                        help=f"delete leftover '{NAMESPACE_PREFIX}*' namespaces of runs that are gone")
    cl.add_argument("--all", action="store_true",
                    help="also those of runs still alive (make sure none is running)")
    cl.add_argument("--dry-run", action="store_true", help="only list them")
    cl.set_defaults(func=cleanup)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
