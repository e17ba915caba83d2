"""cgx.elastic without processes: the launcher's variables, the state's commit/sync
rules, the run loop's decisions, the sampler, and cgxrun's elastic flags and errors.
The real multi-rank runs (a killed rank, a joining host) are in test_elastic_training.py."""

from __future__ import annotations

import dataclasses
import stat
import types
import sys

import pytest

from cgx.elastic import HostsUpdatedInterrupt, ObjectState, ResetLimitError, run_fn
from cgx.elastic import run as run_mod
from cgx.launch.elastic_env import ElasticEnv
from cgx.elastic.state import member_id
from cgx.errors import CGXError, CollectiveMismatchError, CommunicationError, ConfigError
from cgx.launch import cli
from cgx.launch.elastic import ElasticSpec, check, parse_discovery
from cgx.launch.spec import Host, UsageError


# -- the launcher's variables ---------------------------------------------------------------

def test_elastic_env_round_trip_and_absent():
    spec = ElasticEnv(addr="127.0.0.1", port=4242, run_id="job", min_np=2, max_np=5,
                      reset_limit=3, host="127.0.0.2", timeout_s=30)
    assert ElasticEnv.from_env(spec.as_env()) == spec
    assert ElasticEnv.from_env({}) is None
    first = dataclasses.replace(spec, first_np=3)
    assert ElasticEnv.from_env(first.as_env()) == first


def test_the_first_ranks_first_world_waits_for_all_of_them(monkeypatch):
    """The driver marks the ranks it starts with the job (-np of them); their first
    rendezvous completes only with all of them (a late starter is waited for), later ones
    with --min-np; a rank started later (a new host) waits for --min-np from the first."""
    import datetime

    import torch.distributed as dist

    from cgx.launch.elastic import Driver
    from cgx.launch.elastic_env import FIRST_VAR
    from cgx.launch.membership import Membership

    started = []
    monkeypatch.setattr("cgx.launch.elastic.subprocess.Popen",
                        lambda cmd, env: started.append(env) or types.SimpleNamespace(pid=1))
    driver = Driver(3, ["train.py"], {}, ElasticSpec(min_np=2, max_np=4),
                    [Host("localhost", 4)], print)
    driver._fill(3)
    driver._fill(4)
    assert [e.get(FIRST_VAR) for e in started] == ["3", "3", "3", None]

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    base = ElasticEnv(addr="127.0.0.1", port=server.port, run_id="job", min_np=2, max_np=4)
    first = Membership(dataclasses.replace(base, first_np=3))
    assert first._handler._settings.min_nodes == 3
    later = Membership(base)
    assert later._handler._settings.min_nodes == 2
    first._set_min_nodes(2)  # what join() does once its first world formed
    assert first._handler._settings.min_nodes == 2
    # one settings object: the executor and the state holder read the same number
    assert first._handler._op_executor._settings.min_nodes == 2
    assert first._handler._state_holder._settings.min_nodes == 2


def test_each_started_rank_gets_horovodruns_worker_variables(monkeypatch):
    """As horovodrun's driver sets them (gloo_run.create_slot_env_vars), for the host
    assignment at the rank's start: hosts in their order, slots in order within a host."""
    from cgx.launch.elastic import Driver
    started = []
    monkeypatch.setattr("cgx.launch.elastic.subprocess.Popen",
                        lambda cmd, env: started.append(env) or types.SimpleNamespace(
                            pid=len(started), poll=lambda: None))
    driver = Driver(3, ["train.py"], {}, ElasticSpec(min_np=2, max_np=5),
                    [Host("localhost", 2), Host("127.0.0.1", 2)], print)
    driver._fill(3)
    keys = ("HOROVOD_HOSTNAME", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
            "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")
    rows = [tuple(e[k] for k in keys) for e in started]
    assert rows == [("localhost", "0", "3", "0", "2", "0", "2"),
                    ("localhost", "1", "3", "1", "2", "0", "1"),
                    ("127.0.0.1", "2", "3", "0", "1", "1", "2")]
    assert all(e["HOROVOD_ELASTIC"] == "1" for e in started)
    # a rank lost on localhost: its replacement takes the freed slot (a world of 4, the
    # freed slot on the second host too), then a host that discovery adds (a world of 5)
    driver.ranks = [r for r in driver.ranks if r.proc.pid != 1]
    driver._fill(4)
    assert [tuple(e[k] for k in keys) for e in started[3:]] == [
        ("localhost", "0", "4", "0", "2", "0", "2"), ("127.0.0.1", "3", "4", "1", "2", "1", "2")]
    driver.hosts = (*driver.hosts, Host("127.0.0.9", 1))
    driver._fill(5)
    assert [tuple(e[k] for k in keys) for e in started[5:]] == [
        ("127.0.0.9", "4", "5", "0", "1", "2", "3")]


