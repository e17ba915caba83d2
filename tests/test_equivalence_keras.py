"""2 real ranks with an exact exchange train Keras models exactly like one process on all the
data: model.fit with callbacks and validation, a custom GradientTape loop, and with
sufficient factors a kernel also used outside its layer (a tied head, a Lambda, an extra
loss term) (tests/patterns_keras.py); the fit and tape patterns also with auto restricted to
the exact candidate."""

import pytest

pytest.importorskip("cgx.tensorflow", exc_type=ImportError)

from equivalence import assert_equivalent, run_patterns  # noqa: E402
from patterns_keras import AUTO_PATTERNS, PATTERNS  # noqa: E402

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def reference():
    return run_patterns("patterns_keras", PATTERNS, world=1)


@pytest.mark.smoke  # the Keras smoke of `make test-fast`
def test_keras_patterns_match_the_single_process_reference(reference):
    assert_equivalent(run_patterns("patterns_keras", PATTERNS, world=2), reference)


def test_keras_patterns_with_auto_restricted_to_exact_match_the_reference(reference):
    got = run_patterns("patterns_keras", AUTO_PATTERNS, world=2, variant="auto-exact")
    assert_equivalent(got, {n: reference[n] for n in AUTO_PATTERNS})
