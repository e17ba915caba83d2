"""Only the job's ranks join: CGX_JOB_SECRET, the HMAC gate, the loopback store.

Units: the proof (cgx.launch.secret), the config field, cgxrun's secret and its
redaction. The gate (cgx.launch.gate) on a real TCPStore, its ranks as threads.
Real jobs: 2 ranks through cgxrun --gloo, with the launcher's secret, with a rank
whose secret is wrong, and with hostile clients (raw garbage, a stranger with a
wrong secret) on the store's port. Every child starts with default signal
dispositions and runs under a timeout; a hang fails the test.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from cgx.config import ENV_VARS, Config
from cgx.errors import ConfigError
from cgx.launch import cli, secret
from cgx.launch.exit_record import default_signals
from cgx.launch.gate import AdmissionError, gated_store
from distutil import cgxrun_command

JOB_TIMEOUT_S = 120
GOOD = "a" * 64
WRONG = "b" * 64


# -- the proof, the config field, cgxrun's part ------------------------------------------------

def test_prove_and_verify():
    p = secret.prove(GOOD, "claim", "c0ffee", 1, 1)
    assert len(p) == 64 and secret.verify(GOOD, p, "claim", "c0ffee", 1, 1)
    assert not secret.verify(WRONG, p, "claim", "c0ffee", 1, 1)
    assert not secret.verify(GOOD, p, "claim", "c0ffee", 1, 2)  # bound to the rank
    assert not secret.verify(GOOD, "", "claim") and not secret.verify(GOOD, None, "claim")
    with pytest.raises(ValueError, match="separator"):
        secret.prove(GOOD, "a\x1fb")
    assert len(secret.draw()) == 64 and secret.draw() != secret.draw()


def test_config_reads_checks_and_hides_the_secret():
    cfg = Config.from_env({"CGX_JOB_SECRET": GOOD})
    assert cfg.job_secret == GOOD and GOOD not in repr(cfg) and GOOD not in str(cfg)
    assert Config.from_env({}).job_secret is None
    with pytest.raises(ConfigError, match="CGX_JOB_SECRET holds 5 characters; expected at least "
                                          "32"):
        Config.from_env({"CGX_JOB_SECRET": "short"})
    with pytest.raises(ConfigError, match="must be a string"):
        Config(job_secret=123)
    assert "CGX_JOB_SECRET" in ENV_VARS and "CGX_JOB_SECRET" in cli.help_env()


def test_cgxrun_draws_a_secret_and_never_prints_it(capsys):
    spec = cli.parse_args(["-np", "2", "prog"])
    drawn = cli.secret_env(spec, {}, print)[secret.SECRET_VAR]
    assert len(drawn) == 64
    assert cli.secret_env(spec, {secret.SECRET_VAR: GOOD}, print) == {}  # the user's, inherited
    multi = cli.parse_args(["-np", "2", "-H", "a.invalid:1,b.invalid:1", "prog"])
    assert cli.secret_env(multi, {}, print) == {}
    assert "export the same CGX_JOB_SECRET on every host" in capsys.readouterr().out
    assert cli._fmt({secret.SECRET_VAR: drawn, "A": "1"}, ["p"]) == \
        "A=1 CGX_JOB_SECRET='<redacted>' p"


# -- the gate on a real store, ranks as threads -------------------------------------------------

def _server():
    import torch.distributed as dist
    from cgx.launch.rendezvous import listening_socket
    sock = listening_socket("127.0.0.1", 0)
    port, fd = sock.getsockname()[1], sock.detach()
    return dist.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=20), master_listen_fd=fd)


def _client(port):
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=20))


def _gate(secrets_by_rank: list, world_size: int, start_timeout_s: float = 10.0):
    """Run the gate with one thread per (rank, secret); {index: store or exception}."""
    server = _server()
    results, lines = {}, []

    def one(i, rank, key):
        store = server if rank == 0 else _client(server.port)
        cfg = Config(job_secret=key, start_timeout_s=start_timeout_s)
        try:
            results[i] = gated_store(store, rank, world_size, cfg, "t", lines.append)
        except AdmissionError as e:
            results[i] = e

    threads = [threading.Thread(target=one, args=(i, r, k), daemon=True)
               for i, (r, k) in enumerate(secrets_by_rank)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(start_timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "the gate hung"
    return results, lines, server


def test_gate_admits_the_job_and_agrees_on_a_secret_prefix():
    results, lines, server = _gate([(0, GOOD), (1, GOOD), (2, GOOD)], 3)
    assert lines == [] and not any(isinstance(r, Exception) for r in results.values())
    for i in (1, 2):  # every admitted rank sees what rank 0 writes under the group prefix
        results[i].set(f"k{i}", "v")
        assert results[0].get(f"k{i}") == b"v"
    keys = server.list_keys()  # under the prefix only; but any client can list them
    assert "k1" not in keys and any(k.startswith("cgx/group/") and k.endswith("/k1") for k in keys)


def test_gate_refuses_a_wrong_secret_and_the_job_goes_on():
    results, lines, _ = _gate([(0, GOOD), (1, WRONG), (1, GOOD)], 2)
    assert isinstance(results[1], AdmissionError)
    assert "refused this process as rank 1 (with this CGX_JOB_SECRET)" in str(results[1])
    assert "set CGX_JOB_SECRET to the launcher's value" in str(results[1])
    assert not isinstance(results[0], Exception) and not isinstance(results[2], Exception)
    assert len(lines) == 1 and "claiming rank 1" in lines[0] and "differs from rank 0's" in lines[0]
    assert "set CGX_JOB_SECRET to the launcher's value" in lines[0]


def test_gate_refuses_a_rank_without_secret_and_a_duplicate():
    results, lines, _ = _gate([(0, GOOD), (1, None)], 2, start_timeout_s=2.0)
    assert "refused this process as rank 1 (without CGX_JOB_SECRET)" in str(results[1])
    assert "rank 0 admitted ranks none of 1..1, but ranks [1] did not prove" in str(results[0])
    assert any("it has no CGX_JOB_SECRET" in line for line in lines)


def test_gate_open_job_unchanged_and_a_lone_secret_refused():
    results, lines, server = _gate([(0, None), (1, None)], 2)
    assert results[0] is server and lines == []
    results, _, _ = _gate([(0, None), (1, GOOD)], 2)
    assert "this rank has CGX_JOB_SECRET set but rank 0 has none" in str(results[1])


def test_gate_late_claim_is_refused_not_left_waiting():
    server = _server()
    cfg = Config(job_secret=GOOD, start_timeout_s=10)
    done = threading.Thread(target=gated_store, args=(_client(server.port), 1, 2, cfg, "t"))
    done.start()
    gated_store(server, 0, 2, cfg, "t")
    done.join(10)
    t0 = time.monotonic()
    with pytest.raises(AdmissionError, match="the job already has all its ranks"):
        gated_store(_client(server.port), 1, 2, cfg, "t")
    assert time.monotonic() - t0 < 5


# -- real jobs ------------------------------------------------------------------------------------

_JOB = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    if rank == 0:
        (out / "port").write_text(os.environ["MASTER_PORT"])
    if rank == 1 and len(sys.argv) > 2 and sys.argv[2] == "wrong-secret":
        os.environ["CGX_JOB_SECRET"] = "c" * 64
    if rank == 1 and len(sys.argv) > 2 and sys.argv[2] == "after-hostile":
        for _ in range(600):  # the test's hostile clients go first
            if (out / "hostile.done").exists():
                break
            time.sleep(0.1)
    import torch, cgx.torch as hvd
    import cgx.runtime as rt
    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(3):
        opt.zero_grad()
        model(torch.full((2, 4), float(rank + 1))).sum().backward()
        opt.step()
    print("config:", rt.config(), flush=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "weight": model.weight.detach().flatten().tolist(), "size": hvd.size(),
        "secret": os.environ.get("CGX_JOB_SECRET")}))
""")


