"""Horovod 0.28.1's behaviour in the places where cgx used to differ: every collective's
gradient (Sum and Average), alltoall's gradient, broadcast_optimizer_state of a fresh or
partly stepped optimizer, ``opt._parameter_names`` and the synchronize warning,
``sparse_as_dense=True`` with SparseAdam, ``join()`` while the other ranks allreduce, every
dtype through TensorFlow's broadcast, and horovod.tensorflow's util helpers.

The rank programs are tests/fidelity_cases.py. Under cgx they run on 2 and 3 Gloo ranks and
are checked against values computed here from Horovod's rules; under horovodrun with
Horovod itself they run on 2 ranks and cgx's report must equal Horovod's.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from distutil import TESTS_DIR, run_ranks
from spawn import run_gloo
from test_sparse_gradients import embedding_reference

pytestmark = pytest.mark.multiproc

SCRIPT = str(TESTS_DIR / "fidelity_cases.py")


def _cgx_case(rank, world, case):
    import fidelity_cases
    hvd = importlib.import_module("cgx.tensorflow" if case.endswith("_tf") else "cgx.torch")
    return fidelity_cases.CASES[case](hvd)


_reports: dict = {}


def _cgx(case: str, world: int) -> list:
    """Every rank's report of ``case`` under cgx (one launch per case and world size)."""
    if (case, world) not in _reports:
        outs = run_gloo(_cgx_case, world, case, timeout=420)
        _reports[case, world] = json.loads(json.dumps(outs))  # as the JSON reports read
    return _reports[case, world]


# -- Horovod's rules, computed here ------------------------------------------------------

