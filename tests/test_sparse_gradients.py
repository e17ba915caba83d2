"""Sparse gradients in DistributedOptimizer: sparse_as_dense=False keeps them sparse (Horovod's
allgather of indices and values, so torch.optim.SparseAdam trains), True densifies them.
Compared with Horovod itself under horovodrun on the same program, and with one process
training on the average of the ranks' gradients."""

from __future__ import annotations

import pytest
import torch

from distutil import TESTS_DIR, run_ranks

pytestmark = pytest.mark.multiproc

SCRIPT = str(TESTS_DIR / "side_by_side.py")


def embedding_reference(world: int, sgd: bool) -> torch.Tensor:
    """One process training the ranks' embedding on the average of their gradients, with SGD
    (what a densified gradient gives) or SparseAdam; the programs in side_by_side.py and
    fidelity_cases.py train the same embedding on the same rows."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 3, sparse=True)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5) if sgd else \
        torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss = sum((emb(torch.tensor([(r * 5 + step * 3 + k) % 12 for k in range(4)]))
                    * torch.arange(1.0, 4.0)).sum() for r in range(world)) / world
        loss.backward()
        opt.step()
    return emb.weight.detach()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_sparse_and_densified_embeddings_train_like_one_process(nprocs):
    outs = run_ranks(path=SCRIPT, nprocs=nprocs, launcher="cgxrun-gloo",
                     args=["cgx", "sparse"], timeout=240).check()
    for o in outs:
        # sparse_as_dense reduces densely and hands the gradient back sparse, as Horovod.
        assert o["grad_is_sparse"] is True and o["dense_grad_is_sparse"] is True
        torch.testing.assert_close(torch.tensor(o["sparse"]), embedding_reference(nprocs, False),
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(o["dense"]), embedding_reference(nprocs, True),
                                   rtol=1e-5, atol=1e-6)


def test_sparse_gradients_match_horovod(horovodrun):
    theirs = run_ranks(path=SCRIPT, nprocs=2, launcher="horovodrun", args=["horovod", "sparse"],
                       launcher_args=["--gloo"], timeout=240).check()
    mine = run_ranks(path=SCRIPT, nprocs=2, launcher="cgxrun-gloo", args=["cgx", "sparse"],
                     timeout=240).check()
    for m, t in zip(mine, theirs):
        assert m["grad_is_sparse"] == t["grad_is_sparse"]
        assert m["dense_grad_is_sparse"] == t["dense_grad_is_sparse"]
        for key in ("sparse", "dense"):
            torch.testing.assert_close(torch.tensor(m[key]), torch.tensor(t[key]),
                                       rtol=1e-5, atol=1e-6)


def test_tensorflow_indexed_slices_match_horovod(horovodrun):
    theirs = run_ranks(path=SCRIPT, nprocs=2, launcher="horovodrun",
                       args=["horovod", "sparse_tf"], launcher_args=["--gloo"],
                       timeout=240).check()
    mine = run_ranks(path=SCRIPT, nprocs=2, launcher="cgxrun-gloo", args=["cgx", "sparse_tf"],
                     timeout=240).check()
    assert mine == theirs
    assert mine[0]["sparse_type"] == "IndexedSlices" and mine[0]["dense_type"] != "IndexedSlices"
    # Rows 0, 2 (rank 0) and 1, 3 (rank 1) and 5 (both) averaged: (1, 2, 3) / 2 per use.
    want = [[0.5, 1.0, 1.5]] * 4 + [[0.0] * 3] + [[1.0, 2.0, 3.0]] + [[0.0] * 3] * 2
    assert mine[0]["dense"] == want and mine[1]["sparse"] == want
