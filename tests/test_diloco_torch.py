"""cgx.torch.DiLoCo on real Gloo ranks: equivalence, identical parameters, resume, a slow
rank, a mismatch."""

import time

import pytest
import torch

from spawn import run_gloo

pytestmark = pytest.mark.multiproc

STEPS = 6


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 5))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 12, generator=g)
    return x, (x[:, :5] * 2).argmax(1)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return torch.nn.functional.cross_entropy(model(x), y)


def _init(**cfg):
    import cgx.torch as hvd
    from cgx.config import Config
    hvd.init(Config(**cfg))
    return hvd


def _train(hvd, opt, model, rank, steps, first=0, sleep=None):
    """Inner steps ``first .. steps - 1``; the parameters after each, flat."""
    out = []
    for step in range(first, steps):
        if sleep is not None and step in sleep:
            time.sleep(sleep[step])
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return out


# -- what the ranks run: few launches (each pays torch.optim's first import) -------------

def _sync_dp_reference(world, steps):
    """Synchronous data parallel computed on one rank: every rank's gradient averaged,
    then SGD with momentum."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(steps):
        grads = []
        for r in range(world):
            model.zero_grad()
            _loss(model, r, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).sum(0) / world
        opt.step()
        out.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return out


def _h1_runs(hvd, rank, world):
    runs = {"ref": _sync_dp_reference(world, STEPS)}
    for h, warmup in ((1, 0), (1, 2), (2, 0)):
        model = _model()
        opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                         sync_every=h, outer_optimizer=None, warmup_steps=warmup,
                         compression=hvd.Compression.exact,
                         warmup_compression=hvd.Compression.exact)
        runs[(h, warmup)] = _train(hvd, opt, model, rank, STEPS)
    return runs


def _synced_params(hvd, rank, fragments, sync_every):
    model = _model(seed=rank)  # different starts: the first sync starts from rank 0's
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     sync_every=sync_every, fragments=fragments)
    return _train(hvd, opt, model, rank, 10)


def _make(hvd):
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=4,
                     fragments=2, delay=1)
    return model, opt


def _run_and_save(hvd, rank, path):
    model, opt = _make(hvd)
    _train(hvd, opt, model, rank, 4)  # fragment 1's exchange starts at step 4, lands at 5
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{path}.{rank}")
    return _train(hvd, opt, model, rank, 11, first=4)


def _resume(rank, world, path):
    hvd = _init()
    model, opt = _make(hvd)
    ckpt = torch.load(f"{path}.{rank}", weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    return _train(hvd, opt, model, rank, 11, first=4)


def _slow(hvd, rank):
    """The same run twice, the second with rank 1 asleep before its 6th step."""
    from cgx import session
    runs = []
    for sleep in (None, {5: 2.2} if rank == 1 else None):
        model = _model()
        opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         sync_every=3, fragments=1, delay=1)
        runs.append(_train(hvd, opt, model, rank, 9, sleep=sleep))
    return runs, list(session.engine().stall_warnings)


def _auto(hvd, rank):
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                     sync_every="auto", calibrate_steps=3, assume_gbit=1e-4)
    params = _train(hvd, opt, model, rank, 6)
    return opt.sync_every, opt.choice, params


def _mismatch(hvd, rank):
    from cgx.errors import CollectiveMismatchError
    model = _model()
    opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1),
                     sync_every=2 + rank)
    try:
        _train(hvd, opt, model, rank, 4)
    except CollectiveMismatchError as e:
        return str(e)
    return None


BASE_LRS = (0.1, 0.05)  # the inner SGD's two parameter groups (the two Linear layers)


def _scheduled(hvd, rank, follow, decay, h=2, steps=8):
    """Inner SGD with two groups whose lrs fall by ``decay`` every round; exact outer
    gradients, Nesterov outer SGD, ``follow_inner_lr=follow``: the parameters after each
    sync."""
    model = _model()
    inner = torch.optim.SGD([{"params": model[i].parameters(), "lr": lr}
                             for i, lr in zip((0, 2), BASE_LRS)])
    opt = hvd.DiLoCo(model, inner, sync_every=h, compression=hvd.Compression.exact,
                     outer_optimizer=hvd.OuterSGD(follow_inner_lr=follow))
    out = []
    for step in range(steps):
        for g, lr in zip(inner.param_groups, BASE_LRS):
            g["lr"] = lr * decay ** (step // h)
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
        if (step + 1) % h == 0:
            out.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    return out


def _scheduled_reference(world, decay, follow, h=2, steps=8):
    """What :func:`_scheduled` must give, computed on one rank: each rank's H plain SGD
    steps from the anchors, the changes averaged, the outer Nesterov step with the buffer
    rescaled by the inner lr's change when ``follow``."""
    model = _model()
    anchors = [p.detach().clone() for p in model.parameters()]
    bufs = [torch.zeros_like(a) for a in anchors]
    base = [BASE_LRS[0]] * 2 + [BASE_LRS[1]] * 2  # 0.weight, 0.bias, 2.weight, 2.bias
    out, last = [], None
    for k in range(steps // h):
        lrs = [b * decay ** k for b in base]
        deltas = []
        for r in range(world):
            m = _model()
            with torch.no_grad():
                for p, a in zip(m.parameters(), anchors):
                    p.copy_(a)
            for step in range(k * h, (k + 1) * h):
                m.zero_grad()
                _loss(m, r, step).backward()
                with torch.no_grad():
                    for p, lr in zip(m.parameters(), lrs):
                        p.add_(p.grad, alpha=-lr)
            deltas.append([a - p.detach() for a, p in zip(anchors, m.parameters())])
        for i, (a, buf) in enumerate(zip(anchors, bufs)):
            d = torch.stack([dl[i] for dl in deltas]).sum(0) / world
            scale = lrs[i] / last[i] if follow and last else 1.0
            buf.mul_(0.9 * scale).add_(d)
            a.add_(d.add(buf, alpha=0.9), alpha=-0.7)
        last = lrs
        out.append(torch.cat([a.reshape(-1).clone() for a in anchors]))
    return out


def _first_step_bytes(hvd, rank):
    """Bytes rank ``rank`` sent in its first local step (H=5: no outer exchange yet),
    the ranks starting equal and different; the parameters after it; the warnings."""
    import warnings
    out = {}
    for same in (True, False):
        model = _model(seed=0 if same else rank)
        opt = hvd.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=5)
        before = hvd.stats().wire_bytes
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(hvd, opt, model, rank, 1)
        out[same] = (hvd.stats().wire_bytes - before,
                     torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                     [str(w.message) for w in caught])
    return out


