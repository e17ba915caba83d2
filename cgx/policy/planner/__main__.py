"""``python -m cgx.policy.planner MODULE:FACTORY --input 8,3,32,32 --world 2 --gbit 1``

Builds the model (``FACTORY()`` returns a ``torch.nn.Module``), traces a few local training
steps on random inputs of the given shape (gradient-ready times, backward and optimizer
time), measures this machine's compressor throughput, assumes the link given (alpha-beta:
``--latency-us`` per call, ``--gbit`` per rank, ``--transport-cpu-ns`` of the transport's
CPU time per byte) and ``--ranks-per-host`` ranks like this process sharing its cores,
and prints the planner's decision per tensor: the chosen option and the predicted step
time with each alternative. ``--device-profile h200`` (or a JSON profile) plans as for
gradients on that GPU: each quantized option also offloaded to the host (``@cpu``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _factory(spec: str):
    if ":" not in spec:
        raise SystemExit(f"model must be 'package.module:factory', got {spec!r}")
    mod, attr = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"cannot load {spec!r}: {exc}") from None
    return fn


def _device_profile(p, spec, gpu_busy):
    """The --device-profile (and --gpu-busy) as a DeviceProfile, or None."""
    if spec is None:
        if gpu_busy is not None:
            p.error("--gpu-busy needs --device-profile")
        return None
    import json

    from cgx.policy.planner.placement import DeviceProfile
    try:
        if spec == "h200":
            profile = DeviceProfile.h200()
        else:
            with open(spec) as f:
                profile = DeviceProfile.from_dict(json.load(f))
        if gpu_busy is not None:
            profile = DeviceProfile.from_dict(dict(profile.to_dict(), gpu_busy=gpu_busy))
    except (OSError, ValueError, TypeError) as exc:
        p.error(f"--device-profile {spec!r}: {exc}")
    return profile


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cgx.policy.planner", description=__doc__.split("\n\n")[1])
    p.add_argument("model", help="package.module:factory returning a torch.nn.Module")
    p.add_argument("--input", required=True, help="input shape with the batch first, e.g. 8,3,32,32")
    p.add_argument("--world", type=int, default=2, help="ranks")
    p.add_argument("--gbit", type=float, default=1.0, help="link rate per rank, Gbit/s")
    p.add_argument("--latency-us", type=float, default=50.0, help="seconds per call, in us")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks sharing this host's cores (for CPU training)")
    p.add_argument("--transport-cpu-ns", type=float, default=0.0,
                   help="the transport's CPU time per byte sent, in ns (Gloo on loopback: "
                        "about 1; cgx.policy.planner.calibration.link_model measures it)")
    p.add_argument("--device-profile", default=None,
                   help="plan for gradients on a GPU: 'h200' (docs/results/kernels-h200.md) or a "
                        "JSON file of DeviceProfile.to_dict(); each quantized option is then "
                        "also offered offloaded to the host ('sra-4bit@cpu')")
    p.add_argument("--gpu-busy", type=float, default=None,
                   help="with --device-profile: fraction of backward the GPU computes (0..1)")
    p.add_argument("--bits", default="4", help="quantization levels offered, e.g. 4 or 4,8")
    p.add_argument("--families", default="exact,fp16,sra,allgather,sfb")
    p.add_argument("--limit", type=int, default=30, help="rows of the table (largest tensors)")
    args = p.parse_args(argv)
    try:
        shape = tuple(int(s) for s in args.input.split(","))
        bits = tuple(int(b) for b in args.bits.split(","))
    except ValueError:
        p.error("--input and --bits take comma-separated integers")
    if args.world < 1:
        p.error("--world must be >= 1")
    if args.ranks_per_host < 1 or args.transport_cpu_ns < 0:
        p.error("--ranks-per-host must be >= 1 and --transport-cpu-ns >= 0")

    device = _device_profile(p, args.device_profile, args.gpu_busy)

    import torch

    from cgx.policy.planner import CostModel, format_exchange, plan
    from cgx.policy.planner.calibration import compressor_throughput, contention, trace_backward

    torch.manual_seed(0)
    model = _factory(args.model)()
    if not isinstance(model, torch.nn.Module):
        p.error(f"{args.model}() returned {type(model).__name__}, not a torch.nn.Module")
    x = torch.randn(*shape)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    tensors, backward_s, tail_s = trace_backward(model, lambda: model(x).float().square().mean(), opt)
    tp = compressor_throughput()
    model_cost = CostModel.uniform(args.world, args.gbit, latency_s=args.latency_us * 1e-6,
                                   cpu_per_byte=args.transport_cpu_ns * 1e-9,
                                   contention=contention(args.ranks_per_host), device=device,
                                   **tp)
    result = plan(tensors, model_cost, backward_s, tail_s=tail_s, bits=bits,
                  families=args.families.split(","))
    print(f"{args.model}: {sum(t.numel for t in tensors):,} parameters in {len(tensors)} tensors; "
          f"{args.world} ranks at {args.gbit:g} Gbit/s; quantizer {tp['compress_bps'] / 1e9:.1f} / "
          f"{tp['decompress_bps'] / 1e9:.1f} GB/s (compress / decompress); contention "
          f"{model_cost.contention:g}\n")
    print(format_exchange(result, limit=args.limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
