"""What the communication cost, in numbers a person reads: scalars for TensorBoard and Keras
logs, and a one-screen summary (printed at shutdown with ``CGX_VERBOSE=1``).

Both work on the thread-safe totals from ``hvd.stats()`` (a
:class:`~cgx.collectives.reducer.ReduceStats` copy), framework-free: the torch
TensorBoard writer (``cgx.torch.log_stats``) and the Keras ``StatsCallback``
are thin layers over :func:`scalars`.

Bytes sent are counted where they leave, at the transport: every byte this rank hands to
cgx's transports for sending (gradients, their compressed forms and padding, sufficient
factors, the per-step status exchange, consistency checks, planning), in the dtype the
engine moves (a bool tensor travels as int32). Per collective, with ``W`` ranks and an
``n``-byte tensor handed over: allreduce ``2 (W - 1) / W * n`` (the ring allreduce of Gloo,
NCCL and MPI), allgather ``(W - 1) * n`` (every other rank needs the input; the ring each
engine runs has every rank transmit ``W - 1`` input-sized blocks), alltoall
``(W - 1) / W * n`` (the chunks for the others), broadcast ``(W - 1) * n`` on the root,
sendrecv ``n``; see :class:`cgx.comm.base.SentBytes`. TCP/IP headers are not counted (a
network interface counts them too).
"""

from __future__ import annotations

from typing import Optional

PHASES = ("compress", "wait", "reduce", "decompress", "plain", "total")


def scalars(stats, since=None) -> dict[str, float]:
    """Flat ``{name: value}`` of ``stats`` (minus ``since``, an earlier snapshot, if given).

    Names: ``cgx/bytes_sent``, ``cgx/bytes_sent/<collective>`` (allreduce, allgather,
    alltoall, broadcast, sendrecv), ``cgx/bytes_sent_per_step``, ``cgx/compression_ratio``,
    ``cgx/exposed_comm_s_per_step``, ``cgx/seconds/<phase>``, ``cgx/layer_error/<layer>``.
    """
    d_calls = stats.calls - (since.calls if since else 0)
    d_wire = stats.wire_bytes - (since.wire_bytes if since else 0)
    d_steps = stats.steps - (since.steps if since else 0)
    d_exposed = stats.exposed_seconds - (since.exposed_seconds if since else 0.0)
    fp32 = stats.seconds.get("_fp32_wire", 0.0) - (since.seconds.get("_fp32_wire", 0.0)
                                                   if since else 0.0)
    out = {"cgx/calls": float(d_calls), "cgx/bytes_sent": float(d_wire),
           "cgx/compression_ratio": fp32 / d_wire if d_wire else 1.0}
    for kind, n in stats.sent.items():
        out[f"cgx/bytes_sent/{kind}"] = float(n - (since.sent.get(kind, 0) if since else 0))
    if d_steps:
        out["cgx/bytes_sent_per_step"] = d_wire / d_steps
        out["cgx/exposed_comm_s_per_step"] = d_exposed / d_steps
    for phase in PHASES:
        v = stats.seconds.get(phase, 0.0) - (since.seconds.get(phase, 0.0) if since else 0.0)
        if v:
            out[f"cgx/seconds/{phase}"] = v
    for layer, err in stats.layer_error.items():
        out[f"cgx/layer_error/{layer}"] = float(err)
    return out


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def summary(stats, rank: int = 0, *, stalls: int = 0, worst_layers: int = 5,
            failed: Optional[BaseException] = None) -> str:
    """A one-screen report of one rank's communication (what ``CGX_VERBOSE=1`` prints at exit)."""
    lines = [f"cgx summary, rank {rank}"]
    lines.append(f"  collectives      {stats.calls:,} ({stats.numel:,} values, "
                 f"{_mb(stats.input_bytes)} uncompressed)")
    vs_fp32 = (f" ({stats.ratio:.1f}x less than fp32 ring allreduce)"
               if stats.seconds.get("_fp32_wire") else "")
    lines.append(f"  bytes sent       {_mb(stats.wire_bytes)}{vs_fp32}")
    if any(stats.sent.values()):
        lines.append("  by collective    " + ", ".join(
            f"{kind} {_mb(n)}" for kind, n in sorted(stats.sent.items(), key=lambda kv: -kv[1])
            if n))
    if stats.steps:
        lines.append(f"  optimizer steps  {stats.steps:,}: {_mb(stats.wire_bytes / stats.steps)}"
                     f" sent per step, {1e3 * stats.exposed_seconds / stats.steps:.1f} ms "
                     "exposed communication per step")
    phases = [f"{p} {stats.seconds[p]:.2f} s" for p in PHASES if stats.seconds.get(p)]
    if phases:
        lines.append("  time             " + ", ".join(phases))
    if stats.layer_error:
        worst = sorted(stats.layer_error.items(), key=lambda kv: -kv[1])[:worst_layers]
        lines.append("  layer error      " + ", ".join(f"{n} {e:.3f}" for n, e in worst) +
                     ("  (relative, largest first)" if len(stats.layer_error) > 1 else ""))
    if stalls:
        lines.append(f"  stall warnings   {stalls}")
    if failed is not None:
        lines.append(f"  FAILED           {failed}")
    return "\n".join(lines)