def _bad_inner_lr(hvd):
    """The loop's refusals of an unusable inner learning rate (its messages)."""
    from cgx.diloco import DiLoCoConfig, OuterLoop
    loop = OuterLoop(["w"], [(3,)], DiLoCoConfig(
        outer_optimizer=hvd.OuterSGD(follow_inner_lr=True)))
    out = []
    for bad in ([0.1, 0.2], float("nan"), -0.1, [0.1, "x"], "fast"):
        try:
            loop.after_inner_step(None, inner_lr=bad)
        except ValueError as e:
            out.append(str(e))
    return out


def _two(rank, world, path):
    hvd = _init(stall_warning_s=0.5)
    out = {"h1": _h1_runs(hvd, rank, world),
           "synced": {(k, h): _synced_params(hvd, rank, k, h) for k, h in ((1, 3), (2, 4))},
           "straight": _run_and_save(hvd, rank, path),
           "slow": _slow(hvd, rank), "auto": _auto(hvd, rank),
           "scheduled": {(f, d): _scheduled(hvd, rank, f, d)
                         for f, d in ((True, 0.5), (False, 0.5), (True, 1.0), (False, 1.0))},
           "bad_inner_lr": _bad_inner_lr(hvd), "first_step": _first_step_bytes(hvd, rank)}
    out["mismatch"] = _mismatch(hvd, rank)  # last: it leaves the ranks out of step
    return out


