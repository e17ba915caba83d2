"""Fuzzing the functional allreduce: random tensor lists, dtypes, shapes (0-d and empty
included), ops, scale factors, compressors and call forms, on 2, 3 and 4 real ranks,
against an exact reduction computed by every rank from all ranks' inputs.

Hypothesis draws the cases (at least 500 per run; seed from CGX_FUZZ_SEED, else
random, and printed on failure); each rank runs them all in one process, so
one spawn per world size covers every case.
"""

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from spawn import run_gloo

pytestmark = pytest.mark.multiproc

N_CASES = 500
DTYPES = ["float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool", "complex64"]
OPS = ["Sum", "Average", "Min", "Max", "Product"]
FORMS = ["allreduce", "allreduce_", "allreduce_async", "grouped_allreduce",
         "grouped_allreduce_", "reducescatter"]

_tensor = st.fixed_dictionaries({
    "dtype": st.sampled_from(DTYPES),
    "shape": st.one_of(st.just(()), st.lists(st.integers(0, 40), min_size=1, max_size=3)),
})
_case = st.fixed_dictionaries({
    "tensors": st.lists(_tensor, min_size=1, max_size=3),
    "op": st.sampled_from(OPS),
    "pre": st.sampled_from([1.0, 1.0, 0.5, 2.0, 0.3]),
    "post": st.sampled_from([1.0, 1.0, 0.5, 2.0, 0.7]),
    "compression": st.sampled_from(["none", "none", "fp16", "quantize8"]),
    "form": st.sampled_from(FORMS),
    "seed": st.integers(0, 2**31 - 1),
})


