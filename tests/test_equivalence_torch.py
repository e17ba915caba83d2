"""2 (and 3) real ranks with an exact exchange train exactly like one process on all the data,
for the training patterns users write (tests/patterns_torch.py), in every variant (also
with sufficient factors, with auto restricted to the exact candidate, with the planned
exchange restricted to exact options, and with the deciding exchange restricted to exact
candidates, alone and given the model for sufficient factors)."""

import pytest

from equivalence import assert_equivalent, run_patterns
from patterns_torch import PATTERNS, VARIANTS

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def reference():
    return run_patterns("patterns_torch", PATTERNS, world=1)


# Every variant on 2 ranks; on 3 (uneven chunks) the plain exchange and the factors: the
# auto and planned variants restricted to exact options reduce through the same path.
# (2, "plain") is the PyTorch smoke of `make test-fast`.
CASES = [pytest.param(2, v, marks=[pytest.mark.smoke] if v == "plain" else [])
         for v in VARIANTS] + [(3, v) for v in VARIANTS if v in ("plain", "sfb", "decide-found")]


@pytest.mark.parametrize("world,variant", CASES)
def test_patterns_match_the_single_process_reference(world, variant, reference):
    assert_equivalent(run_patterns("patterns_torch", PATTERNS, world=world, variant=variant),
                      reference)