def _three(rank, world):
    return {"h1": _h1_runs(_init(), rank, world)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("diloco") / "ckpt")
    return path, run_gloo(_two, 2, path)


@pytest.fixture(scope="module")
def three():
    return run_gloo(_three, 3)


# -- H=1, no outer optimizer, exact: synchronous data parallel --------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_h1_without_outer_optimizer_is_synchronous_data_parallel(world, request):
    """Averaging parameters after every SGD step is averaging the gradients: equal to
    float32 rounding (``a - (a - x)`` is not ``x`` bit for bit), with and without a
    synchronous warm-up; H=2 is not."""
    results = [r["h1"] for r in (request.getfixturevalue("two")[1] if world == 2
                                 else request.getfixturevalue("three"))]
    for runs in results:
        ref = runs["ref"]
        for key in ((1, 0), (1, 2)):
            for got, want in zip(runs[key], ref):
                assert (got - want).abs().max() <= 2e-6 * want.abs().max(), key
        assert (runs[(2, 0)][-1] - ref[-1]).abs().max() > 1e-4 * ref[-1].abs().max()
    for r in range(1, world):  # and bit for bit the same on every rank
        assert all(torch.equal(a, b) for a, b in zip(results[r][(1, 0)], results[0][(1, 0)]))


# -- identical parameters after every sync, compressed, streaming -------------------------

@pytest.mark.parametrize("fragments,sync_every", [(1, 3), (2, 4)])
def test_parameters_identical_on_every_rank_after_each_sync(two, fragments, sync_every):
    """4-bit outer gradients with error feedback, Nesterov: after a fragment lands its
    parameters are the same on both ranks, bit for bit; between syncs they differ."""
    from cgx.diloco import FragmentSchedule
    res = [r["synced"][(fragments, sync_every)] for r in two[1]]
    sizes = [p.numel() for p in _model().parameters()]
    offsets = torch.tensor([0] + sizes).cumsum(0).tolist()
    delay = 0 if fragments == 1 else 1
    sched = FragmentSchedule.make(sizes, fragments, sync_every, delay)
    checked = 0
    for step in range(1, 11):  # local step `step` done; which fragments landed at it
        landed = [f for f in range(fragments) if step - delay >= 1 and
                  f in sched.syncing(step - delay)]
        for f in range(fragments):
            idx = sched.groups[f]
            lo, hi = offsets[idx[0]], offsets[idx[-1] + 1]
            same = torch.equal(res[0][step - 1][lo:hi], res[1][step - 1][lo:hi])
            assert same == (f in landed), (step, f)
            checked += f in landed
    assert checked >= 3


# -- resume mid-round in fresh processes ----------------------------------------------

def test_resume_mid_round_is_bit_exact_in_fresh_processes(two):
    """Saved after local step 4, with fragment 1's exchange in flight."""
    path, results = two
    resumed = run_gloo(_resume, 2, path)
    for r, res in enumerate(results):
        assert all(torch.equal(x, y) for x, y in zip(res["straight"], resumed[r]))
    assert not torch.equal(results[0]["straight"][-1], results[1]["straight"][-1])


# -- a slow rank; ranks that disagree ---------------------------------------------------

def test_a_slow_rank_does_not_change_the_outer_step_and_is_reported(two):
    """Rank 1 sleeps before its 6th step, while rank 0's exchange of step 6 waits for it:
    the same parameters as without the sleep, bit for bit, and a stall warning."""
    for res in two[1]:
        runs, _ = res["slow"]
        assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    warnings = two[1][0]["slow"][1]
    assert any("diloco.fragment0" in w for w in warnings), warnings


def test_ranks_with_different_rounds_fail_with_a_mismatch(two):
    msgs = [r["mismatch"] for r in two[1]]
    assert all(m is not None and "step" in m for m in msgs), msgs


