"""cgx.init() and the global runtime: in this process (1 rank) and on real ranks.

Multi-process tests start 2 ranks (4 for the hierarchical one) under torchrun,
mpirun and an imitation of ``horovodrun --gloo``; each rank calls ``cgx.init()``,
reports its world view and reduces a small tensor through
``cgx.runtime.transport()``. cgxrun launches are in test_cgxrun.py.
"""

from __future__ import annotations

import datetime
import subprocess
import sys

import pytest
import torch

import cgx
import cgx.launch.rendezvous as rdv
import cgx.runtime as rt
from cgx.comm.base import SingleProcessTransport, Transport
from cgx.config import Config
from cgx.errors import CGXError, ConfigError, MissingDependencyError, NotInitializedError
from cgx.comm import factory
from cgx.launch.layout import layout_from_hosts, layout_row, node_layout
from cgx.launch.world import Launcher, WorldInfo
from distutil import (WORLD_SNIPPET, KVServer, check_world, have_horovodrun, have_mpirun,
                       horovod_gloo_env, run_ranks)

LAUNCH_TIMEOUT_S = 180  # 2 ranks importing torch on 2 shared cores; a hang fails the test

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                  "PMI_RANK", "SLURM_PROCID", "HOROVOD_RANK", "CGX_TRANSPORT", "CGX_BACKEND")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    """A process launched by nothing, with no cgx state before or after."""
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    rt.shutdown()
    yield
    rt.shutdown()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


# -- import cost ------------------------------------------------------------------------

def test_import_cgx_is_cheap():
    code = ("import sys, cgx, cgx.launch.cli, cgx.launch.world, cgx.launch.addresses, "
            "cgx.launch.layout, cgx.runtime; "
            "assert not cgx.is_initialized(); "
            "heavy = [m for m in ('torch', 'tensorflow', 'triton', 'mpi4py') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_lazy_exports():
    assert cgx.init is rt.init and cgx.rank is rt.rank and cgx.cross_size is rt.cross_size
    assert "init" in dir(cgx) and "local_rank" in cgx.__all__
    with pytest.raises(AttributeError, match="module 'cgx' has no attribute 'nope'"):
        cgx.nope


# -- one process ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["size", "rank", "local_rank", "local_size", "cross_rank",
                                  "cross_size", "world", "config", "transport",
                                  "local_transport", "cross_transport"])
def test_accessors_need_init(name):
    with pytest.raises(NotInitializedError, match=rf"cgx\.{name}\(\) needs cgx\.init\(\)"):
        getattr(rt, name)()


def test_single_process_world():
    cgx.init()
    assert cgx.is_initialized()
    assert (cgx.size(), cgx.rank(), cgx.local_rank(), cgx.local_size(), cgx.cross_rank(),
            cgx.cross_size()) == (1, 0, 0, 1, 0, 1)
    assert rt.world().launcher is Launcher.SINGLE
    assert isinstance(rt.transport(), SingleProcessTransport)
    assert rt.local_transport() is rt.transport()
    assert rt.cross_transport().size == 1
    assert isinstance(rt.config(), Config)
    x = torch.ones(3)
    rt.transport().allreduce(x)
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_init_is_idempotent_and_shutdown_repeatable():
    cfg = Config(bits=8)
    cgx.init(cfg)
    tr = rt.transport()
    cgx.init()  # no arguments: no-op
    cgx.init(cfg, transport="auto", device="cpu")  # the same arguments: no-op
    assert rt.transport() is tr and rt.config() is cfg
    cgx.shutdown()
    cgx.shutdown()
    assert not cgx.is_initialized()
    cgx.init()
    assert rt.config() == Config.from_env()


@pytest.mark.parametrize("kwargs,match", [
    (dict(config=Config(bits=2)), "a different config"),
    (dict(transport="mpi"), "transport='mpi'"),
    (dict(transport=SingleProcessTransport()), "a different transport object"),
    (dict(device="meta"), "device='meta'"),
])
def test_init_again_with_other_arguments(kwargs, match):
    cgx.init()
    with pytest.raises(ValueError, match=rf"already initialized .*{match}.*cgx\.shutdown\(\)"):
        cgx.init(**kwargs)


