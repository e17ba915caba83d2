"""Horovod usage patterns run twice: under Horovod (horovodrun) and under cgx (cgxrun), the same
code with only the import swapped; tests/test_horovod_fidelity.py compares the reports.

    python tests/fidelity_cases.py horovod|cgx CASE

Each case returns a JSON-able dict. Cases ending in ``_tf`` import the TensorFlow module.
"""

from __future__ import annotations

import importlib
import itertools
import sys
import warnings

import torch

from distutil import report


def _grad_of(fn, x) -> list:
    """The gradient ``fn`` sends back to ``x`` (a fresh leaf)."""
    x = x.clone().requires_grad_()
    fn(x).backward()
    return x.grad.tolist()


def case_gradients(hvd) -> dict:
    """Every collective's gradient, Sum and Average, with a rank-dependent upstream gradient
    (so that averaging, summing and scaling all show)."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    w = torch.arange(1.0, 7.0) * (r + 1)  # the upstream gradient differs per rank
    x = torch.arange(6.0) + r
    out = {}
    for op in ("Sum", "Average"):
        o = getattr(hvd, op)
        out[f"allreduce_{op}"] = _grad_of(
            lambda t: (hvd.allreduce(t, op=o, name=f"ar{op}") * w).sum(), x)
        out[f"allreduce_scaled_{op}"] = _grad_of(
            lambda t: (hvd.allreduce(t, op=o, name=f"ars{op}", prescale_factor=2.0,
                                     postscale_factor=0.25) * w).sum(), x)
        out[f"grouped_allreduce_{op}"] = _grad_of(
            lambda t: sum((y * w * (k + 1)).sum() for k, y in enumerate(
                hvd.grouped_allreduce([t, t * 3], op=o, name=f"gar{op}"))), x)
        rows = 2 * n + 1  # not divisible by the number of ranks: uneven split
        m = torch.arange(float(rows * 2)).view(rows, 2)
        out[f"reducescatter_{op}"] = _grad_of(
            lambda t: (hvd.reducescatter(t, op=o, name=f"rs{op}") * (r + 2)).sum(), m)
        out[f"reducescatter_scaled_{op}"] = _grad_of(
            lambda t: (hvd.reducescatter(t, op=o, name=f"rss{op}", prescale_factor=3.0,
                                         postscale_factor=0.25) * (r + 2)).sum(), m)
        out[f"grouped_reducescatter_{op}"] = _grad_of(
            lambda t: sum((y * (r + 2) * (k + 1)).sum() for k, y in enumerate(
                hvd.grouped_reducescatter([t, t * 2], op=o))), m)
    g = torch.full((r + 1, 2), 1.0)
    out["allgather"] = _grad_of(
        lambda t: (hvd.allgather(t, name="ag") * torch.arange(
            float((n * (n + 1) // 2) * 2)).view(-1, 2) * (r + 1)).sum(), g)
    out["grouped_allgather"] = _grad_of(
        lambda t: sum((y * (r + 1) * (k + 1)).sum() for k, y in enumerate(
            hvd.grouped_allgather([t, t * 2], name="gag"))), g)
    out["broadcast"] = _grad_of(lambda t: (hvd.broadcast(t, root_rank=n - 1, name="bc")
                                           * w).sum(), x)
    return out


def case_alltoall_gradient(hvd) -> dict:
    """alltoall is differentiable: the gradient goes back along the reverse alltoall."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {}
    x = (torch.arange(float(2 * n)) + 10 * r).view(n, 2)
    out["equal"] = _grad_of(
        lambda t: (hvd.alltoall(t, name="a2a") * (torch.arange(2.0 * n).view(n, 2) + r)).sum(),
        x)
    splits = torch.tensor([(r + j) % 3 for j in range(n)], dtype=torch.int32)
    rows = int(splits.sum())
    y = torch.arange(float(rows * 3)).view(rows, 3) + r

    def uneven(t):
        got, received = hvd.alltoall(t, splits=splits, name="a2a_splits")
        out["received"] = received.tolist()
        return (got * (torch.arange(float(got.numel())).view_as(got) + 1)).sum()

    out["splits"] = _grad_of(uneven, y)
    return out


