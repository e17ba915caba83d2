"""2 real ranks with an exact exchange train Keras models exactly like one process on all the
data: model.fit with callbacks and validation, a custom GradientTape loop, and with
sufficient factors a kernel also used outside its layer (a tied head, a Lambda, an extra
loss term) (tests/patterns_keras.py)."""

import pytest

pytest.importorskip("cgx.tensorflow", exc_type=ImportError)

from equivalence import assert_equivalent, run_patterns  # noqa: E402
from patterns_keras import PATTERNS  # noqa: E402

pytestmark = pytest.mark.multiproc


def test_keras_patterns_match_the_single_process_reference():
    reference = run_patterns("patterns_keras", PATTERNS, world=1)
    assert_equivalent(run_patterns("patterns_keras", PATTERNS, world=2), reference)
