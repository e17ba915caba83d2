"""Compressed collectives: algorithms (SRA, ring, allgather, hierarchical),
fusion plans, the pipeline scheduler, and the :class:`Reducer` API."""

from cgx.collectives.engine import Handle
from cgx.collectives.reducer import Reducer, ReduceStats

__all__ = ["Reducer", "ReduceStats", "Handle"]