def test_the_assignment_numbers_slots_as_horovodrun_does():
    from cgx.launch.slots import assign, free_slot
    got = assign([("b", 0), ("a", 1), ("a", 0), ("c", 0)], ["a", "b", "c"])
    assert [(i.hostname, i.rank, i.local_rank, i.cross_rank, i.cross_size)
            for i in sorted(got.values(), key=lambda i: i.rank)] == [
        ("a", 0, 0, 0, 3), ("a", 1, 1, 0, 1), ("b", 2, 0, 1, 3), ("c", 3, 0, 2, 3)]
    assert {i.size for i in got.values()} == {4}
    assert (free_slot([]), free_slot([0, 1]), free_slot([1])) == (0, 2, 0)


@pytest.mark.parametrize("env, needle", [
    ({"CGX_ELASTIC_STORE": "nohostport"}, "HOST:PORT"),
    ({"CGX_ELASTIC_STORE": "h:1", "CGX_ELASTIC_MIN_NP": "0"}, "CGX_ELASTIC_MIN_NP"),
    ({"CGX_ELASTIC_STORE": "h:1", "CGX_ELASTIC_MIN_NP": "3", "CGX_ELASTIC_MAX_NP": "2"},
     "below"),
    ({"CGX_ELASTIC_STORE": "h:1", "CGX_ELASTIC_RESET_LIMIT": "x"}, "RESET_LIMIT"),
])
def test_elastic_env_errors_name_the_variable(env, needle):
    with pytest.raises(ConfigError, match=needle):
        ElasticEnv.from_env(env)


# -- state: commit, sync from the senior rank, what lost ranks owed ---------------------------

class _World:
    """A fake world as one rank sees it: what the others answer to a gather."""

    def __init__(self, rank=0, others=()):
        self.rank, self.others, self.sent = rank, list(others), []

    def bcast(self, obj, root):
        self.sent.append(root)
        return self.root_value if hasattr(self, "root_value") else obj

    def gather(self, obj):
        rows = list(self.others)
        rows.insert(self.rank, obj)
        return rows


def test_sync_sends_from_the_rank_with_most_commits():
    w = _World(rank=0, others=[(7, "b:2"), (7, "c:3")])
    st = ObjectState(w.bcast, lambda: w.rank, w.gather, epoch=0)  # a rank that just joined
    st.sync()
    assert w.sent[0] == 1  # rank 1: seven commits, the first of the two seniors
    w = _World(rank=1, others=[(0, "a:1")])
    st = ObjectState(w.bcast, lambda: w.rank, w.gather, epoch=0)
    st.sync()
    assert w.sent[0] == 0  # a tie (no commits anywhere yet, as at the start): the lowest rank


def test_sync_counts_what_lost_ranks_owed_at_the_last_commit():
    w = _World(rank=0, others=[(3, "b:2")])
    st = ObjectState(w.bcast, lambda: 0, w.gather, step=1)
    st.owed_at_commit = {member_id(): 0.5, "b:2": 1.0, "gone:9": 2.5}
    st.sync()
    assert (st.lost_ranks, st.dropped_owed) == (1, 2.5)
    assert st.owed_at_commit == {}  # counted once


def test_object_state_commit_and_restore_without_an_elastic_job(monkeypatch):
    monkeypatch.delenv("CGX_ELASTIC_STORE", raising=False)
    w = _World()
    st = ObjectState(w.bcast, lambda: 0, w.gather, epoch=0, batch=0)
    st.epoch, st.batch = 2, 7
    st.commit()  # outside an elastic job: nothing to ask, no interrupt
    st.batch = 9
    st.restore()
    assert (st.epoch, st.batch, st.commits) == (2, 7, 1)


# -- the run loop ------------------------------------------------------------------------------

class _Member:
    def __init__(self, limit=None):
        self.spec = ElasticEnv(addr="h", port=1, run_id="r", min_np=1, max_np=4,
                               reset_limit=limit)
        self.round, self.closed = 0, False

    def close(self):
        self.closed = True


class _Probe(ObjectState):
    def __init__(self):
        w = _World()
        super().__init__(w.bcast, lambda: 0, w.gather, x=0)
        self.calls = []

    def restore(self):
        self.calls.append("restore")
        super().restore()

    def on_reset(self):
        self.calls.append("on_reset")


def _loop(monkeypatch, outcomes, limit=None, elastic=True):
    member = _Member(limit)
    monkeypatch.setattr(run_mod, "membership", lambda: member if elastic else None)
    resets = []
    it = iter(outcomes)

    def train(state):
        out = next(it)
        if isinstance(out, BaseException):
            raise out
        return out

    def reset():  # each new world is a new round of the rendezvous
        resets.append(1)
        member.round += 1

    return run_fn(train, reset, lambda: 0, lambda: 1), resets, member


