"""compression="auto" on real ranks: one plan everywhere, state kept across plans and checkpoints."""

import io

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 128), torch.nn.ReLU(),
                               torch.nn.Linear(128, 10))


def _train(hvd, model, opt, steps, start=0):
    rank = hvd.rank()
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 32, generator=g) * (1 + rank)  # different data, different stats
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        opt.step()


def _plans(rank, world):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=hvd.Compression.auto(window=2, adjust_every=4, error_feedback=True))
    history, residuals = [], []
    for block in range(3):
        _train(hvd, model, opt, 4, start=4 * block)
        history.append([(r["layer"], r["level"]) for r in opt.compression_plan()])
        residuals.append({k: v.clone() for k, v in opt._plan.residuals.residuals.items()})
    return {"history": history, "made": opt._plan.adaptive.plans_made,
            "residuals": residuals, "params": [p.detach() for p in model.parameters()]}


@pytest.mark.parametrize("world", [2, 3])
def test_the_same_plan_on_every_rank(world):
    outs = run_gloo(_plans, world)
    assert outs[0]["made"] == 3  # plans at steps 2, 6, 10
    for o in outs[1:]:
        assert o["history"] == outs[0]["history"]
        for p, q in zip(o["params"], outs[0]["params"]):
            assert torch.equal(p, q)
    # Not the uniform default everywhere: the budget was spent where it saves bytes.
    levels = {lvl for _, lvl in outs[0]["history"][-1] if "not planned" not in lvl}
    assert levels != {"4-bit/1024"}
    # Residuals survive re-planning: the same layers keep (non-zero) residuals.
    for o in outs:
        before, after = o["residuals"][0], o["residuals"][-1]
        assert set(before) <= set(after)
        assert any(float(v.abs().sum()) > 0 for v in after.values())


def _window_counts(rank, world):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters(),
        compression=hvd.Compression.auto(window=8, adjust_every=100,
                                         families=("quantize",)))
    _train(hvd, model, opt, 7)  # the window's sampled steps 0, 2, 4, 6; its plan at step 8
    return dict(opt._plan.adaptive._counts)


def test_the_ranks_split_the_windows_measurements():
    # the exchange tells the schedule its rank: each planned layer measured once per sampled
    # step, by one rank (cgx.policy.levels.stats.measuring_ranks), over both ranks in the window
    counts = run_gloo(_window_counts, 2)
    layers = set(counts[0]) | set(counts[1])
    assert layers == {"0.weight", "2.weight", "4.weight"}
    for n in layers:
        assert counts[0].get(n, 0) + counts[1].get(n, 0) == 4, (n, counts)
        assert counts[0].get(n, 0) == counts[1].get(n, 0) == 2, (n, counts)


def _checkpoint(rank, world, phase, blob):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.auto(window=2, adjust_every=3, error_feedback=True))
    if phase == "full":
        _train(hvd, model, opt, 10)
        return [p.detach() for p in model.parameters()]
    if phase == "first":
        _train(hvd, model, opt, 5)  # mid-window: the statistics are saved too
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
        return buf.getvalue()
    ckpt = torch.load(io.BytesIO(blob[rank]), weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    _train(hvd, model, opt, 5, start=5)
    return [p.detach() for p in model.parameters()]


def test_checkpoint_with_a_plan_resumes_bit_exactly_in_fresh_processes():
    full = run_gloo(_checkpoint, 2, "full", None)
    blobs = run_gloo(_checkpoint, 2, "first", None)  # every rank saves its own state
    resumed = run_gloo(_checkpoint, 2, "second", blobs)
    for r in range(2):
        for p, q in zip(full[r], resumed[r]):
            assert torch.equal(p, q)


def _warmup(rank, world, comp_name):
    import cgx.torch as hvd
    hvd.init()
    comps = {"exact": hvd.Compression.exact,
             "quantize": hvd.Compression.quantize(bits=2, warmup_steps=3),
             "topk": hvd.Compression.topk(density=0.01, warmup_steps=3),
             "auto": hvd.Compression.auto(window=2, adjust_every=4, warmup_steps=3)}
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=comps[comp_name])
    out = []
    for step in range(5):
        _train(hvd, model, opt, 1, start=step)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("comp", ["quantize", "topk", "auto"])