def test_init_reads_the_environment(monkeypatch):
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "3")
    cgx.init()
    assert rt.config().bits == 3


def test_runtime_config_variables():
    from cgx.config import TorchBackend
    cfg = Config.from_env({"CGX_BACKEND": "NCCL", "CGX_START_TIMEOUT_S": "30"})
    assert (cfg.backend, cfg.start_timeout_s) == (TorchBackend.NCCL, 30.0)
    assert Config.from_env({"HOROVOD_START_TIMEOUT": "45"}).start_timeout_s == 45.0
    assert Config.from_env({"CGX_START_TIMEOUT_S": "5", "HOROVOD_START_TIMEOUT": "45"}
                           ).start_timeout_s == 5.0
    assert Config.from_env({}).backend is TorchBackend.AUTO


@pytest.mark.parametrize("env,match", [
    ({"CGX_BACKEND": "mpi"}, r"CGX_BACKEND='mpi' is not valid; expected one of: auto, gloo, nccl"),
    ({"CGX_START_TIMEOUT_S": "0"}, r"CGX_START_TIMEOUT_S=0.0 is out of range"),
    ({"HOROVOD_START_TIMEOUT": "soon"}, r"HOROVOD_START_TIMEOUT='soon' is not a number"),
])
def test_runtime_config_errors(env, match):
    with pytest.raises(ConfigError, match=match):
        Config.from_env(env)
    with pytest.raises(ConfigError, match=r"start_timeout_s=0 must be in \(0, 604800\]"):
        Config(start_timeout_s=0)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(transport="pigeon"), ValueError,
     "transport='pigeon' is not valid; expected one of: auto, torch, mpi, horovod"),
    (dict(transport=3), TypeError, "transport must be a string, a cgx.TransportKind"),
    (dict(config={"bits": 4}), TypeError, "config must be a cgx.Config, got dict"),
])
def test_init_argument_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cgx.init(**kwargs)
    assert not cgx.is_initialized()


def test_init_checks_the_layer_rules_file(tmp_path, monkeypatch):
    """A rules file that is missing or not valid fails at init, before any exchange
    (README: invalid values fail at start), from the environment or the config."""
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=r"missing\.yaml' does not exist \(CGX_COMPRESSION_CONFIG"):
        cgx.init(config=Config(layer_config=str(missing)))
    assert not cgx.is_initialized()
    bad = tmp_path / "bad.yaml"
    bad.write_text("layers:\n  - pattern: '*'\n    bitz: 4\n")
    monkeypatch.setenv("CGX_COMPRESSION_CONFIG", str(bad))
    with pytest.raises(ConfigError, match="bad.yaml: rule 0"):
        cgx.init()
    assert not cgx.is_initialized()
    bad.write_text("layers:\n  - pattern: '*'\n    bits: 8\n")
    cgx.init()
    assert cgx.is_initialized()


def test_init_with_a_ready_transport():
    tr = SingleProcessTransport()
    cgx.init(transport=tr)
    assert rt.transport() is tr


def test_explicit_torch_creates_and_destroys_a_one_rank_group():
    import torch.distributed as dist
    cgx.init(transport="torch")
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert rt.transport().name == "torch-gloo"
    x = torch.arange(4.0)
    rt.transport().allreduce(x)
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]
    cgx.shutdown()
    assert not dist.is_initialized()


def test_reuses_the_users_process_group():
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    cgx.init()
    assert rt.transport().name == "torch-gloo"
    cgx.shutdown()
    assert dist.is_initialized()  # not cgx's to destroy


def test_backend_and_device_errors(monkeypatch):
    monkeypatch.setenv("CGX_BACKEND", "nccl")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CGX_BACKEND=nccl needs CUDA"):
            cgx.init(transport="torch")
    with pytest.raises(ConfigError, match="CGX_BACKEND=nccl needs a CUDA device, but cgx.init"
                                          r"\(\) got device='cpu'"):
        cgx.init(transport="torch", device="cpu")
    assert not cgx.is_initialized()


