"""Sufficient factors never give a silently wrong gradient: a weight whose gradient is
not the layer's product alone (tied, shared, used again elsewhere) takes the plain path,
and a captured input written after its forward never reaches the factors. On 2 and 3
real ranks, against the plain exact exchange; a clean layer in each model still sends
factors."""

import pytest
import torch
import torch.nn.functional as F

from spawn import run_gloo

pytestmark = pytest.mark.multiproc

K = 4  # rows per rank: K x P x (M + N) < M x N for the 64 x 64 layers at P <= 3


class Tied(torch.nn.Module):
    """A language model's tied input embedding and output layer."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(1000, 64)
        self.clean = torch.nn.Linear(64, 64)
        self.head = torch.nn.Linear(64, 1000, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.clean(self.emb(tokens))))


class Shared(torch.nn.Module):
    """Two nn.Linear modules with one weight (each its own bias)."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.clean = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.clean(torch.tanh(self.a(x)))))


class MatmulT(torch.autograd.Function):
    """``x @ w.t()`` with a backward of its own."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class Reused(torch.nn.Module):
    """``fc``'s weight also reaches the loss outside the layer: ``F.linear`` on it, a
    custom autograd Function, or a penalty term."""

    def __init__(self, how):
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.clean = torch.nn.Linear(64, 64)
        self.how = how

    def forward(self, x):
        h = torch.tanh(self.clean(torch.tanh(self.fc(x))))
        if self.how == "F.linear":
            return h + 0.5 * F.linear(x.flip(0), self.fc.weight)
        if self.how == "Function":
            return h + 0.5 * MatmulT.apply(x.flip(0), self.fc.weight)
        return h + 0.1 * self.fc.weight.square().sum()  # "penalty"


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64))


CASES = {  # name -> (model, passes, layers that must take the plain path, that must not)
    "tied": (Tied, 1, [], ["clean.weight"]),
    "shared": (Shared, 1, [], ["clean.weight"]),
    "F.linear": (lambda: Reused("F.linear"), 1, ["fc.weight"], ["clean.weight"]),
    "Function": (lambda: Reused("Function"), 1, ["fc.weight"], ["clean.weight"]),
    "penalty": (lambda: Reused("penalty"), 1, ["fc.weight"], ["clean.weight"]),
    # One input buffer refilled for each micro-batch: the factors stay, and stay right.
    "reused buffer": (_mlp, 2, [], ["0.weight", "2.weight"]),
    # Under autocast the layer saves a bf16 copy of its input, so writing the input
    # between forward and backward is no error for autograd; the factors must not go.
    "written before backward": (lambda: torch.nn.Linear(64, 64), 1, ["weight"], []),
}


def _data(case, step, micro, rank):
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    if case == "tied":
        return torch.randint(0, 1000, (2, K // 2), generator=g)  # 3-d activations
    return torch.randn(K, 64, generator=g)


def _step(case, model, buf, step, micro, rank):
    """One backward pass on the batch written into ``buf``."""
    buf.copy_(_data(case, step, micro, rank))
    if case == "written before backward":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(buf)
        buf.copy_(_data(case, step, 9, rank))
        out.float().square().mean().backward()
    elif case == "tied":
        F.cross_entropy(model(buf).flatten(0, 1), buf.flatten() % 7).backward()
    else:
        model(buf).square().mean().backward()


def _train(hvd, rank, case, use):
    make, passes, _, _ = CASES[case]
    torch.manual_seed(0)
    model = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.exact,
                                   backward_passes_per_step=passes,
                                   sufficient_factors=model if use else None)
    buf = _data(case, 0, 0, rank)  # one input tensor, written in place for every batch
    grads, used = [], []
    for step in range(3):
        opt.zero_grad()
        for micro in range(passes):
            _step(case, model, buf, step, micro, rank)
        opt.synchronize()
        grads.append([p.grad.clone() for p in model.parameters()])
        used.append(dict(opt.sfb_used))
        with opt.skip_synchronize():
            opt.step()
    return {"grads": grads, "used": used, "params": [p.detach() for p in model.parameters()]}


def _every_case(rank, world, use):
    import cgx.torch as hvd
    hvd.init()
    return {case: _train(hvd, rank, case, use) for case in CASES}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def runs(request):
    """Every case on ``world`` ranks: the plain exchange and with sufficient factors."""
    world = request.param
    return world, run_gloo(_every_case, world, False), run_gloo(_every_case, world, True)


@pytest.mark.parametrize("case", list(CASES))
def test_factors_only_where_they_are_the_whole_gradient(runs, case):
    world, plain, sfb = runs
    _, _, fallback, factors = CASES[case]
    for r in range(world):
        s, p = sfb[r][case], plain[r][case]
        for gs, gp in zip(s["grads"], p["grads"]):
            for a, b in zip(gs, gp):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(s["params"], p["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for used in s["used"]:
            # A weight registered in two modules is never captured (tied, shared).
            assert not {"head.weight", "a.weight", "b.weight"} & set(used), used
            for name in fallback:
                assert used[name] is False, (name, used)
            for name in factors:  # the fallback is not "always plain"
                assert used[name] is True, (name, used)