def _cases(n: int, seed_value: int) -> list:
    """``n`` cases drawn by hypothesis (each made valid: see ``_fix``)."""
    out = []

    @seed(seed_value)
    @settings(max_examples=n, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(_case)
    def draw(case):
        out.append(_fix(case))

    draw()
    return out


def _fix(case: dict) -> dict:
    """Keep a case within what the API defines (documented refusals are tested elsewhere)."""
    dts = [t["dtype"] for t in case["tensors"]]
    if any(d == "complex64" for d in dts) and case["op"] not in ("Sum", "Average"):
        case["op"] = "Sum"  # complex Min/Max/Product is refused with a ValueError
    if case["form"] in ("allreduce", "allreduce_", "allreduce_async", "reducescatter"):
        case["tensors"] = case["tensors"][:1]
    if case["form"] == "reducescatter" and not case["tensors"][0]["shape"]:
        case["tensors"][0]["shape"] = [5]  # rows to split
    if case["form"] not in ("allreduce", "reducescatter") or case["op"] not in ("Sum", "Average") or \
            any(d not in ("float32", "float16", "bfloat16") for d in dts):
        case["compression"] = "none"  # compressors apply to float Sum/Average
    if case["compression"] != "none":
        case["pre"] = case["post"] = 1.0
    if case["op"] == "Product" and any(d in ("int8", "uint8", "int16") for d in dts):
        case["pre"] = 1.0  # keep products of small integers inside their range (no overflow)
    return case


def _value(dtype: str, shape, seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    dt = getattr(torch, dtype)
    if dtype == "bool":
        return torch.rand(shape, generator=g) < 0.6
    if dtype in ("uint8",):
        return torch.randint(0, 4, shape, generator=g).to(dt)
    if dtype.startswith("int"):
        return torch.randint(-2, 3, shape, generator=g).to(dt)
    if dtype == "complex64":
        return torch.complex(torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    return (torch.randn(shape, generator=g) * 2).to(dt)


def _scaled(x: torch.Tensor, f: float) -> torch.Tensor:
    """The documented rule (cgx.comm.base.scale_) in float64 arithmetic."""
    if f == 1.0:
        return x
    if x.dtype == torch.bool:
        return x
    if x.is_complex() or x.is_floating_point():
        return x.to(torch.complex128 if x.is_complex() else torch.float64) * f
    return (x.to(torch.float64) * f).trunc().to(x.dtype)


def _expected(inputs: list, op: str, pre: float, post: float, world: int) -> torch.Tensor:
    x0 = inputs[0]
    xs = [_scaled(x, pre) for x in inputs]
    if x0.dtype == torch.bool:
        xs = [x.to(torch.int64) for x in xs]
    elif not (x0.is_complex() or x0.is_floating_point()):
        xs = [x.to(torch.int64) for x in xs]
    else:
        xs = [x.to(torch.complex128 if x0.is_complex() else torch.float64) for x in xs]
    stacked = torch.stack(xs)
    if op in ("Sum", "Average"):
        r = stacked.sum(0)
    elif op == "Min":
        r = stacked.min(0).values if stacked.numel() else stacked.sum(0)
    elif op == "Max":
        r = stacked.max(0).values if stacked.numel() else stacked.sum(0)
    else:
        r = stacked.prod(0)
    factor = post / world if op == "Average" else post
    if x0.dtype == torch.bool:
        return _scaled(r, factor).ne(0) if factor != 1.0 else r.ne(0)
    if not (x0.is_complex() or x0.is_floating_point()):
        return _scaled(r, factor).to(x0.dtype)
    return r * factor


def _tolerance(dtype: str, compression: str, inputs: list, world: int) -> tuple:
    if compression == "quantize8":
        span = max(float(x.float().max() - x.float().min()) if x.numel() else 0.0
                   for x in inputs)
        # Two quantizations of a sum of `world` values (SRA), 8 bits: well within this,
        # plus the rounding of the tensor's own dtype.
        rtol, atol = _tolerance(dtype, "none", inputs, world)
        return rtol, atol + 2.0 * world * world * span / 255
    if compression == "fp16" or dtype == "float16":
        return 2e-2, 2e-2 * world
    if dtype == "bfloat16":
        return 6e-2, 6e-2 * world
    if dtype in ("float32", "complex64"):
        return 1e-5, 1e-5
    return 1e-12, 1e-12


def _run_cases(rank, world, cases):
    import cgx.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    comp = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16,
            "quantize8": hvd.Compression.quantize(bits=8, rounding="nearest")}
    failures = []
    for k, case in enumerate(cases):
        specs = case["tensors"]
        mine = [_value(t["dtype"], tuple(t["shape"]), case["seed"] + i, rank)
                for i, t in enumerate(specs)]
        op = getattr(hvd, case["op"])
        kw = dict(op=op, prescale_factor=case["pre"], postscale_factor=case["post"],
                  name=f"case{k}")
        try:
            form = case["form"]
            if form == "allreduce":
                got = [hvd.allreduce(mine[0], compression=comp[case["compression"]], **kw)]
            elif form == "allreduce_":
                t = mine[0].clone()
                hvd.allreduce_(t, **kw)
                got = [t]
            elif form == "allreduce_async":
                got = [hvd.synchronize(hvd.allreduce_async(mine[0], **kw))]
            elif form == "reducescatter":
                got = [hvd.reducescatter(mine[0], compression=comp[case["compression"]], **kw)]
            elif form == "grouped_allreduce":
                got = hvd.grouped_allreduce(mine, **kw)
            else:
                ts = [m.clone() for m in mine]
                hvd.grouped_allreduce_(ts, **kw)
                got = ts
        except Exception as e:  # noqa: BLE001 - every case must work
            failures.append((k, f"raised {type(e).__name__}: {e}"))
            continue
        for i, (t, g) in enumerate(zip(specs, got)):
            inputs = [_value(t["dtype"], tuple(t["shape"]), case["seed"] + i, r)
                      for r in range(world)]
            want = _expected(inputs, case["op"], case["pre"], case["post"], world)
            if form == "reducescatter":  # this rank's rows, Horovod's split
                base, extra = divmod(want.shape[0], world)
                start = rank * base + min(rank, extra)
                want = want[start: start + base + (rank < extra)]
                mine[i] = mine[i][start: start + base + (rank < extra)]
            if g.dtype != mine[i].dtype or tuple(g.shape) != tuple(mine[i].shape):
                failures.append((k, f"tensor {i}: got {g.dtype}{tuple(g.shape)}, want "
                                    f"{mine[i].dtype}{tuple(mine[i].shape)}"))
                continue
            rtol, atol = _tolerance(t["dtype"], case["compression"], inputs, world)
            ok = torch.equal(g, want) if not (g.is_floating_point() or g.is_complex()) else \
                torch.allclose(g.to(want.dtype), want, rtol=rtol, atol=atol, equal_nan=True)
            if not ok:
                failures.append((k, f"tensor {i}: got {g.flatten()[:6].tolist()}, want "
                                    f"{want.flatten()[:6].tolist()}"))
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fuzz_allreduce_against_exact_reduction(world):
    seed = int(os.environ.get("CGX_FUZZ_SEED", random.randrange(2**31)))
    cases = _cases(N_CASES, seed)
    assert len(cases) >= N_CASES
    outs = run_gloo(_run_cases, world, cases, timeout=600)
    failures = sorted({f for o in outs for f in o})
    assert not failures, (f"CGX_FUZZ_SEED={seed}: {len(failures)} failing case(s); first: " +
                          "; ".join(f"case {k} {cases[k]}: {msg}" for k, msg in failures[:3]))