def _rows(rows: int, n: int) -> list:
    """Horovod's split of ``rows`` over ``n`` ranks (the first ``rows % n`` get one more)."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def _expected_gradients(r: int, n: int) -> dict:
    """fidelity_cases.case_gradients' gradients by Horovod's rules: allreduce's backward is
    the same allreduce; allgather's and broadcast's average the gradient (broadcast keeps
    it on the root only); reducescatter's allgathers it, times ``n`` for Sum."""
    w_sum = torch.arange(1.0, 7.0) * (n * (n + 1) // 2)  # sum over ranks s of w * (s + 1)
    out = {}
    rows = 2 * n + 1
    owner = torch.cat([torch.full((c, 2), float(s)) for s, c in enumerate(_rows(rows, n))])
    for op, scale in (("Sum", 1.0), ("Average", 1.0 / n)):
        out[f"allreduce_{op}"] = w_sum * scale
        out[f"allreduce_scaled_{op}"] = w_sum * scale * 2.0 * 0.25
        out[f"grouped_allreduce_{op}"] = w_sum * scale * (1 * 1 + 3 * 2)
        rs = (owner + 2) * (n if op == "Sum" else 1)  # rank s's upstream gradient is s + 2
        out[f"reducescatter_{op}"] = rs
        out[f"reducescatter_scaled_{op}"] = rs * 3.0 * 0.25
        out[f"grouped_reducescatter_{op}"] = rs * (1 * 1 + 2 * 2)
    total = n * (n + 1) // 2
    weights = torch.arange(float(total * 2)).view(-1, 2) * (n + 1) / 2  # averaged over ranks
    start = r * (r + 1) // 2
    out["allgather"] = weights[start:start + r + 1]
    out["grouped_allgather"] = torch.full((r + 1, 2), (1 * 1 + 2 * 2) * (n + 1) / 2)
    out["broadcast"] = w_sum / n if r == n - 1 else torch.zeros(6)
    return out


def _expected_alltoall(r: int, n: int) -> dict:
    """The gradient of a received row is sent back to the rank that sent the row."""
    equal = torch.tensor([[2.0 * r + j, 2.0 * r + 1 + j] for j in range(n)])
    splits = [[(i + j) % 3 for j in range(n)] for i in range(n)]  # splits[i][j]: i sends j
    grads = []
    for j in range(n):
        offset = sum(splits[i][j] for i in range(r))  # rows that j received before r's
        for k in range(splits[r][j]):
            grads.append([3.0 * (offset + k) + c + 1 for c in range(3)])
    return {"equal": equal, "splits": torch.tensor(grads).view(-1, 3),
            "received": [splits[i][r] for i in range(n)]}


def _check_gradients(report: dict, expected: dict) -> None:
    for key, want in expected.items():
        got = torch.tensor(report[key])
        assert torch.equal(got, want.view_as(got)), f"{key}: got {got.tolist()}, want {want}"


# -- cgx against Horovod's rules ----------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_collective_gradients_follow_horovod(world):
    for r, rep in enumerate(_cgx("torch", world)):
        _check_gradients(rep["gradients"], _expected_gradients(r, world))


@pytest.mark.parametrize("world", [2, 3])
def test_alltoall_is_differentiable(world):
    for r, rep in enumerate(_cgx("torch", world)):
        want = _expected_alltoall(r, world)
        got = rep["alltoall_gradient"]
        assert got["received"] == want["received"]
        _check_gradients(got, {"equal": want["equal"], "splits": want["splits"]})


@pytest.mark.parametrize("world", [2, 3])
def test_broadcast_optimizer_state_of_fresh_and_partial_optimizers(world):
    reps = [rep["optimizer_state"] for rep in _cgx("torch", world)]
    for rep in reps:
        # A fresh optimizer's state is created as Horovod does: zero gradients, one step.
        assert rep["no_grad_a"] is True and rep["grad_b"] == [0.0] * 4 == rep["bgrad"]
        assert rep["b"] == reps[0]["b"]
        torch.testing.assert_close(torch.tensor(rep["momentum"][0]),
                                   torch.tensor(reps[0]["b"]) * 1e-6)
        assert rep["adam_lr"] == 0.1  # root 0's learning rate
        assert sorted(rep["adam_fresh"]) == ["0", "1", "2", "3"]
        for state in rep["adam_fresh"].values():
            assert state["step"] == 1.0 and not torch.tensor(state["exp_avg"]).any()
        # State for some parameters only (the first layer never had a gradient): root 1's.
        assert sorted(rep["adam_partial"]) == ["2", "3"] and rep["no_grad_first"] == [True] * 2
        assert rep["adam_partial_lr"] == pytest.approx(0.2)
        torch.testing.assert_close(torch.tensor(rep["adam_partial"]["2"]["exp_avg"]),
                                   torch.tensor([[0.2, 0.2]]))  # 0.1 x root 1's input 2
        assert rep["adam_partial"] == reps[1]["adam_partial"]


def test_parameter_names_and_synchronize_warning():
    for rep in _cgx("torch", 2):
        names = rep["optimizer_names"]
        assert names["names_True"] == ["0.bias", "0.weight", "1.bias", "1.weight"]
        assert names["names_False"] == [f"allreduce.noname.0.{j}" for j in range(4)]
        assert names["keys_are_params_True"] and names["keys_are_params_False"]
        # One warning each time, with Horovod's sentence in it.
        assert names["warnings_True"] == [True] == names["warnings_False"]


@pytest.mark.parametrize("world", [2, 3])
def test_sparse_as_dense_hands_sparse_adam_a_sparse_gradient(world):
    for rep in _cgx("torch", world):
        got = rep["sparse_adam_dense"]
        assert got["grad_is_sparse"] is True
        torch.testing.assert_close(torch.tensor(got["weight"]),
                                   embedding_reference(world, sgd=False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 3])
def test_join_while_others_allreduce(world):
    """Horovod's join test: every rank joins first in turn, the others allreduce named
    tensors (the joined rank adds zeros: the average is (n - 1) / n of the tensor)."""
    reps = [rep["join"] for rep in _cgx("torch", world)]
    firsts = [first for _dtype in range(4) for _dim in range(3) for first in range(world)
              for _caching in range(2)]
    want = [max(r for r in range(world) if r != first) for first in firsts]
    for r, rep in enumerate(reps):
        assert rep["rets"] == want  # the rank that joined last
        assert len(rep["results"]) == sum(first != r for first in firsts)
        for diff_a, diff_b, dtype in rep["results"]:
            worst = max(map(abs, diff_a + diff_b))
            # Integers are rounded toward zero (Horovod's integer average); floats to their
            # precision (values up to 100).
            assert worst < (1.0 if "int" in dtype else 1e-5), (dtype, worst)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_other_than_allreduce_fail_while_a_rank_has_joined(world):
    reps = [rep["join_refusals"] for rep in _cgx("torch", world)]
    assert reps[0] == {"ret": world - 1}
    for rep in reps[1:]:
        assert rep == {"allgather": "RuntimeError", "broadcast": "RuntimeError",
                       "sum": [float(sum(range(world)))] * 3, "ret": world - 1}


def test_join_without_the_consistency_check(monkeypatch):
    """CGX_CHECK_CONSISTENCY=0 leaves out the digests, not the status exchange join needs."""
    monkeypatch.setenv("CGX_CHECK_CONSISTENCY", "0")
    reps = run_gloo(_cgx_case, 2, "join", timeout=240)
    assert [rep["rets"] for rep in reps] == [[1, 1, 0, 0] * 12] * 2


def _names_differ(rank, world):
    import cgx.torch as hvd
    hvd.init()
    from cgx.errors import CollectiveMismatchError
    try:
        return hvd.allreduce(torch.full((4,), float(rank + 1)), name=f"metric{rank}",
                             op=hvd.Sum).tolist()
    except CollectiveMismatchError as e:
        return str(e)


def test_the_consistency_check_can_be_turned_off(monkeypatch):
    """CGX_CHECK_CONSISTENCY=0: ranks that name one collective differently are not
    compared; the values are summed as they come (with the check: an error, above)."""
    assert "metric0" in run_gloo(_names_differ, 2, timeout=120)[0]
    monkeypatch.setenv("CGX_CHECK_CONSISTENCY", "0")
    assert run_gloo(_names_differ, 2, timeout=120) == [[3.0] * 4] * 2


# -- TensorFlow ---------------------------------------------------------------------------

def test_tensorflow_collective_gradients_follow_horovod():
    for r, rep in enumerate(_cgx("all_tf", 2)):
        got = rep["gradients_tf"]
        _check_gradients(got, _expected_gradients(r, 2))
        a2a = _expected_alltoall(r, 2)
        _check_gradients(got, {"alltoall": a2a["equal"], "alltoall_splits": a2a["splits"]})


def test_tensorflow_broadcast_and_allgather_of_every_horovod_dtype():
    import fidelity_cases
    import numpy as np
    outs = [rep["dtypes_tf"] for rep in _cgx("all_tf", 2)]
    for name in fidelity_cases.TF_DTYPES:
        values = [np.array([[1, 0, 3], [2, 5, 0]]) + r * 7 for r in range(2)]
        if name == "bool":
            values = [np.array([[1, 0, 1], [0, 1, 1]]) * (1 - r) for r in range(2)]
        values = [v.astype(name).tolist() for v in values]
        for out in outs:
            assert out[f"broadcast_{name}"] == [name, values[1]]
            assert out[f"variable_{name}"] == [name, values[1]]
            assert out[f"allgather_{name}"] == [name, values[0] + values[1]]


def test_tensorflow_util_helpers():
    for rep in _cgx("all_tf", 2):
        assert rep["helpers_tf"] == {"eager": True, "traced": False, "cache": [2, 2, 4, 2],
                                     "subgraph": [6.0, True], "object": {"from": 1}}


# -- side by side with Horovod --------------------------------------------------------------

def _assert_same(mine, theirs, where="report") -> None:
    """Equal reports; floats to float32 precision (summation orders may differ)."""
    if isinstance(theirs, dict):
        assert isinstance(mine, dict) and sorted(mine) == sorted(theirs), where
        for k in theirs:
            _assert_same(mine[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list):
        assert isinstance(mine, list) and len(mine) == len(theirs), where
        for i, (m, t) in enumerate(zip(mine, theirs)):
            _assert_same(m, t, f"{where}[{i}]")
    elif isinstance(theirs, float):
        assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-7), f"{where}: {mine} != {theirs}"
    else:
        assert mine == theirs, f"{where}: {mine!r} != {theirs!r}"


@pytest.mark.parametrize("case", ["torch", "all_tf"])
def test_matches_horovod(horovodrun, case):
    theirs = run_ranks(path=SCRIPT, nprocs=2, launcher="horovodrun", args=["horovod", case],
                       launcher_args=["--gloo"], timeout=420).check()
    mine = _cgx(case, 2)
    for r, (m, t) in enumerate(zip(mine, theirs)):
        _assert_same(m, t, f"rank {r}")
