"""Fusion buckets every adapter shares (cgx.exchange.buckets): ready order, the caps, user
groups, num_groups, and sufficient-factor layers in buckets of their own."""

from cgx.exchange.buckets import FIRST_BUCKET_BYTES, compose_buckets, ready_order_buckets


def test_ready_order_with_a_small_first_bucket_and_the_cap():
    assert ready_order_buckets([4] * 6, 1 << 30) == [[5, 4, 3, 2, 1, 0]]
    mib = 1 << 20
    # The first bucket is capped at FIRST_BUCKET_BYTES, the others at the cap.
    assert ready_order_buckets([mib] * 5, 3 * mib) == [[4], [3, 2, 1], [0]]
    assert ready_order_buckets([4 * mib, 4], 3 * mib) == [[1], [0]]  # too big: alone
    assert FIRST_BUCKET_BYTES == mib


def test_a_factor_layer_cuts_the_ready_order_where_backward_produces_it():
    assert compose_buckets([4] * 6, 1 << 30) == [[5, 4, 3, 2, 1, 0]]
    assert compose_buckets([4] * 6, 1 << 30, factor_weights=[3], factor_biases={3: 4}) == \
        [[5], [3, 4], [2, 1, 0]]


def test_num_groups_place_a_factor_bucket_before_what_backward_reaches_later():
    assert compose_buckets([4] * 6, 1 << 30, num_groups=2) == [[5, 4, 3], [2, 1, 0]]
    assert compose_buckets([4] * 6, 1 << 30, num_groups=2, factor_weights=[3],
                           factor_biases={3: 4}) == [[3, 4], [5, 2], [1, 0]]
    assert compose_buckets([4] * 2, 1 << 30, num_groups=5) == [[1], [0]]


def test_user_groups_then_the_rest_then_the_factor_buckets():
    assert compose_buckets([4] * 6, 1 << 30, user_groups=[[0, 1], [5]]) == \
        [[0, 1], [5], [2, 3, 4]]
    assert compose_buckets([4] * 6, 1 << 30, user_groups=[[0, 1], [5, 3]], factor_weights=[3],
                           factor_biases={3: 4}) == [[0, 1], [5], [2], [3, 4]]