def case_optimizer_state(hvd) -> dict:
    """broadcast_optimizer_state right after creating the optimizer (Horovod's no-grad model:
    a parameter without requires_grad), and with state for some parameters only."""
    hvd.init()
    r = hvd.rank()
    out = {}

    class ModelNoGrad(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a = torch.nn.Parameter(a.int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    torch.manual_seed(r)
    model = ModelNoGrad(torch.tensor([1.0, 3.0]), torch.rand(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9,
                          nesterov=True)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    out["no_grad_a"] = opt.param_groups[0]["params"][0].grad is None
    out["grad_b"] = grad.tolist()
    out["bgrad"] = hvd.broadcast(grad, root_rank=0).tolist()
    out["b"] = model.b.detach().tolist()
    out["momentum"] = [v["momentum_buffer"].tolist() for v in opt.state_dict()["state"].values()]
    # Adam, fresh on every rank; then another that has state for one layer only.
    torch.manual_seed(10 + r)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    adam = torch.optim.Adam(net.parameters(), lr=0.1 * (r + 1))
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    out["adam_fresh"] = _state(adam)
    out["adam_lr"] = adam.param_groups[0]["lr"]
    adam = torch.optim.Adam(net.parameters(), lr=0.1 * (r + 1))
    net.zero_grad(set_to_none=True)
    net[1](torch.ones(1, 2) * (r + 1)).sum().backward()  # the first layer has no gradient
    adam.step()
    hvd.broadcast_optimizer_state(adam, root_rank=1)
    out["adam_partial"] = _state(adam)
    out["adam_partial_lr"] = adam.param_groups[0]["lr"]
    out["no_grad_first"] = [p.grad is None for p in net[0].parameters()]
    return out


def _state(opt) -> dict:
    return {str(k): {n: v.tolist() if torch.is_tensor(v) else v for n, v in s.items()}
            for k, s in opt.state_dict()["state"].items()}


def case_optimizer_names(hvd) -> dict:
    """opt._parameter_names (what Horovod users and tools read) and the warning when step()
    follows synchronize() without skip_synchronize()."""
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    out = {}
    for named in (True, False):
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters() if named else None)
        names = opt._parameter_names
        out[f"names_{named}"] = sorted(names[p] for p in model.parameters())
        out[f"keys_are_params_{named}"] = all(any(k is p for p in model.parameters())
                                              for k in names)
        opt.zero_grad()
        model(torch.ones(4, 2)).sum().backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            opt.step()
        # The rest of the message differs (cgx does not reduce twice); the sentence is kept.
        out[f"warnings_{named}"] = [
            "optimizer.step() called without optimizer.skip_synchronize()" in str(w.message)
            for w in ws]
    return out


def case_sparse_adam_dense(hvd) -> dict:
    """sparse_as_dense=True with SparseAdam: reduced densely, handed back sparse."""
    hvd.init()
    r = hvd.rank()
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 3, sparse=True)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters(), sparse_as_dense=True)
    for step in range(3):
        opt.zero_grad()
        ids = torch.tensor([(r * 5 + step * 3 + k) % 12 for k in range(4)])
        (emb(ids) * torch.arange(1.0, 4.0)).sum().backward()
        opt.step()
    return {"weight": emb.weight.detach().tolist(), "grad_is_sparse": emb.weight.grad.is_sparse,
            "grad": emb.weight.grad.to_dense().tolist()}


def case_join(hvd) -> dict:
    """Horovod's join loop: named async allreduces (cached and not), then every rank joins
    first in turn while the others allreduce, over dtypes and dims."""
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out = {"rets": [], "results": []}
    dtypes = [torch.int32, torch.int64, torch.float32, torch.float64]
    for dtype, dim, first, caching in itertools.product(dtypes, [1, 2, 3], range(n),
                                                        [False, True]):
        torch.manual_seed(1234)
        a = torch.empty(*([5] * dim)).random_(-100, 100).to(dtype)
        b = torch.empty(*([17] * dim)).random_(-100, 100).to(dtype)
        if caching:
            hvd.synchronize(hvd.allreduce_async(a, name="tensor_a", average=True))
            hvd.synchronize(hvd.allreduce_async(b, name="tensor_b", average=True))
        if r == first:
            out["rets"].append(hvd.join())
            continue
        ha = hvd.allreduce_async(a, name="tensor_a", average=True)
        hb = hvd.allreduce_async(b, name="tensor_b", average=True)
        avg_a, avg_b = hvd.synchronize(ha), hvd.synchronize(hb)
        out["rets"].append(hvd.join())
        # The joined rank contributes zeros: (size - 1) / size of the tensor (integers
        # rounded, so the smallest and the largest difference).
        diffs = [avg.double() - t.double() * (n - 1) / n for avg, t in ((avg_a, a), (avg_b, b))]
        out["results"].append([[d.min().item(), d.max().item()] for d in diffs] +
                              [str(avg_a.dtype)])
    return out