def test_a_failed_collective_restores_resets_and_runs_again(monkeypatch, capsys):
    fn, resets, member = _loop(monkeypatch, [CommunicationError("peer gone"),
                                             HostsUpdatedInterrupt(), "done"])
    state = _Probe()
    assert fn(state) == "done"
    assert state.calls == ["restore", "on_reset", "on_reset"] and len(resets) == 2
    assert "a collective failed (peer gone)" in capsys.readouterr().err
    assert member.closed  # ranks still waiting to join are told the job is over


@pytest.mark.parametrize("error", [CollectiveMismatchError("ranks disagree"),
                                   CGXError("zero_grad() while gradients are in flight")])
def test_program_errors_are_raised_without_a_reset(monkeypatch, error):
    fn, resets, _ = _loop(monkeypatch, [error])
    with pytest.raises(type(error)):
        fn(_Probe())
    assert resets == []


def test_outside_an_elastic_job_a_failure_is_raised(monkeypatch):
    fn, resets, _ = _loop(monkeypatch, [CommunicationError("peer gone")], elastic=False)
    with pytest.raises(CommunicationError, match="peer gone"):
        fn(_Probe())
    assert resets == []


def test_the_reset_limit_counts_the_rendezvous_rounds(monkeypatch):
    fn, resets, member = _loop(monkeypatch, [CommunicationError("a"), CommunicationError("b"),
                                             "never"], limit=1)
    with pytest.raises(ResetLimitError, match="--reset-limit 1"):
        fn(_Probe())
    assert len(resets) == 2 and member.round == 2
    # a rank that joins a world past the limit stops at once
    fn, resets, member2 = _loop(monkeypatch, ["never"], limit=1)
    member2.round = 5
    with pytest.raises(ResetLimitError):
        fn(_Probe())


# -- the sampler -------------------------------------------------------------------------------

def test_elastic_sampler_never_gives_out_processed_samples_again():
    from cgx.torch.elastic import ElasticSampler
    s = ElasticSampler(list(range(10)), shuffle=True, seed=3)
    first = list(iter(s))
    assert sorted(first) == list(range(10)) and len(s) == 10
    s.record_batch(0, 4)
    done = set(first[:4])
    s.load_state_dict(s.state_dict())  # as after a sync: reshards what is left
    rest = list(iter(s))
    assert set(rest) == set(range(10)) - done and len(s) == 6
    s.num_replicas, s.rank = 4, 3  # a world of 4: every rank gets as many samples
    s.total_size = 8
    shard = list(iter(s))
    assert len(shard) == 2 and set(shard) <= set(range(10)) - done
    s.set_epoch(1)
    assert len(list(iter(s))) == 10 and s.processed_indices == set()


# -- cgxrun's elastic flags --------------------------------------------------------------------

def test_elastic_flags_parse_into_a_spec():
    spec = cli.parse_args(["-np", "3", "--min-np", "2", "--max-np", "5", "--reset-limit", "4",
                           "--blacklist-cooldown-range", "1", "9", "python", "t.py"])
    assert spec.elastic == ElasticSpec(min_np=2, max_np=5, reset_limit=4, cooldown=(1.0, 9.0))
    assert cli.parse_args(["-np", "2", "python", "t.py"]).elastic is None
    assert cli.parse_args(["-np", "2", "--min-num-proc", "1", "p"]).elastic.max_np == 2


@pytest.mark.parametrize("argv, needle", [
    (["-np", "2", "--min-np", "3"], "--min-np 3 is above -np 2"),
    (["-np", "3", "--max-np", "2"], "--max-np 2 is below -np 3"),
    (["-np", "2", "--min-np", "1", "--mpi"], "drop --mpi"),
    (["-np", "2", "--min-np", "1", "--reset-limit", "-1"], "--reset-limit -1"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "5", "1"], "0 <= MIN <= MAX"),
    (["-np", "2", "--min-np", "1", "-H", "localhost:2", "--host-discovery-script",
      sys.executable], "not both"),
])
def test_bad_elastic_flags_are_usage_errors(argv, needle, capsys):
    assert cli.main([*argv, sys.executable, "-c", "pass"]) == 2
    assert needle in capsys.readouterr().err


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "hosts.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


@pytest.mark.parametrize("body, needle", [
    ("echo broken >&2; exit 3", "exited with 3: broken"),
    ("echo 'localhost:two'", "must be HOST or HOST:SLOTS"),
    ("echo 'far-away-host-that-does-not-resolve.invalid:2'", "this machine only"),
    ("echo localhost:1", "fewer than --min-np 2"),
])
def test_a_discovery_script_that_fails_or_prints_junk_stops_the_job_at_once(tmp_path, capsys,
                                                                            body, needle):
    script = _script(tmp_path, body)
    code = cli.main(["-np", "2", "--min-np", "2", "--host-discovery-script", script,
                     sys.executable, "-c", "pass"])
    assert code == 2
    assert needle in capsys.readouterr().err