def test_horovod_transport_without_horovod(monkeypatch):
    from cgx.comm import horovod

    def missing():
        raise horovod.HorovodMissingError("it is not installed")
    monkeypatch.setattr(horovod, "import_horovod", missing)
    with pytest.raises(MissingDependencyError, match="horovod"):
        cgx.init(transport="horovod")
    with pytest.raises(ConfigError, match="Horovod transport moves CPU tensors"):
        cgx.init(transport="horovod", device="cuda")
    assert not cgx.is_initialized()


# -- node layout ------------------------------------------------------------------------------

def test_layout_from_hosts():
    assert layout_from_hosts(["a", "a", "b", "b"]) == [(0, 0, 2), (0, 1, 2), (1, 0, 2),
                                                          (1, 1, 2)]
    # Round-robin placement (mpirun --map-by node) and uneven nodes.
    assert layout_from_hosts(["a", "b", "a"]) == [(0, 0, 2), (1, 0, 1), (0, 1, 2)]


class _Rows(Transport):
    """A fake transport whose allgather_object returns preset rows."""

    name = "fake"

    def __init__(self, rank, rows):
        self.rank, self.size, self.device, self.rows = rank, len(rows), torch.device("cpu"), rows
        self.splits = []

    def allgather_object(self, obj):
        assert obj == self.rows[self.rank]
        return self.rows

    def split(self, groups):
        self.splits.append([list(g) for g in groups])
        return _Rows(0, [self.rows[0]] * len(groups[0]))

    alltoall = allgather = allreduce = broadcast = sendrecv = barrier = None


def _world(rank, size, lrank, lsize, crank, csize, host, derived, launcher=Launcher.OPEN_MPI):
    return WorldInfo(rank, size, lrank, lsize, crank, csize, host, launcher,
                     cross_derived=derived)


def test_layout_measures_derived_nodes():
    # mpirun --map-by node: ranks 0, 2 on host a; 1, 3 on host b; rank // local_size is wrong.
    rows = [("a", 0, 2, 0), ("b", 0, 2, 0), ("a", 1, 2, 1), ("b", 1, 2, 1)]
    world = _world(1, 4, 0, 2, 0, 2, "b", True)
    assert layout_row(world) == rows[1]  # what this rank tells the others
    w, local, cross = node_layout(world, rows)
    assert (w.cross_rank, w.cross_size, w.cross_derived) == (1, 2, False)
    assert "node layout measured from host names" in w.notes
    assert local == [[0, 2], [1, 3]] and cross == [[0, 1], [2, 3]]


def test_layout_keeps_launcher_values():
    # Two "nodes" on one host (torchrun/horovodrun said so): the launcher wins over host names.
    rows = [("h", 0, 2, 0), ("h", 1, 2, 0), ("h", 0, 2, 1), ("h", 1, 2, 1)]
    w, local, cross = node_layout(_world(2, 4, 0, 2, 1, 2, "h", False, Launcher.TORCHRUN), rows)
    assert (w.cross_rank, w.cross_size) == (1, 2)
    assert local == [[0, 1], [2, 3]] and cross == [[0, 2], [1, 3]]
    # Derived values that disagree with the host names are kept, with a note.
    w, _, _ = node_layout(_world(2, 4, 0, 2, 1, 2, "h", True), rows)
    assert any("host names disagree" in n for n in w.notes)


def test_layout_rejects_inconsistent_launchers():
    rows = [("h", 0, 2, 0), ("h", 0, 2, 0)]  # two local rank 0 on one node
    with pytest.raises(ConfigError, match=r"rank 1 says it is local rank 0 of 2 on node 0, but "
                                          r"the ranks on node 0 are \[0, 1\]"):
        node_layout(_world(0, 2, 0, 2, 0, 1, "h", False, Launcher.TORCHRUN), rows)


