"""cgx.torch collectives (Horovod's functional API) and the DDP hook, on real Gloo ranks."""

import pickle

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _collectives(rank, world):
    import cgx.torch as hvd
    from cgx.config import Config
    hvd.init(Config())
    r = float(rank)
    out = {}
    x = torch.arange(6, dtype=torch.float32) + 10 * r
    out["avg"] = hvd.allreduce(x)
    out["sum"] = hvd.allreduce(x, op=hvd.Sum)
    out["avg_deprecated"] = hvd.allreduce(x, average=False)
    out["min"] = hvd.allreduce(x, op=hvd.Min)
    out["max"] = hvd.allreduce(x, op=hvd.Max)
    out["scaled"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    out["int_sum"] = hvd.allreduce(torch.tensor([rank + 1]), op=hvd.Sum)
    y = x.clone()
    hvd.allreduce_(y)
    out["inplace"] = y
    h = hvd.allreduce_async(x, name="async")
    out["poll_type"] = type(hvd.poll(h)).__name__
    out["async"] = hvd.synchronize(h)
    out["grouped"] = hvd.grouped_allreduce([x, x * 2])
    big = torch.randn(5000, generator=torch.Generator().manual_seed(rank))
    out["q8"] = hvd.allreduce(big, compression=hvd.Compression.quantize(bits=8, rounding="nearest"))
    out["fp16"] = hvd.allreduce(big, compression=hvd.Compression.fp16)
    out["big"] = big
    # autograd: the backward of an average allreduce averages the gradient (ones)
    w = torch.ones(3, requires_grad=True)
    hvd.allreduce(w * (rank + 1)).sum().backward()
    out["grad"] = w.grad
    # Horovod's gradient rules: allgather and broadcast average the gradient over ranks
    v = torch.full((rank + 1, 2), 1.0, requires_grad=True)
    (hvd.allgather(v, name="ag") * torch.arange(6.0).view(3, 2)).sum().backward()
    out["grad_allgather"] = v.grad
    u = torch.ones(3, requires_grad=True)
    (hvd.broadcast(u, root_rank=1, name="bc") * (rank + 1)).sum().backward()
    out["grad_broadcast"] = u.grad
    # allgather with different first dimensions per rank
    out["gather"] = hvd.allgather(torch.full((rank + 1, 2), r))
    out["bcast"] = hvd.broadcast(torch.tensor([r, r]), root_rank=1)
    z = torch.tensor([r])
    hvd.broadcast_(z, 0)
    out["bcast_"] = z
    out["a2a"] = hvd.alltoall(torch.arange(4) + 100 * rank)
    data, splits = hvd.alltoall(torch.arange(3) + 100 * rank, splits=[1, 2] if rank == 0 else [2, 1])
    out["a2a_splits"] = (data, splits)
    out["rs"] = hvd.reducescatter(torch.arange(10, dtype=torch.float32).view(5, 2) * (rank + 1),
                                  op=hvd.Sum)
    out["obj"] = hvd.broadcast_object({"from": rank}, root_rank=1)
    out["objs"] = hvd.allgather_object(rank * 10)
    hvd.barrier()
    out["sizes"] = (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(),
                    hvd.cross_size(), hvd.cross_rank())
    # broadcast_parameters / broadcast_optimizer_state make ranks equal
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["exp_avg"] = opt.state_dict()["state"][0]["exp_avg"].clone()
    return out


def test_collectives_match_horovod_semantics():
    r0, r1 = run_gloo(_collectives, 2)
    x0, x1 = torch.arange(6.0), torch.arange(6.0) + 10
    for r, out in enumerate((r0, r1)):
        assert torch.equal(out["avg"], (x0 + x1) / 2)
        assert torch.equal(out["sum"], x0 + x1)
        assert torch.equal(out["avg_deprecated"], x0 + x1)
        assert torch.equal(out["min"], x0) and torch.equal(out["max"], x1)
        assert torch.equal(out["scaled"], x0 + x1)
        assert out["int_sum"].item() == 3
        assert torch.equal(out["inplace"], (x0 + x1) / 2)
        assert out["poll_type"] == "bool"
        assert torch.equal(out["async"], (x0 + x1) / 2)
        assert torch.equal(out["grouped"][1], x0 + x1)
        exact = (r0["big"] + r1["big"]) / 2
        assert (out["q8"] - exact).abs().max() < 8 / 255 * 2 * 4  # two 8-bit quantizations
        assert (out["fp16"] - exact).abs().max() < 1e-2
        assert torch.equal(out["grad"], torch.full((3,), r + 1.0))  # allreduce(1) * (rank + 1)
        rows = slice(0, 1) if r == 0 else slice(1, 3)
        assert torch.equal(out["grad_allgather"], torch.arange(6.0).view(3, 2)[rows])
        assert torch.equal(out["grad_broadcast"], torch.full((3,), 1.5 if r == 1 else 0.0))
        assert torch.equal(out["gather"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
        assert torch.equal(out["bcast"], torch.tensor([1.0, 1.0]))
        assert torch.equal(out["bcast_"], torch.tensor([0.0]))
        assert out["obj"] == {"from": 1} and out["objs"] == [0, 10]
        assert out["sizes"][:2] == (2, r)
        assert torch.equal(out["params"][0], r0["params"][0])
        assert torch.equal(out["exp_avg"], r0["exp_avg"])
    assert torch.equal(r0["q8"], r1["q8"])
    assert torch.equal(r0["a2a"], torch.tensor([0, 1, 100, 101]))
    assert torch.equal(r1["a2a"], torch.tensor([2, 3, 102, 103]))
    assert torch.equal(r0["a2a_splits"][0], torch.tensor([0, 100, 101]))
    assert r0["a2a_splits"][1].tolist() == [1, 2]
    assert torch.equal(r1["a2a_splits"][0], torch.tensor([1, 2, 102]))
    full = torch.arange(10, dtype=torch.float32).view(5, 2) * 3
    assert torch.equal(r0["rs"], full[:3]) and torch.equal(r1["rs"], full[3:])


def _hook_errors(a, b, rank: int, steps: int) -> list:
    """Per step (parameters fixed, this rank's batches): the largest relative difference
    of ``a``'s gradients (through the cgx hook) from ``b``'s (DDP's own average)."""
    g = torch.Generator().manual_seed(rank)
    errs = []
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g)
        for m in (a, b):
            m.zero_grad()
            m(x).square().mean().backward()
        errs.append(max(((p.grad - q.grad).abs().max() / (q.grad.abs().max() + 1e-12)).item()
                        for p, q in zip(a.parameters(), b.parameters())))
    return errs


def _ddp_hook(rank, world, bits):
    import cgx.torch as hvd
    from cgx.config import Config, Rounding
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    a, b = DDP(base), DDP(torch.nn.Sequential(*[torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                                 torch.nn.Linear(64, 10)]))
    b.load_state_dict(a.state_dict())
    state = hvd.CGXState(a, config=Config(bits=bits, minimal_size=0, rounding=Rounding.NEAREST),
                         error_feedback=bits < 32)
    a.register_comm_hook(state, hvd.cgx_hook)
    errs = _hook_errors(a, b, rank, 3)
    grads = torch.cat([p.grad.view(-1) for p in a.parameters()])
    clone = pickle.loads(pickle.dumps(state))
    # A checkpoint of the format that kept residuals beside the plan still loads.
    held = state.state_dict()["plan"]["residuals"]
    fresh = hvd.CGXState(a, config=Config(bits=bits, minimal_size=0), error_feedback=bits < 32)
    fresh.load_state_dict({"format": 1, "iteration": 3, "residuals": held})
    reloaded = fresh.state_dict()["plan"]["residuals"]
    assert reloaded.keys() == held.keys()
    assert all(torch.equal(reloaded[k], held[k]) for k in held)
    return errs, grads, state.state_dict()["iteration"], type(clone).__name__, len(held)


@pytest.mark.parametrize("bits,tol", [(32, 1e-6), (8, 0.05)])
def test_ddp_hook(bits, tol):
    res = run_gloo(_ddp_hook, 2, bits)
    for errs, _, iteration, clone, nres in res:
        assert max(errs) <= tol, errs
        assert iteration == 3 and clone == "CGXState"
        assert (nres > 0) == (bits < 32)
    assert torch.equal(res[0][1], res[1][1]), "DDP hook left different gradients on the ranks"


def _hook_compressions(rank, world):
    """Each compression through the DDP hook against DDP's own exact averaging, 6 steps at
    fixed parameters: the relative error per step, and the averaged gradients."""
    import cgx.torch as hvd
    from torch.nn.parallel import DistributedDataParallel as DDP

    def mlp():
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 10))

    comps = {"fp16": hvd.Compression.fp16, "quantize": hvd.Compression.quantize(
        bits=8, rounding="nearest"), "topk": hvd.Compression.topk(0.1),
        "powersgd": hvd.Compression.powersgd(rank=2), "planned": hvd.Compression.planned()}
    out = {}
    for name, comp in comps.items():
        torch.manual_seed(0)
        a, b = DDP(mlp()), DDP(mlp())
        b.load_state_dict(a.state_dict())
        a.register_comm_hook(hvd.CGXState(a, compression=comp), hvd.cgx_hook)
        out[name] = (_hook_errors(a, b, rank, 6),
                     torch.cat([p.grad.view(-1) for p in a.parameters()]))
    return out


def test_ddp_hook_takes_any_compression():
    """``CGXState(model, compression=...)`` takes what DistributedOptimizer takes: each
    leaves the same averaged gradients on both ranks, the casts and 8 bits close to DDP's
    exact average, top-k and PowerSGD lossy (they did compress)."""
    r0, r1 = run_gloo(_hook_compressions, 2)
    for name in r0:
        assert torch.equal(r0[name][1], r1[name][1]), name
        assert torch.isfinite(r0[name][1]).all(), name
    assert max(r0["fp16"][0]) < 1e-2 and max(r0["quantize"][0]) < 0.05
    assert min(r0["topk"][0]) > 0.05 and min(r0["powersgd"][0]) > 0.05
    assert max(r0["planned"][0]) < 0.3  # each tensor exact or 4-bit
