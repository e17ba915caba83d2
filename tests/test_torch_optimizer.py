"""cgx.torch.DistributedOptimizer on real Gloo ranks."""

import pickle

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _model(seed=0, width=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, width), torch.nn.ReLU(),
                               torch.nn.Linear(width, 10))


def _batch(rank, step, n=16):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 32, generator=g)
    return x, (x[:, :10] * 3).argmax(1)


def _init(cfg_kwargs):
    """cgx with ``Config(**cfg_kwargs)``; ``Compression.none`` is the fixed quantization of
    those settings (``CGX_COMPRESSION=quantize``), which these tests are about (the
    default, the deciding exchange: tests/trials/test_default.py)."""
    import cgx.torch as hvd
    from cgx.config import CompressionMode, Config
    hvd.init(Config(**{"compression": CompressionMode.QUANTIZE, **cfg_kwargs}))
    return hvd


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


# -- exactness against DDP, and quantized tolerance ----------------------------------

def _grads_vs_ddp(rank, world, cfg_kwargs, steps):
    """Per step: the cgx gradient against DDP's exact average at the same parameters.

    Returns, per step, (error / documented bound) per tensor, the parameters,
    and the training losses of the cgx run and of an independent DDP run.
    """
    hvd = _init(cfg_kwargs)
    from torch.nn.parallel import DistributedDataParallel as DDP

    bits = cfg_kwargs["bits"]
    a, ref, local, indep = _model(), DDP(_model()), _model(), DDP(_model())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                   named_parameters=a.named_parameters())
    indep_opt = torch.optim.SGD(indep.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        with torch.no_grad():
            for m in (ref.module, local):
                for p, q in zip(m.parameters(), a.parameters()):
                    p.copy_(q)
                    p.grad = None
        opt.zero_grad()
        loss = _loss(a, rank, step)
        loss.backward()
        opt.synchronize()  # cgx's engine is idle from here on: DDP may use the group
        _loss(ref, rank, step).backward()
        _loss(local, rank, step).backward()
        ratios = []
        for pa, pr, pl in zip(a.parameters(), ref.parameters(), local.parameters()):
            err = (pa.grad - pr.grad).abs().max().item()
            if bits == 32:
                bound = 1e-6 * (pr.grad.abs().max().item() + 1e-12)
            else:
                # SRA bound (cgx.collectives.algorithms): each peer's share quantized once
                # (unit <= its local range / L), the average once more.
                levels = 2 ** bits - 1
                ranges = hvd.allgather((pl.grad.max() - pl.grad.min()).view(1))
                stage1 = 0.5 * (world - 1) / world * ranges.max().item() / levels
                out_range = (pr.grad.max() - pr.grad.min()).item() + 2 * stage1
                bound = 1.01 * (stage1 + 0.5 * out_range / levels) + 1e-7
            ratios.append(err / bound)
        with opt.skip_synchronize():
            opt.step()
        indep_opt.zero_grad()
        indep_loss = _loss(indep, rank, step)
        indep_loss.backward()
        indep_opt.step()
        flat = torch.cat([p.detach().view(-1) for p in a.parameters()])
        out.append((max(ratios), flat, loss.item(), indep_loss.item()))
    return out


@pytest.mark.parametrize("bits", [32, 8, 4])
def test_gradients_match_ddp(bits):
    """bits=32: DDP's gradients to fp32 tolerance; 8/4 bits: within the SRA error bound.

    Also: parameters identical on both ranks after every step, and the training
    loss curve close to an independent, uncompressed DDP run.
    """
    cfg = dict(bits=bits, minimal_size=0, rounding=__import__("cgx").Rounding.NEAREST)
    steps = 12
    res = run_gloo(_grads_vs_ddp, 2, cfg, steps)
    for step in range(steps):
        assert max(r[step][0] for r in res) <= 1.0, (bits, step, [r[step][0] for r in res])
        assert torch.equal(res[0][step][1], res[1][step][1]), "parameters differ across ranks"
    losses = [sum(r[s][2] for r in res) / 2 for s in range(steps)]
    ref = [sum(r[s][3] for r in res) / 2 for s in range(steps)]
    assert losses[-1] < losses[0], "compressed training did not reduce the loss"
    gap = max(abs(x - y) / y for x, y in zip(losses, ref))
    assert gap <= {32: 1e-5, 8: 0.02, 4: 0.1}[bits], (losses, ref)


# -- overlap: early buckets start before backward finishes ---------------------------

def _overlap(rank, world):
    hvd = _init(dict(fusion_buffer_mb=0.25, bits=4))
    import time
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(512, 512), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(512, 512)
    results = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        t_backward_done = time.perf_counter()
        opt.step()
        results.append((opt.timing["launch"][0], opt.timing["start"][0], t_backward_done,
                        len(opt.timing["launch"])))
    return results


def test_communication_overlaps_backward():
    """Buckets are handed to the engine as backward produces them, the first long before
    backward ends. When the engine thread then runs is the scheduler's: on a loaded 2-core
    machine the first reduction may start only after backward, so that is not asserted."""
    for per_rank in run_gloo(_overlap, 2):
        for launch0, _start0, backward_done, nbuckets in per_rank[1:]:
            assert nbuckets > 2
            assert launch0 < backward_done, "first bucket was launched only after backward"


# -- checkpoint round trip -----------------------------------------------------------

def _ckpt(rank, world, path, phase, compression):
    from cgx import Rounding
    hvd = _init(dict(bits=3, rounding=Rounding.STOCHASTIC, error_feedback=True, minimal_size=0))
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2), named_parameters=model.named_parameters(),
        compression=hvd.Compression.powersgd(rank=2) if compression == "powersgd"
        else hvd.Compression.none)
    first = 0
    if phase == "resume":
        state = torch.load(path + f".{rank}", weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = 4
    trace = []
    for step in range(first, 8):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
        if phase == "full" and step == 3:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path + f".{rank}")
        if step >= 4:
            trace.append(torch.cat([p.detach().view(-1) for p in model.parameters()]))
    plan = opt.state_dict()["cgx"]["plan"]
    held = plan["compression"]["q"] if compression == "powersgd" else plan["residuals"]
    return trace, bool(held)


