"""Deprecated import path of Horovod's functional collectives: use :mod:`cgx.ops` (kept one
release)."""

from cgx.ops import *  # noqa: F401,F403
from cgx.ops import (Adasum, Average, Max, Min, Product, Sum, allgather_object,  # noqa: F401
                     allgather_rows, alltoall_rows, answer_joined, broadcast_object,
                     broadcast_tensor, broadcast_tensors, check, check_root, group_rank,
                     group_size, op_name, reduce_tensors, reducescatter_rows, resolve_op,
                     resolve_process_set, sparse_reduce)
