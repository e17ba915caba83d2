"""World discovery from each launcher's environment (cgx.launch.world) and the address probing
(cgx.launch.addresses), no processes spawned."""

from __future__ import annotations

import socket

import pytest

from cgx.errors import CGXError, ConfigError
from cgx.launch.addresses import (
    advertised_address,
    interface_address,
    is_local_host,
    route_source_address,
)
from cgx.launch.world import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    Launcher,
    discover,
    first_slurm_host,
    parse_slurm_tasks_per_node,
)

HOROVOD = {
    "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
    "HOROVOD_HOSTNAME": "node-b", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
    "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321",
}
TORCHRUN = {
    "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "29500",
}
OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
SLURM = {
    "SLURM_PROCID": "4", "SLURM_NTASKS": "6", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
    "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_JOB_NODELIST": "gpu[07-09]",
    "SLURM_JOB_ID": "123456", "SLURMD_NODENAME": "gpu09",
}


# (env, launcher, rank, size, local_rank, local_size, cross_rank, cross_size, cross_derived)
CASES = {
    "horovod_gloo": (HOROVOD, Launcher.HOROVOD_GLOO, 3, 4, 1, 2, 1, 2, False),
    "torchrun": (TORCHRUN, Launcher.TORCHRUN, 2, 3, 1, 2, 1, 2, False),
    "open_mpi": (OPEN_MPI, Launcher.OPEN_MPI, 5, 8, 1, 4, 1, 2, True),
    "mpich": (MPICH, Launcher.MPICH, 2, 4, 0, 2, 1, 2, True),
    "slurm": (SLURM, Launcher.SLURM, 4, 6, 0, 2, 2, 3, False),
    "single": ({}, Launcher.SINGLE, 0, 1, 0, 1, 0, 1, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_launcher(name):
    env, launcher, rank, size, lrank, lsize, crank, csize, derived = CASES[name]
    w = discover(env)
    assert w.launcher is launcher
    assert (w.rank, w.size, w.local_rank, w.local_size) == (rank, size, lrank, lsize)
    assert (w.cross_rank, w.cross_size) == (crank, csize)
    assert w.cross_derived is derived
    if derived:
        assert any("rank // local_size" in n for n in w.notes)


def test_launcher_specific_fields():
    w = discover(HOROVOD)
    assert (w.hostname, w.rendezvous_addr, w.rendezvous_port) == ("node-b", "10.0.0.1", 4321)
    assert (w.master_addr, w.master_port) == (None, None)
    w = discover(TORCHRUN)
    assert (w.master_addr, w.master_port) == ("10.0.0.2", 29500)
    assert w.hostname == socket.gethostname()
    w = discover(SLURM)
    assert w.hostname == "gpu09"
    assert w.master_addr == "gpu07"  # first node of the list
    assert w.master_port == SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN
    assert any("SLURM_JOB_ID" in n for n in w.notes)
    assert discover({**SLURM, "MASTER_PORT": "4000"}).master_port == 4000
    assert discover({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "4000"}).master_addr == "head"


def test_as_dict_is_json_ready():
    import json
    d = discover(OPEN_MPI).as_dict()
    assert d["launcher"] == "open_mpi" and isinstance(d["notes"], list)
    json.dumps(d)


@pytest.mark.parametrize("first,second", [
    ("horovod_gloo", "torchrun"), ("horovod_gloo", "open_mpi"), ("torchrun", "open_mpi"),
    ("torchrun", "slurm"), ("open_mpi", "mpich"), ("open_mpi", "slurm"), ("mpich", "slurm"),
])
def test_precedence(first, second):
    """First match wins: horovodrun, torchrun, Open MPI, MPICH, Slurm."""
    env = {**CASES[second][0], **CASES[first][0]}
    assert discover(env).launcher is CASES[first][1]


def test_user_master_address_is_used_for_any_launcher():
    w = discover({**OPEN_MPI, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})
    assert (w.master_addr, w.master_port) == ("head", 1234)
    w = discover({**OPEN_MPI, "MASTER_ADDR": "head"})  # half a pair is ignored, with a note
    assert w.master_addr is None and any("MASTER_PORT" in n for n in w.notes)


def test_derived_cross_rank_for_uneven_last_node():
    w = discover({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "5",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"})
    assert (w.cross_rank, w.cross_size, w.cross_derived) == (4, 5, True)
    w = discover({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                  "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (w.cross_rank, w.cross_size, w.cross_derived) == (0, 1, False)  # one node: no guess


def test_missing_local_info_means_one_node():
    w = discover({"RANK": "1", "WORLD_SIZE": "2"})
    assert (w.local_rank, w.local_size, w.cross_rank, w.cross_size) == (1, 2, 0, 1)
    assert any("one node" in n for n in w.notes)


def test_slurm_layout_variants():
    base = {"SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
            "SLURM_NNODES": "2"}
    w = discover({**base, "SLURM_TASKS_PER_NODE": "2,1"})  # uneven nodes
    assert (w.local_size, w.cross_rank, w.cross_size) == (1, 1, 2)
    # The step's own variables win over the job's.
    w = discover({**base, "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_TASKS_PER_NODE": "2,1",
                  "SLURM_STEP_NUM_TASKS": "3"})
    assert (w.size, w.local_size) == (3, 1)
    w = discover({**base, "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)"})
    assert w.local_size == 2 and w.master_addr is None  # no node list: no master guess


def test_slurm_parsers():
    assert parse_slurm_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_slurm_tasks_per_node("4") == [4]
    assert first_slurm_host("gpu[003-005,9],cpu1") == "gpu003"
    assert first_slurm_host("node1,node2") == "node1"
    assert first_slurm_host("node[1,3-4]") == "node1"
    with pytest.raises(ConfigError, match=r"tasks per node '2\(y3\)' is not in Slurm's format"):
        parse_slurm_tasks_per_node("2(y3)")
    with pytest.raises(ConfigError, match="node list '' is not in Slurm's format"):
        first_slurm_host("")


# -- validation: every error names the variable and its value --------------------------------

@pytest.mark.parametrize("env,match", [
    ({"RANK": "one", "WORLD_SIZE": "2"}, r"RANK='one' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2.5"}, r"WORLD_SIZE='2.5' is not an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK=2 is out of range for WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, r"RANK=-1 is out of range for WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, r"WORLD_SIZE=0 is not a valid size"),
    ({"RANK": "0"}, r"WORLD_SIZE is not set although RANK=0 is"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     r"LOCAL_WORLD_SIZE is not set although LOCAL_RANK is"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
     r"LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "3"},
     r"LOCAL_WORLD_SIZE=3 is larger than WORLD_SIZE=2"),
    ({**TORCHRUN, "GROUP_RANK": "2"}, r"GROUP_RANK=2 is out of range for GROUP_WORLD_SIZE=2"),
    ({**TORCHRUN, "GROUP_WORLD_SIZE": "4"}, r"GROUP_WORLD_SIZE=4 is larger than WORLD_SIZE=3"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
    ({**TORCHRUN, "MASTER_PORT": "x"}, r"MASTER_PORT='x' is not an integer"),
    ({**OPEN_MPI, "OMPI_COMM_WORLD_RANK": "8"},
     r"OMPI_COMM_WORLD_RANK=8 is out of range for OMPI_COMM_WORLD_SIZE=8"),
    ({**OPEN_MPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "four"},
     r"OMPI_COMM_WORLD_LOCAL_SIZE='four' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, r"OMPI_COMM_WORLD_SIZE is not set"),
    ({**MPICH, "PMI_SIZE": "2"}, r"PMI_RANK=2 is out of range for PMI_SIZE=2"),
    ({**MPICH, "MPI_LOCALRANKID": "5"}, r"MPI_LOCALRANKID=5 is out of range for MPI_LOCALNRANKS=2"),
    ({**HOROVOD, "HOROVOD_SIZE": "3"}, r"HOROVOD_RANK=3 is out of range for HOROVOD_SIZE=3"),
    ({**HOROVOD, "HOROVOD_CROSS_RANK": "x"}, r"HOROVOD_CROSS_RANK='x' is not an integer"),
    ({**HOROVOD, "HOROVOD_GLOO_RENDEZVOUS_PORT": "0"},
     r"HOROVOD_GLOO_RENDEZVOUS_PORT=0 is not a TCP port"),
    ({k: v for k, v in HOROVOD.items() if k != "HOROVOD_GLOO_RENDEZVOUS_ADDR"},
     r"HOROVOD_GLOO_RENDEZVOUS_ADDR/HOROVOD_GLOO_RENDEZVOUS_PORT are not set"),
    ({**SLURM, "SLURM_NTASKS": "x6"}, r"SLURM_NTASKS='x6' is not an integer"),
    ({**SLURM, "SLURM_NODEID": "3"}, r"SLURM_NODEID=3 is out of range for SLURM_TASKS_PER_NODE"),
    ({**SLURM, "SLURM_NNODES": "2"}, r"SLURM_NODEID=2 is out of range"),
])
def test_invalid_values(env, match):
    with pytest.raises(ValueError, match=match):
        discover(env)


def test_errors_are_config_errors():
    with pytest.raises(ConfigError):
        discover({"RANK": "x", "WORLD_SIZE": "2"})


def test_empty_marker_is_ignored():
    """An empty variable (e.g. ``RANK=`` left by a shell) is not a launcher."""
    assert discover({"RANK": "", "WORLD_SIZE": "2"}).launcher is Launcher.SINGLE


# -- network helpers ------------------------------------------------------------------------

def test_interface_address():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(ConfigError, match="network interface 'nope0' has no IPv4 address"):
        interface_address("nope0")


def test_advertised_address_order():
    # The named interface wins over everything, also over "all ranks on one host".
    assert advertised_address({"GLOO_SOCKET_IFNAME": "lo"}, all_local=False) == "127.0.0.1"
    assert advertised_address({"NCCL_SOCKET_IFNAME": "=lo"}, all_local=False) == "127.0.0.1"
    assert advertised_address({"HOROVOD_GLOO_IFACE": "lo,eth9"}, all_local=False) == "127.0.0.1"
    assert advertised_address({}, all_local=True) == "127.0.0.1"
    with pytest.raises(ConfigError, match="'nope0'"):
        advertised_address({"GLOO_SOCKET_IFNAME": "nope0"}, all_local=True)


def test_advertised_address_multi_host_is_not_loopback():
    outside = route_source_address("8.8.8.8")
    try:
        host = socket.gethostbyname(socket.gethostname())
    except OSError:
        host = None
    usable = [a for a in (outside, host) if a and not a.startswith("127.")]
    if not usable:
        with pytest.raises(CGXError, match="set GLOO_SOCKET_IFNAME"):
            advertised_address({}, all_local=False)
    else:
        assert advertised_address({}, all_local=False) in usable
        # A "peer" on this host routes through loopback: skipped for a real address.
        assert advertised_address({}, all_local=False, peers=["localhost"]) in usable


def test_is_local_host():
    assert is_local_host("localhost") and is_local_host("127.0.0.1")
    assert is_local_host(socket.gethostname())
    assert not is_local_host("no-such-host.invalid")
