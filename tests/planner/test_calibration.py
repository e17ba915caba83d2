"""cgx.policy.planner.calibration and the command line, on this machine (one process) and on
2 real ranks (the link model every rank agrees on)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cgx.policy.planner import Collective
from cgx.policy.planner.calibration import compressor_throughput, link_model, trace_backward
from spawn import run_gloo


def _link_rank(rank, world):
    import cgx.torch as hvd
    from cgx import runtime
    hvd.init()
    links = link_model(runtime.transport(), sizes=(1 << 10, 1 << 23), reps=2)
    return {k.value: (ab.alpha, ab.beta, ab.cpu) for k, ab in links.items()}


@pytest.mark.multiproc
def test_link_model_is_the_same_on_every_rank():
    a, b = run_gloo(_link_rank, 2)
    assert a == b  # fitted from the slowest rank's times: every rank plans alike
    assert set(a) == {c.value for c in Collective}
    for alpha, beta, cpu in a.values():
        # loopback: calls well under a second, and faster than 1 MB/s; less than a
        # microsecond of CPU per byte (a single collective's CPU slope may come out 0 when
        # another process takes the cores between the two sizes: it is clamped at 0)
        assert 0 <= alpha < 1.0 and 0 < beta < 1e-6 and 0 <= cpu < 1e-6, a
    # 8 MB per rank takes visibly longer than 1 kB (a real bandwidth was measured), and
    # moving it takes this process CPU time.
    assert max(beta for _, beta, _ in a.values()) > 1e-11, a
    assert max(cpu for _, _, cpu in a.values()) > 0, a


def test_trace_backward_orders_gradients_as_backward_produces_them():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 4))
    x = torch.randn(12, 16)
    tensors, backward_s, tail_s = trace_backward(
        model, lambda: model(x).square().mean(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert [t.name for t in tensors] == [n for n, _ in model.named_parameters()]
    weights = [t for t in tensors if t.name.endswith("weight")]
    # Backward runs last layer first: its weight is ready first.
    assert weights[2].ready_s <= weights[1].ready_s <= weights[0].ready_s <= backward_s
    assert [(t.shape, t.rows) for t in weights] == [((64, 16), 12), ((64, 64), 12), ((4, 64), 12)]
    assert all(t.shape is None for t in tensors if t.name.endswith("bias"))
    assert tail_s > 0


def test_compressor_throughput_is_measured():
    tp = compressor_throughput(numel=1 << 16, reps=2)
    assert set(tp) == {"compress_bps", "decompress_bps", "cast_bps", "matmul_flops"}
    assert all(v > 1e6 for v in tp.values()), tp


def test_the_machines_throughput_is_measured_once_per_setting(monkeypatch):
    from cgx.policy.planner import calibration
    calls = []
    real = calibration.compressor_throughput
    monkeypatch.setattr(calibration, "compressor_throughput",
                        lambda **kw: calls.append(kw) or real(**{**kw, "numel": 1 << 12}))
    calibration._measured_throughput.cache_clear()
    try:
        first = calibration.machine_throughput(4, 1024)
        assert calibration.machine_throughput(4, 1024) == first  # the planner's next round
        first["compress_bps"] = 0.0  # a copy: what a caller does with it stays its own
        assert calibration.machine_throughput(4, 1024)["compress_bps"] > 0
        calibration.machine_throughput(8, 512)
        assert [(c["bits"], c["bucket_size"]) for c in calls] == [(4, 1024), (8, 512)]
    finally:
        calibration._measured_throughput.cache_clear()  # (the fake's figures are not kept)


def test_command_line_prints_the_plan(tmp_path):
    (tmp_path / "tinymodels.py").write_text(textwrap.dedent("""
        import torch.nn as nn
        def mlp():
            return nn.Sequential(nn.Linear(32, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                                 nn.Linear(2048, 10))
    """))
    out = subprocess.run([sys.executable, "-m", "cgx.policy.planner", "tinymodels:mlp", "--input", "8,32",
                          "--world", "4", "--gbit", "1"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "4 ranks at 1 Gbit/s" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 2.weight |")]
    # The 2048 x 2048 layer at batch 8 on 4 ranks: factors are 32x smaller, and chosen.
    assert len(rows) == 1 and "| sfb |" in rows[0], out.stdout
    bad = subprocess.run([sys.executable, "-m", "cgx.policy.planner", "nomodule:f", "--input", "2,3"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "cannot load 'nomodule:f'" in bad.stderr
    # A host whose cores the ranks share: the model says how much (threads per core).
    shared = subprocess.run([sys.executable, "-m", "cgx.policy.planner", "tinymodels:mlp", "--input",
                             "8,32", "--ranks-per-host", "4", "--transport-cpu-ns", "1"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert shared.returncode == 0, shared.stderr
    assert "; contention " in shared.stdout and "; contention 0\n" not in shared.stdout
    wrong = subprocess.run([sys.executable, "-m", "cgx.policy.planner", "tinymodels:mlp", "--input",
                            "8,32", "--ranks-per-host", "0"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
    assert wrong.returncode == 2 and "--ranks-per-host must be >= 1" in wrong.stderr


def test_transport_cpu_leaves_out_the_main_threads_backward():
    """Measured from another thread (a job's engine thread), the transport's CPU time does
    not include what the main thread spends meanwhile (backward); from the main thread
    it includes the caller's own work."""
    import threading
    import time

    from cgx.policy.planner.calibration import _process_cpu
    seen, done = {}, threading.Event()

    def engine():
        c0 = _process_cpu()
        time.sleep(0.3)
        seen["cpu"] = _process_cpu() - c0
        done.set()

    t = threading.Thread(target=engine)
    busy0 = time.thread_time()
    t.start()
    n = 0
    while not done.is_set():  # the main thread computes while the engine measures
        n += 1
    t.join()
    burnt = time.thread_time() - busy0
    assert burnt > 0.1 and seen["cpu"] < 0.5 * burnt, (burnt, seen)
    c0 = _process_cpu()
    t0 = time.thread_time()
    while time.thread_time() - t0 < 0.1:
        n += 1
    assert _process_cpu() - c0 >= 0.09
