"""Elastic training: a job that survives lost ranks and takes in new ones.

Horovod's elastic API on torch.distributed.elastic's dynamic rendezvous
(docs/elastic.md). A lost rank costs the survivors the steps since the last
``state.commit()`` and the time to form a new world; they keep their processes and
memory. Ranks started later join at the next commit and get the state by broadcast.

* :mod:`cgx.launch.elastic_env` -- what ``cgxrun``'s driver tells its ranks.
* :mod:`cgx.launch.membership` -- this process's place in the rendezvous; each round
  a world with its own store.
* :mod:`cgx.elastic.state` -- ``State``/``ObjectState``: commit, restore, sync from
  the senior rank, host updates.
* :mod:`cgx.elastic.run` -- the loop of ``hvd.elastic.run``.

The framework adapters build on these: ``cgx.torch.elastic`` (``TorchState``,
``ElasticSampler``, ``run``).
"""

from cgx.elastic.run import ResetLimitError, is_failure, run_fn
from cgx.elastic.state import HostsUpdatedInterrupt, ObjectState, State

__all__ = ["HostsUpdatedInterrupt", "ObjectState", "ResetLimitError", "State", "is_failure",
           "run_fn"]