@pytest.mark.parametrize("compression", ["quantize", "powersgd"])
def test_checkpoint_round_trip(tmp_path, compression):
    """Quantized with error feedback (residuals), or PowerSGD (warm starts and its own
    residuals): the restored run steps as the uninterrupted one did, bit for bit."""
    path = str(tmp_path / "ckpt.pt")
    full = run_gloo(_ckpt, 2, path, "full", compression)
    resumed = run_gloo(_ckpt, 2, path, "resume", compression)
    for r in range(2):
        assert full[r][1] and resumed[r][1], "the compressor's state was not checkpointed"
        for a, b in zip(full[r][0], resumed[r][0]):
            assert torch.equal(a, b), "restored run diverged from the uninterrupted one"


# -- join with uneven data, unused and frozen parameters, accumulation, clipping ----------

def _features(rank, world):
    hvd = _init(dict(bits=8, minimal_size=0))
    out = {}

    # Unused parameter on one rank only, and a frozen parameter.
    torch.manual_seed(1)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(8, 8), "b": torch.nn.Linear(8, 8),
                                 "frozen": torch.nn.Linear(8, 8)})
    model["frozen"].requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x = torch.ones(4, 8) * (rank + 1)
    y = model["a"](x) if rank == 0 else model["b"](model["a"](x))
    y.sum().backward()
    opt.synchronize()
    out["b_grad"] = model["b"].weight.grad.clone()
    out["frozen_grad"] = model["frozen"].weight.grad
    with opt.skip_synchronize():
        opt.step()

    # backward_passes_per_step=2 accumulates locally; a third pass is an error.
    model2 = _model()
    opt2 = hvd.DistributedOptimizer(torch.optim.SGD(model2.parameters(), lr=0.1),
                                    named_parameters=model2.named_parameters(),
                                    backward_passes_per_step=2)
    _loss(model2, rank, 0).backward()
    _loss(model2, rank, 1).backward()
    try:
        _loss(model2, rank, 2).backward()
        out["third_pass"] = "no error"
    except Exception as exc:  # raised inside the autograd hook
        out["third_pass"] = str(exc)
    opt2.synchronize()
    opt2.zero_grad(set_to_none=True)

    # zero_grad while a reduction is in flight is refused.
    model3 = _model()
    opt3 = hvd.DistributedOptimizer(torch.optim.SGD(model3.parameters(), lr=0.1),
                                    named_parameters=model3.named_parameters())
    _loss(model3, rank, 0).backward()
    try:
        opt3.zero_grad()
        out["zero_grad"] = "no error"
    except Exception as exc:
        out["zero_grad"] = str(exc)
    opt3.synchronize()
    torch.nn.utils.clip_grad_norm_(model3.parameters(), 0.01)  # clipping between sync and step
    with opt3.skip_synchronize():
        opt3.step()
    out["params3"] = torch.cat([p.detach().view(-1) for p in model3.parameters()])

    # Parameters added later take part from the next step on.
    extra = torch.nn.Parameter(torch.zeros(2000))
    opt3.add_param_group({"params": [extra]})
    opt3.zero_grad()
    (extra * (rank + 1)).sum().backward()
    opt3.step()
    out["extra_grad"] = extra.grad.clone()

    # join: rank 1 runs out of data after 2 steps, rank 0 does 4.
    model4 = _model()
    opt4 = hvd.DistributedOptimizer(torch.optim.SGD(model4.parameters(), lr=0.1),
                                    named_parameters=model4.named_parameters())
    for step in range(4 if rank == 0 else 2):
        opt4.zero_grad()
        _loss(model4, rank, step).backward()
        opt4.step()
    out["last_joined"] = hvd.join()
    # As with Horovod: a joined rank stopped stepping, so take the last joiner's model.
    hvd.broadcast_parameters(model4.state_dict(), root_rank=out["last_joined"])
    out["params4"] = torch.cat([p.detach().view(-1) for p in model4.parameters()])

    # float64 parameters travel exact under the default (quantizing) compression.
    model5 = _model().double()
    opt5 = hvd.DistributedOptimizer(torch.optim.SGD(model5.parameters(), lr=0.1),
                                    named_parameters=model5.named_parameters())
    x5, _ = _batch(rank, 0)
    model5(x5.double()).square().mean().backward()
    opt5.step()
    out["params5"] = torch.cat([p.detach().view(-1) for p in model5.parameters()])

    # The optimizer pickles (no runtime-created classes) and keeps working.
    clone = pickle.loads(pickle.dumps(opt4))
    out["pickled"] = type(clone).__name__
    return out


