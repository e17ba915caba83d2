"""A job you can watch: the streamed timeline, statistics, TensorBoard scalars, the exit summary."""

import json
import os
import textwrap

import pytest

from distutil import run_ranks
from cgx.timeline import Timeline, load

pytestmark = pytest.mark.multiproc

TRAIN = """
    import os, sys, torch
    import cgx.torch as hvd
    from cgx.config import Config
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    # (factor discovery off: the rows checked are the buckets of every step; with it, the
    # layers found in the first step travel in factor rows of their own from the second)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   sufficient_factors=False)
    class Writer:
        def __init__(self):
            self.rows = []
        def add_scalar(self, name, value, step):
            self.rows.append((name, value, step))
    logger = hvd.StatsLogger(Writer())
    crash_at = int(os.environ.get("CRASH_AT", "-1"))
    for step in range(4):
        if step == crash_at and hvd.rank() == 1:
            os._exit(7)  # no cleanup at all: the timeline must still be readable
        opt.zero_grad()
        g = torch.Generator().manual_seed(step + 10 * hvd.rank())
        model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        logger.log(step)
    hvd.allreduce(torch.ones(3), name="metric.loss")
    st = hvd.stats()
    report({"steps": st.steps, "exposed": st.exposed_seconds, "layers": st.layer_error,
            "wire": st.wire_bytes, "rows": sorted({r[0] for r in logger.writer.rows})})
"""


def _rows(events):
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    by_row = {}
    for e in events:
        if e.get("ph") in ("X", "i"):
            by_row.setdefault(names[e["tid"]], []).append(e["name"].split(" ")[0])
    return by_row


def test_timeline_stats_and_summary(tmp_path):
    path = tmp_path / "trace.json"
    res = run_ranks(textwrap.dedent(TRAIN), nprocs=2, launcher="torchrun", timeout=120,
                    env={"CGX_TIMELINE": str(path), "CGX_VERBOSE": "1",
                         "CGX_STATS_EVERY": "2"})
    outs = res.check()
    for r, o in enumerate(outs):
        assert o["steps"] == 4 and o["exposed"] > 0 and o["wire"] > 0
        # The two weight matrices are compressed (4-bit): their error is measured.
        assert set(o["layers"]) == {"0.weight", "2.weight"}
        assert all(0 < e < 0.5 for e in o["layers"].values())
        assert {"cgx/bytes_sent_per_step", "cgx/compression_ratio",
                "cgx/exposed_comm_s_per_step", "cgx/layer_error/0.weight"} <= set(o["rows"])
        events = json.loads((tmp_path / ("trace.json" if r == 0 else
                                         "trace.rank1.json")).read_text())
        rows = _rows(events)
        bucket = next(k for k in rows if k.startswith("opt") and k.endswith("bucket0"))
        phases = set(rows[bucket])
        assert {"ready", "queued", "run", "compress", "wait", "done"} <= phases, phases
        assert rows[bucket].count("done") == 4  # one per step
        assert {"queued", "run", "done"} <= set(rows["metric.loss"])
    assert "cgx summary, rank 0" in res.stderr and "cgx summary, rank 1" in res.stderr
    assert "exposed communication per step" in res.stderr


def test_timeline_survives_a_crash(tmp_path):
    path = tmp_path / "trace.json"
    res = run_ranks(textwrap.dedent(TRAIN), nprocs=2, launcher="torchrun", timeout=120,
                    env={"CGX_TIMELINE": str(path), "CRASH_AT": "2", "CGX_TIMEOUT_S": "10"})
    assert res.returncode != 0
    crashed = tmp_path / "trace.rank1.json"
    text = crashed.read_text()
    assert not text.rstrip().endswith("]")  # cut short...
    rows = _rows(load(str(crashed)))  # ...but readable, with the steps before the crash
    bucket = next(k for k in rows if k.endswith("bucket0"))
    assert rows[bucket].count("done") == 2


def test_timeline_start_stop_unit(tmp_path):
    t = Timeline(None, rank=1)
    assert not t.enabled
    t.add("x", 0.0, 1.0)  # disabled: nothing happens
    t.start(str(tmp_path / "a.json"))
    t.add("compress", t.now(), 0.001, row="b0")
    t.instant("ready w", row="b0")
    t.close()
    events = load(str(tmp_path / "a.rank1.json"))
    assert [e["name"] for e in events if e["ph"] != "M"] == ["compress", "ready w"]
    assert json.loads((tmp_path / "a.rank1.json").read_text())  # closed: plain valid JSON
    assert os.path.exists(tmp_path / "a.rank1.json")


def test_summary_and_scalars_unit():
    from cgx.collectives.reducer import ReduceStats
    from cgx.stats import scalars, summary
    a = ReduceStats(calls=2, wire_bytes=1000, seconds={"compress": 0.5, "_fp32_wire": 8000.0},
                    steps=2, exposed_seconds=0.2, layer_error={"fc": 0.1})
    b = a.copy()
    b.add(ReduceStats(calls=1, wire_bytes=500, seconds={"compress": 0.25, "_fp32_wire": 4000.0},
                      steps=1, exposed_seconds=0.1))
    d = scalars(b, since=a)
    assert d["cgx/bytes_sent"] == 500 and d["cgx/compression_ratio"] == 8.0
    assert d["cgx/bytes_sent_per_step"] == 500 and abs(d["cgx/exposed_comm_s_per_step"] - 0.1) < 1e-9
    text = summary(b, 3)
    assert "rank 3" in text and "fc 0.100" in text and "3 " in text
