"""The slow-link simulator (benchmarks/netsim): validation, shaping, launch, teardown.

Tests that build namespaces skip, with the reason, only when this machine
cannot create them (NetnsUnavailable: not root, no iproute2).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.netsim import (
    NetnsUnavailable,
    RankFailedError,
    Shaping,
    SlowNetwork,
    cleanup_leftovers,
    list_namespaces,
    parse_rate,
    parse_size,
    parse_time,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _started(**kwargs) -> SlowNetwork:
    net = SlowNetwork(**kwargs)
    try:
        return net.start()
    except NetnsUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err.reason}")


def _root_links() -> str:
    return subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("rate, bits", [
    ("100mbit", 10**8), ("1gbit", 10**9), ("10gbit", 10**10), ("1.5Gbit", 15 * 10**8),
    ("500kbit", 5 * 10**5), ("125mbps", 10**9),  # tc: "bps" is bytes per second
])
def test_parse_rate(rate, bits):
    assert parse_rate(rate) == bits


@pytest.mark.parametrize("rate, exc, match", [
    ("1000", ValueError, "unit '\\(none\\)'"),
    ("1 gigabit", ValueError, "expected one of"),
    ("fast", ValueError, "is not '<number><unit>'"),
    ("-1gbit", ValueError, "is not '<number><unit>'"),
    ("0mbit", ValueError, "is zero"),
    (10**9, TypeError, "must be a string"),
])
def test_parse_rate_rejects(rate, exc, match):
    with pytest.raises(exc, match=match):
        parse_rate(rate)


def test_parse_size_and_time():
    assert parse_size("256kb") == 256 * 1024
    assert parse_size("1mbit") == 1024**2 // 8
    assert parse_time("50ms") == pytest.approx(0.05)
    with pytest.raises(ValueError, match="burst '256xb' has unit 'xb'"):
        parse_size("256xb")
    with pytest.raises(ValueError, match="latency '50' has unit"):
        parse_time("50")
    with pytest.raises(ValueError, match="must be positive"):
        parse_time("0ms")


def test_shaping_and_network_arguments():
    assert Shaping(rate=None, burst="junk").bits_per_second is None  # unshaped: burst unused
    with pytest.raises(ValueError, match="has no tbf qdisc"):
        Shaping(rate=None).tc_args()
    assert Shaping(rate="1gbit").tc_args() == ["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"]
    assert Shaping(rate="10gbit").effective_burst == "2441kb"  # default bucket: 2 ms of the rate
    assert Shaping(rate="10gbit", burst="256kb").effective_burst == "256kb"
    with pytest.raises(ValueError, match="needs at least one full frame"):
        Shaping(rate="1gbit", burst="1kb")
    with pytest.raises(ValueError, match="rate 'fast'"):
        SlowNetwork(rate="fast")
    with pytest.raises(ValueError, match="n_ranks must be >= 2"):
        SlowNetwork(n_ranks=1)
    with pytest.raises(TypeError, match="n_ranks must be an int"):
        SlowNetwork(n_ranks=2.0)
    with pytest.raises(ValueError, match="must be a private IPv4 range"):
        SlowNetwork(subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="not an IP network"):
        SlowNetwork(subnet="10.213.0.0/33")
    with pytest.raises(ValueError, match="room for 2 hosts, 3 asked"):
        SlowNetwork(n_ranks=3, subnet="10.213.0.0/30")
    net = SlowNetwork(n_ranks=3, rate=None)
    assert net.switch and net.master_addr == "10.213.0.1"
    assert [ep.ifname for ep in net.ranks] == ["cgx0", "cgx1", "cgx2"]
    assert all(ns.startswith(net.prefix) for ns in net.namespaces)
    with pytest.raises(TypeError, match="not a string"):
        net.launch("python -c pass")
    with pytest.raises(ValueError, match="must hold 3 argvs"):
        net.launch([["true"], ["true"]])
    with pytest.raises(ValueError, match="rank_env must hold 3 mappings"):
        net.launch(["true"], rank_env=[{}])
    with pytest.raises(RuntimeError, match="needs a started network"):
        net.launch(["true"])
    with pytest.raises(ValueError, match="package.module:function"):
        net.run_function("no_colon")
    with pytest.raises(ValueError, match="divisor of n_ranks=4"):
        SlowNetwork(n_ranks=4, ranks_per_host=3)
    with pytest.raises(ValueError, match="make one host"):
        SlowNetwork(n_ranks=2, ranks_per_host=2)
    hosts = SlowNetwork(n_ranks=4, ranks_per_host=2, rate=None)
    assert not hosts.switch and len(hosts.namespaces) == 2
    assert [ep.namespace for ep in hosts.ranks] == [hosts.namespaces[i] for i in (0, 0, 1, 1)]
    assert [ep.address for ep in hosts.ranks] == ["10.213.0.1"] * 2 + ["10.213.0.2"] * 2
    env = hosts.rank_env(3)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"],
            env["GROUP_WORLD_SIZE"], env["WORLD_SIZE"]) == ("1", "2", "1", "2", "4")


# --------------------------------------------------------------- live network
@pytest.mark.netns
@pytest.mark.multiproc
def test_shaped_gloo_allreduce_at_100mbit_then_teardown():
    """2 ranks on a 100 Mbit/s veth pair: correct Gloo allreduce, paced by tbf, then all gone."""
    net = _started(n_ranks=2, rate="100mbit")
    with net:
        assert list_namespaces(net.prefix) == sorted(net.namespaces)
        for ep in net.ranks:
            qdisc = subprocess.run(["tc", "-n", ep.namespace, "qdisc", "show", "dev", ep.ifname],
                                   capture_output=True, text=True).stdout
            assert "tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
        # Nothing of ours in the root namespace.
        assert " cgx0" not in _root_links() and " cgx1" not in _root_links()
        (r0, r1) = net.run_function("benchmarks.netsim.probes:allreduce_probe",
                                    {"size_mb": 10, "reps": 1, "warmup": 0}, timeout=120)
    assert list_namespaces(net.prefix) == []
    assert r0["correct"] and r1["correct"]
    assert r0["bytes"] == 10**7 and r0["world_size"] == 2
    # 2-rank allreduce: each rank sends 10 MB = 80 Mbit at 100 Mbit/s -> ~0.84 s with framing.
    elapsed = max(r0["times_s"][0], r1["times_s"][0])
    assert 0.5 < elapsed < 8.0, f"10 MB allreduce at 100 Mbit/s took {elapsed:.3f} s"


@pytest.mark.netns
@pytest.mark.multiproc
def test_two_hosts_of_two_ranks_share_a_namespace_and_its_shaped_link():
    """2 hosts x 2 ranks: the 4-rank allreduce is right; only the host link carries traffic."""
    net = _started(n_ranks=4, ranks_per_host=2, rate="100mbit")
    with net:
        res = net.run_function("benchmarks.netsim.probes:allreduce_probe",
                               {"size_mb": 4, "reps": 1, "warmup": 0}, timeout=120)
        tx = [int(subprocess.run(["ip", "netns", "exec", ep.namespace, "cat",
                                  f"/sys/class/net/{ep.ifname}/statistics/tx_bytes"],
                                 capture_output=True, text=True, check=True).stdout)
              for ep in net.hosts]
    assert list_namespaces(net.prefix) == []
    assert all(r["correct"] and r["world_size"] == 4 for r in res)
    # Gloo's ring over 4 ranks sends 2 x 3/4 x 4 MB per rank; the two ranks of a
    # host share its veth, and some of their ring neighbours are on the same host.
    assert all(tx_host > 4e6 for tx_host in tx), tx


@pytest.mark.netns
@pytest.mark.multiproc
def test_failing_rank_stops_the_group_and_network_is_removed(tmp_path):
    net = _started(n_ranks=2, rate="1gbit")
    # Rank 1 fails once rank 0 has printed (else the harness may stop rank 0 before it
    # prints: seen on a loaded machine).
    rank0 = ("import os, time; e = os.environ; print(e['RANK'], e['MASTER_ADDR'], "
             "e['GLOO_SOCKET_IFNAME'], e['CALLER'], e['PER_RANK'], flush=True); "
             "open(e['PRINTED'], 'w').close(); time.sleep(60)")
    rank1 = ("import os, sys, time; end = time.time() + 20\n"
             "while not os.path.exists(os.environ['PRINTED']) and time.time() < end:\n"
             "    time.sleep(0.05)\n"
             "print('bad input', file=sys.stderr); sys.exit(3)")
    with net:
        result = net.launch([[sys.executable, "-c", rank0], [sys.executable, "-c", rank1]],
                            env={"CALLER": "x", "PRINTED": str(tmp_path / "rank0-printed")},
                            rank_env=[{"PER_RANK": "a"}, {"PER_RANK": "b"}], timeout=60)
        assert result.returncodes[1] == 3 and result.failed_ranks == [1]
        assert result.ranks[0].killed and result.ranks[0].returncode < 0  # stopped by the harness
        assert result.elapsed_s < 30
        assert result.ranks[0].stdout.split() == ["0", net.master_addr, "cgx0", "x", "a"]
        with pytest.raises(RankFailedError, match=r"(?s)rank\(s\) \[1\] failed.*bad input"):
            result.check()

        timed = net.launch([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1.0)
        assert timed.timed_out and all(r.killed and r.timed_out for r in timed.ranks)
        assert timed.elapsed_s < 10
        with pytest.raises(RankFailedError, match="timed out"):
            timed.check()

        with pytest.raises(RankFailedError, match="has no function 'missing'"):
            net.run_function("benchmarks.netsim.probes:missing", backend=None, timeout=60)
    assert list_namespaces(net.prefix) == []

    # An exception inside the with-block removes the network too.
    net = _started(n_ranks=3, rate="1gbit")  # the switch topology, built and torn down
    with pytest.raises(ZeroDivisionError):
        with net:
            assert len(list_namespaces(net.prefix)) == 4
            sw = subprocess.run(["tc", "-n", net.switch_namespace, "qdisc", "show"],
                                capture_output=True, text=True).stdout
            assert sw.count("tbf") == 3, sw
            1 / 0
    assert list_namespaces(net.prefix) == []


_HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from benchmarks.netsim import SlowNetwork
    net = SlowNetwork(n_ranks=2, rate="1gbit").start()
    print(net.prefix, flush=True)
    time.sleep(60)
""")


@pytest.mark.netns
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGKILL"])
def test_teardown_when_the_owner_is_stopped(how):
    """SIGTERM/SIGINT tear down in the owner; after SIGKILL, cleanup_leftovers() does."""
    _started(n_ranks=2, rate=None).close()  # skips here if namespaces are unavailable
    # The owner starts with default signal dispositions: a suite run in the background
    # (SIGINT ignored, inherited) must test the same owner as one run from a terminal.
    from cgx.launch.exit_record import default_signals
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(root=str(REPO_ROOT))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals)
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix.startswith("cgxns-"), proc.stderr.read()
        assert len(list_namespaces(prefix)) == 2
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if how == "SIGKILL":
        left = list_namespaces(prefix)
        assert len(left) == 2  # nothing could run in the owner
        removed = cleanup_leftovers()  # only namespaces whose owner is gone
        assert set(left) <= set(removed)
    else:
        assert proc.returncode != 0  # the previous handler ran after teardown
        if how == "SIGINT":
            assert "KeyboardInterrupt" in proc.stderr.read()
    assert list_namespaces(prefix) == []