def test_optimizer_features():
    res = run_gloo(_features, 2)
    r0, r1 = res
    # Rank 0 gave no gradient for "b": it contributed zeros, so b's grad is half of rank 1's.
    assert torch.allclose(r0["b_grad"], r1["b_grad"])
    assert r0["b_grad"].abs().sum() > 0
    assert r0["frozen_grad"] is None and r1["frozen_grad"] is None
    for r in res:
        assert "backward_passes_per_step=2" in r["third_pass"]
        assert "zero_grad() was called after loss.backward()" in r["zero_grad"]
        assert r["pickled"] == "DistributedOptimizer"
        assert r["last_joined"] == 0
    assert torch.equal(r0["params3"], r1["params3"])
    assert torch.allclose(r0["extra_grad"], torch.full((2000,), 1.5))
    assert torch.equal(r0["params4"], r1["params4"]), "join: ranks ended with different models"
    assert r0["params5"].dtype == torch.float64 and torch.equal(r0["params5"], r1["params5"])


def _rules_and_modes(rank, world, rules_path):
    import cgx.torch as hvd
    from cgx.config import CompressionMode, Config
    hvd.init(Config(bits=2, minimal_size=0, layer_config=rules_path,
                    compression=CompressionMode.QUANTIZE))
    model = _model()
    specs = {}
    for comp in (hvd.Compression.none, hvd.Compression.exact, hvd.Compression.fp16, hvd.Compression.bf16,
                 hvd.Compression.quantize(bits=8), hvd.Compression.topk(0.3),
                 hvd.Compression.powersgd(rank=2)):
        m = _model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=m.named_parameters(), compression=comp)
        for step in range(3):
            opt.zero_grad()
            _loss(m, rank, step).backward()
            opt.step()
        specs[repr(comp)] = (opt._mode.value,
                             torch.cat([p.detach().view(-1) for p in m.parameters()]))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    chosen = {n: (s.bits if s else None) for n, s in zip(names, opt._specs)}
    return specs, chosen