def test_sub_transports_split_in_order():
    tr = _Rows(0, [("a", 0, 2, 0)] * 4)
    local, cross = factory.sub_transports(tr, [[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert tr.splits == [[[0, 1], [2, 3]], [[0, 2], [1, 3]]]  # local first, then cross
    local, cross = factory.sub_transports(tr, [[0, 1, 2, 3]], [[0], [1], [2], [3]])
    assert local is tr and cross.size == 1
    local, cross = factory.sub_transports(tr, [[0], [1], [2], [3]], [[0, 1, 2, 3]])
    assert local.size == 1 and cross is tr


# -- rank 0's address over horovodrun's HTTP key-value store --------------------------------

def _hvd_world(rank, port):
    return WorldInfo(rank, 2, 0, 1, rank, 2, f"n{rank}", Launcher.HOROVOD_GLOO,
                     rendezvous_addr="127.0.0.1", rendezvous_port=port)


def test_http_exchange():
    cfg = Config(start_timeout_s=0.5)
    with KVServer() as kv:
        assert rdv._HTTPExchange(_hvd_world(0, kv.port), cfg).run(lambda: ("10.1.1.1", 77)) == (
            "10.1.1.1", 77)
        assert rdv._HTTPExchange(_hvd_world(1, kv.port), cfg).run(None) == ("10.1.1.1", 77)
        assert list(kv.store) == [(rdv.KV_SCOPE, "master.0")]


def test_http_exchange_reports_rank0_failure_and_timeout():
    cfg = Config(start_timeout_s=0.5)
    with KVServer() as kv:
        def broken():
            raise OSError("no network")
        with pytest.raises(OSError, match="no network"):
            rdv._HTTPExchange(_hvd_world(0, kv.port), cfg).run(broken)
        with pytest.raises(CGXError, match="rank 0 failed to set up the job: OSError: no network"):
            rdv._HTTPExchange(_hvd_world(1, kv.port), cfg).run(None)
        kv.store.clear()
        with pytest.raises(CGXError, match=r"rank 0 did not publish its address at http://"
                                           r"127\.0\.0\.1:\d+/cgx/master\.\d+ within 0.5 s"):
            rdv._HTTPExchange(_hvd_world(1, kv.port), cfg).run(None)


def test_unknown_master_address():
    w = WorldInfo(1, 2, 1, 2, 0, 1, "h", Launcher.TORCHRUN)
    with pytest.raises(ConfigError, match="torchrun launched 2 ranks without MASTER_ADDR"):
        rdv.make_store(w, Config())


# -- real ranks -----------------------------------------------------------------------------

@pytest.mark.multiproc
def test_torchrun_two_ranks():
    outs = run_ranks(WORLD_SNIPPET, launcher="torchrun", timeout=LAUNCH_TIMEOUT_S).check()
    check_world(outs, "torchrun")
    assert all(o["world"]["master_addr"] for o in outs)


@pytest.mark.multiproc
@pytest.mark.skipif(not have_mpirun(), reason="mpirun is not installed")
@pytest.mark.parametrize("transport,name", [("auto", "torch-gloo"), ("mpi", "mpi")])
def test_mpirun_two_ranks(transport, name):
    """Under mpirun: Gloo with rank 0's address sent over MPI, or the MPI transport."""
    res = run_ranks(WORLD_SNIPPET, launcher="mpirun", timeout=LAUNCH_TIMEOUT_S,
                    env={"CGX_TRANSPORT": transport})
    check_world(res.check(), "open_mpi", name=name)


@pytest.mark.multiproc
@pytest.mark.skipif(not have_mpirun(), reason="mpirun is not installed")
def test_mpirun_exception_aborts_the_job():
    """A rank's uncaught exception stops mpirun although the other rank waits in a collective."""
    res = run_ranks("""
        import torch, cgx
        cgx.init()
        if cgx.rank() == 1:
            raise RuntimeError("rank 1 fails")
        cgx.runtime.transport().allreduce(torch.ones(1))  # never completes
        report("unreachable")
    """, launcher="mpirun", timeout=LAUNCH_TIMEOUT_S)
    assert not res.timed_out, res.tail()
    assert res.returncode != 0 and res.outputs == [None, None]
    assert "rank 1 fails" in res.stderr


@pytest.mark.multiproc
def test_horovod_gloo_rendezvous_two_nodes():
    """horovodrun --gloo imitated: 2 "nodes" of 1 rank; rank 0 publishes its address over HTTP.

    As the ranks claim different hosts, rank 0 advertises a non-loopback address
    (the route to the outside), so the store is reached over a real interface.
    """
    with KVServer() as kv:
        res = run_ranks(WORLD_SNIPPET, launcher="env", rank_env=horovod_gloo_env(kv.port, 1, 2),
                        env={"CGX_TRANSPORT": "torch"}, timeout=LAUNCH_TIMEOUT_S)
        outs = res.check()
        record = kv.store[(rdv.KV_SCOPE, "master.0")].decode()
    check_world(outs, "horovod_gloo", local_size=1)
    assert [o["world"]["hostname"] for o in outs] == ["node0", "node1"]
    assert '"addr"' in record and "127.0.0.1" not in record


@pytest.mark.multiproc
@pytest.mark.horovod
@pytest.mark.skipif(not have_horovodrun(), reason="horovodrun is not installed")
@pytest.mark.parametrize("mode,transport,name", [("--gloo", "auto", "horovod"),
                                                 ("--gloo", "torch", "torch-gloo")])
def test_real_horovodrun(mode, transport, name):
    """Under horovodrun: auto picks Horovod in Gloo mode; torch uses horovodrun's HTTP store."""
    res = run_ranks(WORLD_SNIPPET, launcher="horovodrun", launcher_args=[mode],
                    env={"CGX_TRANSPORT": transport}, timeout=LAUNCH_TIMEOUT_S)
    check_world(res.check(), "horovod_gloo" if mode == "--gloo" else "open_mpi", name=name)


@pytest.mark.multiproc
def test_hierarchical_split_four_ranks():
    """2 nodes x 2 ranks (horovodrun --gloo imitated): local and cross are real splits."""
    with KVServer() as kv:
        outs = run_ranks(WORLD_SNIPPET, nprocs=4, launcher="env",
                         rank_env=horovod_gloo_env(kv.port, 2, 4),
                         env={"CGX_TRANSPORT": "torch"}, timeout=LAUNCH_TIMEOUT_S).check()
    check_world(outs, "horovod_gloo", size=4, local_size=2)


class _ClosingTransport(SingleProcessTransport):
    name = "torch-gloo"

    def __init__(self):
        super().__init__()
        self.closed = False

    def close(self):
        self.closed = True


@pytest.mark.parametrize("failing", [False, True])
def test_exit_under_mpi_closes_unless_failing(monkeypatch, failing):
    """A normal exit joins the engine's threads (else a Gloo thread releasing a tensor
    during interpreter finalization aborts the process); a failing exit leaves the
    sockets to MPI_Abort, so the failing rank's exit code is the job's."""
    import cgx.launch.rendezvous as rdv
    from cgx.config import TransportKind

    tr = _ClosingTransport()
    world = WorldInfo(0, 2, 0, 2, 0, 1, "h", Launcher.OPEN_MPI)
    monkeypatch.setattr(rt, "_state", rt._State(world, Config(), TransportKind.TORCH, tr, tr, tr,
                                                False))
    monkeypatch.setattr(rdv, "_exit_failing", failing)
    rt._at_exit()
    assert not rt.is_initialized()
    assert tr.closed is (not failing)


def test_torch_transport_uses_the_older_collective_names_on_torch_before_2_13():
    """torch <= 2.12 has all_gather_into_tensor / reduce_scatter_tensor only (the GPU image's
    torch 2.11 among them): the transport and cgx.torch.fsdp fall back to them."""
    import types

    import torch.distributed as dist

    from cgx.comm.torch_dist import all_gather_single, one_tensor_collectives
    older = types.SimpleNamespace(all_gather_into_tensor=object(), reduce_scatter_tensor=object())
    assert one_tensor_collectives(older) == (older.all_gather_into_tensor,
                                             older.reduce_scatter_tensor)
    assert all_gather_single is dist.all_gather_single  # torch 2.13's own, not the deprecated