def test_discovery_lines_and_local_hosts():
    assert parse_discovery("127.0.0.1:2\n\n127.0.0.9\nlocalhost:3\n", "s") == (
        Host("127.0.0.1", 2), Host("127.0.0.9", 1), Host("localhost", 3))
    with pytest.raises(UsageError, match="HOST or HOST:SLOTS"):
        parse_discovery("a b:1", "s")
    with pytest.raises(UsageError, match="--min-np 0"):
        check(ElasticSpec(min_np=0, max_np=2), 2)


# -- what the torch state keeps -----------------------------------------------------------------

def test_a_second_failure_before_the_next_commit_rolls_back_to_the_same_commit():
    import torch

    from cgx.torch.elastic import OptimizerStateHandler
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad()
        (p * p).sum().backward()
        opt.step()

    step()
    handler = OptimizerStateHandler(opt)  # the commit
    committed = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    for _ in range(2):  # fail, restore, train on, fail again
        step()
        handler.restore()
        assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], committed)


def test_a_new_world_is_joined_with_the_first_inits_settings(monkeypatch):
    import cgx
    from cgx import session
    monkeypatch.delenv("CGX_ELASTIC_STORE", raising=False)
    cfg = cgx.Config.from_env().replace(fusion_buffer_mb=3.0)
    session.shutdown()
    session.init(config=cfg)
    try:
        session.reinit()
        assert cgx.runtime.config() == cfg
    finally:
        session.shutdown()


def test_the_recovery_benchmark_reads_its_logs_into_figures():
    from benchmarks import elastic_recovery as bench
    rows = [{"t": 10.0 + i, "loss": 10.0 if i < 40 else 0.01} for i in range(100)]
    assert bench._to_target(rows, 10.0, 0.05, window=30) == 69.0  # 30 low losses in a row
    assert bench._to_target(rows, 10.0, 0.001) is None
    args = type("A", (), {"batch": 8, "steps": 400, "every": 100, "target": 0.05})()
    md = bench.table([{"run": "elastic", "exit": 0, "wall_s": 10.0, "to_target_s": 8.0,
                       "kills_at_s": []},
                      {"run": "elastic-kill", "exit": 0, "wall_s": 16.0, "to_target_s": 14.0,
                       "kills_at_s": [1.0, 2.0, 3.0]}], args)
    assert "| elastic-kill | 0 | 16.0 | 14.0 | 3 | 2.0 | 2.0 |" in md


def test_a_world_that_breaks_while_it_settles_is_left_for_the_next(monkeypatch, capsys):
    """A rank lost after the groups connected but before the layout was agreed: the
    others close that world's transport and join the next one (not exit)."""
    from cgx import runtime
    from cgx.comm import factory
    worlds = iter([types.SimpleNamespace(size=3), types.SimpleNamespace(size=2)])
    closed, settled = [], []
    monkeypatch.setattr(runtime, "_discover", lambda: (next(worlds), object()))
    monkeypatch.setattr(runtime, "_connect", lambda world, *a: (
        "torch", factory.Connection(transport=f"transport of {world.size}")))
    monkeypatch.setattr(factory, "close", lambda tr, owns: closed.append(tr))

    def settle(world, conn, config):
        settled.append(world.size)
        if world.size == 3:
            raise RuntimeError("Connection closed by peer")
        return world, "local", "cross"

    monkeypatch.setattr(runtime, "_settle", settle)
    world, kind, conn, local, cross = runtime._join(None, None, None, None)
    assert (world.size, conn.transport, settled, closed) == \
        (2, "transport of 2", [3, 2], ["transport of 3"])
    assert "the world of 3 did not form (Connection closed by peer); joining the next one" \
        in capsys.readouterr().err


def test_a_settings_mismatch_is_raised_not_retried(monkeypatch):
    from cgx import runtime
    from cgx.comm import factory
    monkeypatch.setattr(runtime, "_discover", lambda: (types.SimpleNamespace(size=2), object()))
    monkeypatch.setattr(runtime, "_connect", lambda *a: ("torch", factory.Connection("t")))
    monkeypatch.setattr(factory, "close", lambda tr, owns: None)
    calls = []

    def settle(*a):
        calls.append(1)
        raise CollectiveMismatchError("ranks differ")

    monkeypatch.setattr(runtime, "_settle", settle)
    with pytest.raises(CollectiveMismatchError):
        runtime._join(None, None, None, None)
    assert calls == [1]