def _tf_grad_of(fn, x) -> list:
    import tensorflow as tf
    v = tf.Variable(x)
    with tf.GradientTape() as tape:
        loss = fn(v)
    return tape.gradient(loss, v).numpy().tolist()


def case_gradients_tf(hvd) -> dict:
    """case_gradients and case_alltoall_gradient with horovod.tensorflow's collectives."""
    import tensorflow as tf

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    w = tf.range(1.0, 7.0) * (r + 1)
    x = tf.range(6.0) + r
    rows = 2 * n + 1
    m = tf.reshape(tf.range(float(rows * 2)), (rows, 2))
    out = {}
    for op in ("Sum", "Average"):
        o = getattr(hvd, op)
        out[f"allreduce_{op}"] = _tf_grad_of(
            lambda t: tf.reduce_sum(hvd.allreduce(t, op=o, name=f"ar{op}") * w), x)
        out[f"allreduce_scaled_{op}"] = _tf_grad_of(
            lambda t: tf.reduce_sum(hvd.allreduce(t, op=o, name=f"ars{op}", prescale_factor=2.0,
                                                  postscale_factor=0.25) * w), x)
        out[f"grouped_allreduce_{op}"] = _tf_grad_of(
            lambda t: sum(tf.reduce_sum(y * w * (k + 1)) for k, y in enumerate(
                hvd.grouped_allreduce([t, t * 3], op=o, name=f"gar{op}"))), x)
        out[f"reducescatter_{op}"] = _tf_grad_of(
            lambda t: tf.reduce_sum(hvd.reducescatter(t, op=o, name=f"rs{op}") * (r + 2)), m)
        out[f"reducescatter_scaled_{op}"] = _tf_grad_of(
            lambda t: tf.reduce_sum(hvd.reducescatter(t, op=o, name=f"rss{op}",
                                                      prescale_factor=3.0,
                                                      postscale_factor=0.25) * (r + 2)), m)
        out[f"grouped_reducescatter_{op}"] = _tf_grad_of(
            lambda t: sum(tf.reduce_sum(y * (r + 2) * (k + 1)) for k, y in enumerate(
                hvd.grouped_reducescatter([t, t * 2], op=o))), m)
    g = tf.fill((r + 1, 2), 1.0)
    out["allgather"] = _tf_grad_of(lambda t: tf.reduce_sum(hvd.allgather(t, name="ag") * tf.reshape(
        tf.range(float(n * (n + 1))), (-1, 2)) * (r + 1)), g)
    out["grouped_allgather"] = _tf_grad_of(
        lambda t: sum(tf.reduce_sum(y * (r + 1) * (k + 1)) for k, y in enumerate(
            hvd.grouped_allgather([t, t * 2], name="gag"))), g)
    out["broadcast"] = _tf_grad_of(
        lambda t: tf.reduce_sum(hvd.broadcast(t, root_rank=n - 1, name="bc") * w), x)
    a = tf.reshape(tf.range(float(2 * n)) + 10 * r, (n, 2))
    out["alltoall"] = _tf_grad_of(lambda t: tf.reduce_sum(hvd.alltoall(t, name="a2a") * (
        tf.reshape(tf.range(2.0 * n), (n, 2)) + r)), a)
    splits = tf.constant([(r + j) % 3 for j in range(n)], dtype=tf.int32)
    total = int(tf.reduce_sum(splits))
    y = tf.reshape(tf.range(float(total * 3)), (total, 3)) + r

    def uneven(t):
        got, _ = hvd.alltoall(t, splits=splits, name="a2a_splits")
        return tf.reduce_sum(got * (tf.reshape(tf.range(float(tf.size(got))), tf.shape(got)) + 1))

    out["alltoall_splits"] = _tf_grad_of(uneven, y)
    return out