# -- sync_every="auto" ------------------------------------------------------------------

def test_auto_chooses_the_same_h_on_every_rank_and_trains_on(two):
    (h0, c0, p0), (h1, c1, p1) = (r["auto"] for r in two[1])
    assert h0 == h1 == c0.sync_every and h0 >= 50  # an outer optimizer: at least 50
    assert c0.step_s == c1.step_s  # the slowest rank's, agreed
    assert torch.equal(p0[2], p1[2])  # the calibration round synced at step 3


# -- the anchors: a broadcast only where the ranks differ -------------------------------

def test_the_anchor_broadcast_is_skipped_when_the_ranks_start_equal(two):
    """Rank 0 sends a whole model (4 bytes a parameter) when the ranks start different,
    with a warning that says what to call, and only the digests when they start equal.
    Either way each rank steps from rank 0's parameters, with the gradient it computed
    before the step (on its own parameters)."""
    numel = sum(p.numel() for p in _model().parameters())
    first = [r["first_step"] for r in two[1]]
    same_bytes, diff_bytes = (first[0][k][0] for k in (True, False))
    assert diff_bytes >= 4 * numel, diff_bytes
    assert same_bytes < 1000, same_bytes
    for r in (0, 1):
        assert first[r][True][2] == []
        assert any("broadcast_parameters" in w for w in first[r][False][2]), first[r][False][2]
        for same in (True, False):
            start, own = _model(seed=0), _model(seed=0 if same else r)
            _loss(own, r, 0).backward()
            with torch.no_grad():
                want = torch.cat([(p - 0.1 * q.grad).reshape(-1)
                                  for p, q in zip(start.parameters(), own.parameters())])
            got = first[r][same][1]
            assert (got - want).abs().max() <= 1e-6 * want.abs().max(), (r, same)


# -- the outer momentum under a decaying inner learning rate ------------------------------

def test_outer_momentum_follows_the_inner_learning_rate(two):
    """``OuterSGD(follow_inner_lr=True)``: the buffer is rescaled by each parameter group's
    inner lr change (halved every round here); the default keeps DiLoCo's update, and so
    does ``follow_inner_lr`` under a constant lr, bit for bit."""
    want = {f: _scheduled_reference(2, 0.5, f) for f in (True, False)}
    for res in two[1]:
        runs = res["scheduled"]
        for follow in (True, False):
            for got, ref in zip(runs[(follow, 0.5)], want[follow]):
                assert (got - ref).abs().max() <= 2e-6 * ref.abs().max(), follow
        assert all(torch.equal(a, b) for a, b in zip(runs[(True, 1.0)], runs[(False, 1.0)]))
        last = (runs[(True, 0.5)][-1] - runs[(False, 0.5)][-1]).abs().max()
        assert last > 1e-3 * want[True][-1].abs().max()  # the rescaling changed the run
    assert all(torch.equal(a, b) for a, b in
               zip(two[1][0]["scheduled"][(True, 0.5)], two[1][1]["scheduled"][(True, 0.5)]))


def test_an_unusable_inner_learning_rate_is_refused(two):
    msgs = two[1][0]["bad_inner_lr"]
    assert len(msgs) == 5, msgs
    assert all("inner_lr must be one finite number >= 0 or one per parameter (1)" in m
               for m in msgs), msgs


# -- the example ------------------------------------------------------------------------

def test_example_learns_with_streaming_fragments():
    import re
    from pathlib import Path
    from distutil import run_ranks
    path = Path(__file__).resolve().parent.parent / "examples" / "diloco_digits.py"
    run = run_ranks(path=str(path), nprocs=2, launcher="cgxrun-gloo", timeout=300,
                    args=["--epochs", "4", "--sync-every", "8", "--fragments", "2"])
    assert run.returncode == 0 and not run.timed_out, run.tail()
    acc = re.findall(r"test accuracy ([\d.]+)%", run.stdout)
    assert acc and float(acc[-1]) > 80.0, run.stdout[-2000:]
