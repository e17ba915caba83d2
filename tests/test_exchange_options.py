"""The pieces every adapter shares: one options object, naming, the step recorder."""

import time
from types import SimpleNamespace

import pytest
import torch

from cgx.collectives.reducer import ReduceStats
from cgx.comm.base import ReduceOp
from cgx.errors import ConfigError
from cgx.exchange import ExchangeOptions
from cgx.exchange.options import default_names, names_by_id
from cgx.exchange.step import StepRecorder
from cgx.timeline import Timeline


def test_options_check_every_argument_once():
    opts = ExchangeOptions.checked("X", op=ReduceOp.SUM, num_groups=2, sparse_as_dense=1,
                                   rules=[{"pattern": "fc.*", "bits": 8}])
    assert (opts.op, opts.num_groups, opts.sparse_as_dense, opts.group) == \
        (ReduceOp.SUM, 2, True, None)
    with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
        ExchangeOptions.checked("X", backward_passes_per_step=0)
    with pytest.raises(ValueError, match="op must be Average or Sum for X"):
        ExchangeOptions.checked("X", op=ReduceOp.MAX)
    with pytest.raises(ValueError, match="num_groups must be an int >= 0"):
        ExchangeOptions.checked("X", num_groups=-1)
    with pytest.raises(ValueError, match="must be a ProcessSet"):
        ExchangeOptions.checked("X", process_set=object())
    with pytest.raises(ConfigError, match="expected a list of rules"):
        ExchangeOptions.checked("X", rules=42)
    with pytest.raises(ConfigError, match="does not exist"):
        ExchangeOptions.checked("X", rules="/nonexistent/rules.yaml")


def test_names_from_pairs_or_a_dict_with_clear_errors():
    a, b = torch.zeros(1), torch.zeros(2)
    assert names_by_id([("a", a), ("b", b)], "named_parameters") == {id(a): "a", id(b): "b"}
    assert names_by_id({"a": a}, "named_variables") == {id(a): "a"}
    assert names_by_id(None, "named_parameters") == {}
    with pytest.raises(ValueError, match=r"named_parameters should be \(name, tensor\) pairs"):
        names_by_id([a], "named_parameters")
    with pytest.raises(ValueError, match=r"duplicate names: \['a'\]"):
        names_by_id([("a", a), ("a", b)], "named_parameters", unique=True)
    assert names_by_id([("a", a), ("a", b)], "named_variables") == {id(a): "a", id(b): "a"}
    with pytest.raises(ValueError, match="1 tensor"):
        names_by_id([("a", a)], "named_parameters", required=[a, b])
    # Horovod's default names: <prefix>.noname.<group>.<index in the group>
    assert default_names([[a], [b]], {id(a): "w"}, "allreduce") == \
        {id(a): "w", id(b): "allreduce.noname.1.0"}


class _Planned:
    def __init__(self):
        self.ready = []

    def note_ready(self, i, step):
        self.ready.append((i, step))


class _Reducer:
    def __init__(self, timeline):
        self.timeline = timeline
        self.stats = []

    def add_stats(self, stats: ReduceStats):
        self.stats.append(stats)


def test_recorder_marks_ready_feeds_the_planner_and_times_the_wait(tmp_path):
    planned = _Planned()
    plan = SimpleNamespace(planned=planned, names=["w0", "w1", "w2"])
    timeline = Timeline(None)
    timeline.start(str(tmp_path / "t.json"))
    red = _Reducer(timeline)
    rec = StepRecorder(plan, red)
    rec.ready([2, 0], step=5, row="bucket0")
    assert planned.ready == [(2, 5), (0, 5)]
    with rec.waiting():
        time.sleep(0.02)
    (stats,) = red.stats
    assert stats.steps == 1 and stats.exposed_seconds >= 0.02
    timeline.close()
    text = (tmp_path / "t.json").read_text()
    assert '"ready"' in text and '"w2"' in text and '"w0"' in text
    # without a planned mode (fixed compression) only the mark is made
    StepRecorder(SimpleNamespace(planned=None, names=["w"]), _Reducer(Timeline(None))).ready(
        [0], step=0, row="b")