def test_warmup_steps_travel_exact(comp):
    exact = run_gloo(_warmup, 2, "exact")[0]
    got = run_gloo(_warmup, 2, comp)[0]
    for step in range(3):  # the warm-up: bit-identical to the exact exchange
        for p, q in zip(got[step], exact[step]):
            assert torch.equal(p, q), (comp, step)
    assert not all(torch.equal(p, q) for p, q in zip(got[4], exact[4]))  # compressed after


def _ddp_auto(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP
    import cgx.torch as hvd
    model = DDP(_model(), bucket_cap_mb=0.05)  # several buckets
    state = hvd.CGXState(model, compression=hvd.Compression.auto(window=2, adjust_every=4,
                                                                 error_feedback=True))
    model.register_comm_hook(state, hvd.cgx_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    history = []
    for block in range(3):
        for step in range(4 * block, 4 * block + 4):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 32, generator=g) * (1 + rank)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
            opt.step()
        history.append([(r["layer"], r["level"]) for r in state.compression_plan()])
    blob = io.BytesIO()
    torch.save(state.state_dict(), blob)
    fresh = hvd.CGXState(model, compression="auto")
    blob.seek(0)
    fresh.load_state_dict(torch.load(blob, weights_only=False))
    return {"history": history, "restored": [(r["layer"], r["level"])
                                             for r in fresh.compression_plan()],
            "params": [p.detach() for p in model.parameters()]}


def test_ddp_hook_auto_plans_alike_and_checkpoints():
    outs = run_gloo(_ddp_auto, 2)
    assert outs[0]["history"] == outs[1]["history"]
    for p, q in zip(outs[0]["params"], outs[1]["params"]):
        assert torch.equal(p, q)
    levels = {lvl for _, lvl in outs[0]["history"][-1] if "not planned" not in lvl}
    assert levels and levels != {"4-bit/1024"}
    assert outs[0]["restored"] == outs[0]["history"][-1]


def _auto_planner(rank, world, gbit):
    import cgx.torch as hvd
    hvd.init()
    model = _model()
    comp = hvd.Compression.auto(window=2, adjust_every=4) if gbit is None else \
        hvd.Compression.auto(window=2, adjust_every=4, planner=True, assume_gbit=gbit)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=comp)
    _train(hvd, model, opt, 3)
    return {"levels": [r["level"] for r in opt.compression_plan()],
            "params": [p.detach() for p in model.parameters()]}


def test_auto_with_the_planner_keeps_exact_what_compressing_would_not_speed_up():
    plain = run_gloo(_auto_planner, 2, None)[0]
    # A link of 1 Mbit/s: compressing saves time everywhere; the plan is plain auto's.
    slow = run_gloo(_auto_planner, 2, 0.001)
    assert slow[0]["levels"] == slow[1]["levels"] == plain["levels"]
    # 10^6 Gbit/s: every exchange costs less than compressing it; all planned layers exact.
    fast = run_gloo(_auto_planner, 2, 1e6)
    assert fast[0]["levels"] == fast[1]["levels"]
    planned = [lvl for lvl in plain["levels"] if "not planned" not in lvl]
    assert planned and all("bit" in lvl or "top" in lvl or "rank" in lvl for lvl in planned)
    assert [lvl for lvl in fast[0]["levels"] if "not planned" not in lvl] == \
        ["exact (planner: no time saved)"] * len(planned)
    for p, q in zip(fast[0]["params"], fast[1]["params"]):
        assert torch.equal(p, q)
