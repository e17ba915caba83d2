"""``hvd.broadcast_`` (in-place broadcast of variables), which every state sync relies on:
in ``tf.compat.v1`` graphs it used to leave non-root ranks at their own values, silently."""

from __future__ import annotations

import pytest

from distutil import TESTS_DIR, run_ranks

pytest.importorskip("tensorflow")
pytestmark = pytest.mark.multiproc

SCRIPT = str(TESTS_DIR / "side_by_side.py")


def _reports(launcher, impl, nprocs, launcher_args=()):
    return run_ranks(path=SCRIPT, nprocs=nprocs, launcher=launcher,
                     args=[impl, "broadcast_inplace_tf"], launcher_args=launcher_args,
                     timeout=300).check()


NPROCS = 3  # roots 0, 1 and 2: a root that is neither the first nor the last rank


@pytest.fixture(scope="module")
def cgx_reports():
    """cgx's run, once for both tests (a TensorFlow world costs 5 s of imports a rank)."""
    return _reports("cgxrun-gloo", "cgx", NPROCS)


def test_every_rank_holds_the_roots_values(cgx_reports):
    for rank, report in enumerate(cgx_reports):
        assert len(report) == NPROCS * 5 * 4  # roots x dtypes x (ref, resource, eager, function)
        for key, (returned, held, *dtype) in report.items():
            root = int(key.rsplit("-", 1)[1])
            want = root % 2 == 1 if "bool" in key else root
            flat = [x for row in returned for x in row]
            assert all(x == want for x in flat), f"rank {rank}, {key}: returned {returned}"
            assert held == returned, f"rank {rank}, {key}: the variable holds {held}"


def test_the_same_as_horovod(horovodrun, cgx_reports):
    theirs = _reports("horovodrun", "horovod", NPROCS, launcher_args=["--gloo"])
    assert cgx_reports == theirs