def case_join_refusals(hvd) -> dict:
    """While rank 0 has joined, the others' allgather and broadcast fail (a RuntimeError, as
    in Horovod) and the job goes on: an allreduce still counts rank 0 as zeros."""
    hvd.init()
    r = hvd.rank()
    out = {}
    if r == 0:
        out["ret"] = hvd.join()
        return out
    for kind, call in (("allgather", lambda: hvd.allgather(torch.ones(2, 3), name="jg")),
                       ("broadcast", lambda: hvd.broadcast(torch.ones(3), 1, name="jb"))):
        try:
            call()
            out[kind] = "no error"
        except RuntimeError:
            out[kind] = "RuntimeError"
    out["sum"] = hvd.allreduce(torch.full((3,), float(r)), op=hvd.Sum, name="js").tolist()
    out["ret"] = hvd.join()
    return out


TF_DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "int64", "float16", "float32",
             "float64", "bool"]


def case_dtypes_tf(hvd) -> dict:
    """broadcast and allgather of every dtype Horovod lists, bit-exact."""
    import tensorflow as tf

    hvd.init()
    r = hvd.rank()
    out = {}
    for name in TF_DTYPES:
        dt = getattr(tf, name)
        x = tf.cast(tf.constant([[1, 0, 3], [2, 5, 0]]) + r * 7, dt)
        if name == "bool":
            x = tf.cast(tf.constant([[1, 0, 1], [0, 1, 1]]) * (1 - r), dt)
        out[f"broadcast_{name}"] = _tf_value(hvd.broadcast(x, root_rank=1, name=f"b{name}"))
        out[f"allgather_{name}"] = _tf_value(hvd.allgather(x, name=f"g{name}"))
        v = tf.Variable(x)
        hvd.broadcast_variables([v], root_rank=1)
        out[f"variable_{name}"] = _tf_value(v)
    return out


def _tf_value(t) -> list:
    a = t.numpy()
    return [str(a.dtype), a.tolist()]


def case_helpers_tf(hvd) -> dict:
    """The helpers horovod.tensorflow exports from its util module, which Horovod's scripts
    reach for (``if hvd._executing_eagerly(): ...``)."""
    import tensorflow as tf

    hvd.init()
    r = hvd.rank()
    out = {"eager": hvd._executing_eagerly(),
           "traced": bool(tf.function(lambda: tf.constant(hvd._executing_eagerly()))())}
    calls = []

    @hvd._cache
    def double(x):
        calls.append(x)
        return x * 2

    out["cache"] = [double(1), double(1), double(2), len(calls)]
    sub = hvd._make_subgraph(lambda v: v * 2.0)
    out["subgraph"] = [float(sub(tf.constant(3.0))), hasattr(sub, "get_concrete_function")]
    # Horovod's broadcast_object_fn is for TF1 graphs (tf.placeholder): its scripts pick.
    bcast = (lambda obj: hvd.broadcast_object(obj, root_rank=1)) if hvd._executing_eagerly() \
        else hvd.broadcast_object_fn(root_rank=1)
    out["object"] = bcast({"from": r})
    return out


TORCH_CASES = ("gradients", "alltoall_gradient", "optimizer_state", "optimizer_names",
               "sparse_adam_dense", "join", "join_refusals")
TF_CASES = ("gradients_tf", "dtypes_tf", "helpers_tf")


def case_torch(hvd) -> dict:
    """Every torch case in one launch (start-up is most of a launch's time)."""
    return {c: CASES[c](hvd) for c in TORCH_CASES}


def case_all_tf(hvd) -> dict:
    return {c: CASES[c](hvd) for c in TF_CASES}


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def main() -> None:
    impl, case = sys.argv[1], sys.argv[2]
    if impl not in ("horovod", "cgx"):
        sys.exit(f"usage: {sys.argv[0]} horovod|cgx CASE")
    hvd = importlib.import_module(f"{impl}.tensorflow" if case.endswith("_tf") else
                                  f"{impl}.torch")
    report(CASES[case](hvd))
    hvd.shutdown()


if __name__ == "__main__":
    main()