def test_compression_modes_and_layer_rules(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text("layers:\n  - pattern: '4.*'\n    exclude: true\n"
                     "  - pattern: 're:^2\\.weight$'\n    bits: 8\n")
    res = run_gloo(_rules_and_modes, 2, str(rules))
    specs0, chosen = res[0]
    assert chosen == {"0.weight": 2, "0.bias": None, "2.weight": 8, "2.bias": None,
                      "4.weight": None, "4.bias": None}
    modes = {k: v[0] for k, v in specs0.items()}
    assert sorted(set(modes.values())) == ["exact", "per_tensor", "quantize", "summable"]
    from cgx.compression import Compression
    assert modes[repr(Compression.exact)] == "exact"
    for key, (_, params) in specs0.items():  # every mode keeps the ranks identical
        assert torch.equal(params, res[1][0][key][1]), key


def test_validation_errors():
    import cgx.torch as hvd
    from cgx.errors import CGXError

    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(model)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="op must be Average or Sum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Min)
    with pytest.raises(ValueError, match="applies to op=Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="duplicate names"):
        hvd.DistributedOptimizer(sgd, named_parameters=[("w", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not in it"):
        hvd.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:2])
    with pytest.raises(ValueError, match="must be a ProcessSet"):
        hvd.DistributedOptimizer(sgd, process_set=object())
    with pytest.raises(ValueError, match="Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(CGXError, match="init"):
        hvd.DistributedOptimizer(sgd)


def _concurrent_user_collectives(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    hvd = _init(dict(bits=4))
    a, b = _model(), DDP(_model())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1),
                                   named_parameters=a.named_parameters())
    for step in range(10):
        opt.zero_grad()
        b.zero_grad()
        _loss(a, rank, step).backward()  # cgx's buckets are reduced in the background...
        _loss(b, rank, step).backward()  # ...while DDP reduces on the default group,
        t = torch.tensor([1.0])
        dist.all_reduce(t)  # and the user issues a collective of their own
        opt.step()
    return torch.cat([p.detach().view(-1) for p in a.parameters()]), t.item()


def test_user_collectives_concurrent_with_cgx():
    """cgx runs on its own process group, so it never interleaves with the user's."""
    (p0, t0), (p1, t1) = run_gloo(_concurrent_user_collectives, 2, timeout=120)
    assert torch.equal(p0, p1) and t0 == t1 == 2.0


# -- a read of param_groups (GradScaler.unscale_) finishes the exchange once --------------

def _param_groups_read(rank, world, read, comp_name):
    import cgx.torch as hvd
    from cgx.config import Config
    hvd.init(Config(minimal_size=0, rounding=__import__("cgx").Rounding.NEAREST))
    model = _model()
    comp = hvd.Compression.exact if comp_name == "exact" else hvd.Compression.quantize(bits=4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, op=hvd.Sum)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if read == "grad_scaler" else None
    out, read_grads = [], []
    for step in range(3):
        opt.zero_grad()
        loss = _loss(model, rank, step)
        (scaler.scale(loss) if scaler is not None else loss).backward()  # scale 1: same values
        if scaler is not None:
            scaler.unscale_(opt)        # reads opt.param_groups: finishes the exchange
            scaler.step(opt)
            scaler.update()
        else:
            if read == "param_groups":
                _ = opt.param_groups  # finishes the exchange: p.grad holds the reduced sum
                read_grads.append(torch.cat([p.grad.view(-1).clone()
                                             for p in model.parameters()]))
            opt.step()
        out.append(torch.cat([p.detach().view(-1).clone() for p in model.parameters()]))
    return out, read_grads


@pytest.mark.parametrize("comp", ["exact", "4bit"])
def test_reading_param_groups_before_step_reduces_once(comp):
    """With op=Sum a second reduction would multiply by the world size (exact) or add
    the quantization error again (4-bit): the parameters must equal the plain path's."""
    plain = [params for params, _ in run_gloo(_param_groups_read, 2, "none", comp)]
    for read in ("param_groups", "grad_scaler"):
        got = run_gloo(_param_groups_read, 2, read, comp)
        for step in range(3):
            assert torch.equal(got[0][0][step], plain[0][step]), (read, step)
            assert torch.equal(got[1][0][step], got[0][0][step])
            if read == "param_groups":  # the ranks' gradients differ; the sums do not
                assert torch.equal(got[0][1][step], got[1][1][step]), step