def _start(tmp_path: Path, *args, env_extra=None) -> subprocess.Popen:
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CGX_START_TIMEOUT_S": "30",
                "CGX_COMPRESSION": "quantize", **(env_extra or {})})
    # Default dispositions (a suite may run with SIGINT ignored) and a session of its own,
    # so that a timeout kills every rank.
    return subprocess.Popen(cgxrun_command() + ["-np", "2", "--verbose", sys.executable,
                                                str(script), str(tmp_path), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_signals, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the job hung; its output:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def _reports(tmp_path: Path):
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.multiproc
def test_cgxrun_job_with_its_secret_trains_and_never_prints_it(tmp_path):
    rc, out, err = _finish(_start(tmp_path))
    assert rc == 0, err[-3000:]
    r0, r1 = _reports(tmp_path)
    assert r0["size"] == 2 and r0["weight"] == r1["weight"]  # the same model on both ranks
    assert r0["secret"] == r1["secret"] and len(r0["secret"]) == 64  # drawn by cgxrun
    assert "config: Config(" in out and "CGX_JOB_SECRET='<redacted>'" in err
    assert r0["secret"] not in out + err


def test_rank_with_a_wrong_secret_is_refused_and_nothing_hangs(tmp_path):
    t0 = time.monotonic()
    rc, out, err = _finish(_start(tmp_path, "wrong-secret"))
    assert rc != 0
    assert "rank 0 refused a process claiming rank 1" in err
    assert "refused this process as rank 1 (with this CGX_JOB_SECRET)" in err
    assert "set CGX_JOB_SECRET to the launcher's value" in err
    assert time.monotonic() - t0 < 60  # the refusal stops the job; no start timeout waited


@pytest.mark.multiproc
def test_hostile_clients_on_the_store_do_not_stop_the_job(tmp_path):
    proc = _start(tmp_path, "after-hostile")
    try:
        port_file = tmp_path / "port"
        deadline = time.monotonic() + 60
        while not port_file.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        port = int(port_file.read_text())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:  # raw garbage
            s.sendall(os.urandom(1 << 16))
        cfg = Config(job_secret=WRONG, start_timeout_s=30)  # a stranger with a wrong secret
        with pytest.raises(AdmissionError, match="differs from rank 0's"):
            gated_store(_client(port), 1, 2, cfg, "0.0")
    finally:
        (tmp_path / "hostile.done").write_text("")
    rc, out, err = _finish(proc)
    assert rc == 0, err[-3000:]
    r0, r1 = _reports(tmp_path)
    assert r0["weight"] == r1["weight"]
    assert err.count("rank 0 refused a process claiming rank 1") == 1
