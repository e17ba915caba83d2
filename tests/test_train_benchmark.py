"""benchmarks/train.py (time to accuracy) in its tiny version: every path runs and its
outputs are produced and consistent.

Real ranks in real network namespaces (unshaped links), tiny models, a few steps.
Tests skip, with the reason, only when this machine cannot build namespaces, and
the Horovod test only when Horovod is not built.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import train
from benchmarks.netsim import NetnsUnavailable
from benchmarks.netsim.namespaces import check_available
from benchmarks.timetoacc import methods, report
from benchmarks.timetoacc.workloads import TINY

pytestmark = [pytest.mark.netns, pytest.mark.multiproc]
STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def _netns():
    try:
        check_available()
    except NetnsUnavailable as err:
        pytest.skip(f"network namespaces unavailable: {err.reason}")


def _run(out, *args):
    rc = train.main(["--tiny", "--steps", str(STEPS), "--eval-every", "2", "--rates", "none",
                     "--out", str(out), "--resume", *args])
    assert rc == 0
    with open(f"{out}.json") as f:
        return json.load(f)


def _params(workload):
    from benchmarks.timetoacc import workloads
    return sum(p.numel() for p in workloads.make(workload, 0, 1, 0, tiny=True).model.parameters())


def _check_consistent(records):
    for r in records:
        assert "error" not in r, r
        world = 4 if r["topology"] == "2x2" else 2
        per_step = TINY[r["workload"]].batch * world
        # Every rank of every method trained the same samples.
        assert r["samples_trained_per_rank"] == [STEPS * per_step] * world, r["method"]
        assert r["train_loss_finite"], r["method"]
        assert [p["step"] for p in r["curve"]] == [0, 2, 4]
        assert all(math.isfinite(p["loss"]) and p["loss"] > 0 for p in r["curve"])
        times = [p["train_s"] for p in r["curve"]]
        assert times[0] == 0.0 and times == sorted(times) and times[-1] > 0
        assert r["step_s"] > 0 and r["samples_per_s"] == pytest.approx(per_step / r["step_s"])
        assert r["peak_rss_bytes"] > 50 * 2**20
        split = r["compute_s"] + r["exposed_comm_s"] + r["compression_s"]
        assert split == pytest.approx(r["step_s"], rel=0.05) or r["exposed_comm_s"] == 0.0
        if r["topology"] != "2x2":
            # What the interface carried matches what the method counts, plus TCP/IP
            # headers and the benchmark's barriers.
            ratio = r["link_bytes_per_step"] / r["accounted_bytes_per_step"]
            assert 0.98 < ratio < 1.35, (r["method"], ratio)


def test_every_method_both_workloads_hosts_and_study(tmp_path):
    out = tmp_path / "train"
    cnn = ["ddp-fp32", "ddp-fp16", "ddp-bf16", "ddp-powersgd-r1", "cgx-8bit", "cgx-2bit-ef-sfb",
           "cgx-auto"]
    _run(out, "--workloads", "cnn", "--methods", ",".join(cnn))
    _run(out, "--workloads", "lm", "--methods", "ddp-fp32,cgx-4bit")
    _run(out, "--workloads", "cnn", "--topology", "2x2", "--methods", "ddp-fp32,cgx-4bit")
    data = _run(out, "--workloads", "lm", "--study", "--seeds", "0,1",
                "--methods", "ddp-fp32,cgx-4bit")
    records = data["records"]
    got = {(r["workload"], r["topology"], r["seed"], r["method"]) for r in records}
    assert got == ({("cnn", "2", 0, m) for m in cnn} | {("lm", "2", s, m) for s in (0, 1)
                   for m in ("ddp-fp32", "cgx-4bit")} | {("cnn", "2x2", 0, "ddp-fp32"),
                                                         ("cnn", "2x2", 0, "cgx-4bit")})
    _check_consistent(records)

    # Counted bytes are the formulas: ring allreduce of fp32 / fp16 values, and
    # cgx's 8-bit payload (1 byte per value plus 8 per 1024-value bucket) far below.
    by = {(r["workload"], r["topology"], r["seed"], r["method"]): r for r in records}
    n = _params("cnn")
    assert by["cnn", "2", 0, "ddp-fp32"]["accounted_bytes_per_step"] == 4 * n
    assert by["cnn", "2", 0, "ddp-fp16"]["accounted_bytes_per_step"] == 2 * n
    assert by["cnn", "2", 0, "ddp-bf16"]["accounted_bytes_per_step"] == 2 * n
    assert by["cnn", "2", 0, "ddp-powersgd-r1"]["accounted_bytes_per_step"] == 4 * n  # exact phase
    assert n < by["cnn", "2", 0, "cgx-8bit"]["accounted_bytes_per_step"] < 1.1 * n
    assert by["cnn", "2", 0, "cgx-auto"]["plan"].startswith("| layer |")
    # 2 hosts x 2 ranks: the host link carries less than the 4 ranks' flat ring would.
    assert by["cnn", "2x2", 0, "cgx-4bit"]["link_bytes_per_step"] > 0

    md = Path(f"{out}.md").read_text()
    for title in ("cnn, 2 ranks, unshaped, seed 0", "lm, 2 ranks, unshaped, seed 0",
                  "cnn, 2 hosts x 2 ranks, unshaped, seed 0", "Accuracy over seeds"):
        assert title in md
    # Study runs (seed 1) appear in the accuracy table only, averaged with seed 0.
    assert "seed 1" not in md
    study = [line for line in md.splitlines() if line.startswith("| lm | cgx-4bit | 2 |")]
    assert len(study) == 1
    for key in {report.scenario(r) for r in records if r["kind"] == "time"}:
        png = Path(f"{out}-{'-'.join(str(k) for k in key)}.png")
        assert png.stat().st_size > 10_000
    # The target is DDP fp32's final loss (+2%): DDP fp32 itself reaches it.
    for title, times in data["time_to_target"].items():
        assert times["time_to_target_s"]["ddp-fp32"] is not None, title


def test_batch_norm_statistics_re_estimated_for_every_evaluation(tmp_path):
    """--bn-batches: the CNN is evaluated with re-estimated statistics (the target and the
    curves use them), the running ones kept beside; the LM has none and is unchanged."""
    data = _run(tmp_path / "train", "--workloads", "cnn,lm", "--methods", "ddp-fp32,cgx-4bit",
                "--bn-batches", "2")
    records = data["records"]
    _check_consistent(records)
    for r in records:
        has = ["loss_running_stats" in p for p in r["curve"]]
        assert all(has) if r["workload"] == "cnn" else not any(has), r["method"]
        if r["workload"] == "cnn":
            assert any(p["loss"] != p["loss_running_stats"] for p in r["curve"]), r["method"]


def test_fsdp_methods_train_and_count_what_they_send(tmp_path):
    fsdp = ["fsdp-fp32", "fsdp-bf16", "cgx-fsdp-8bit", "cgx-fsdp-4bit", "cgx-fsdp-4bit-p8"]
    data = _run(tmp_path / "fsdp", "--workloads", "lm", "--methods", ",".join(["ddp-fp32", *fsdp]))
    records = {r["method"]: r for r in data["records"]}
    assert set(records) == {"ddp-fp32", *fsdp}
    for r in records.values():
        assert "error" not in r, r
        assert r["samples_trained_per_rank"] == [STEPS * TINY["lm"].batch * 2] * 2, r["method"]
        assert r["train_loss_finite"] and all(math.isfinite(p["loss"]) for p in r["curve"])
    # What crossed the interface: bf16 halves the reduce-scatter, 8 then 4 bits cut it
    # further, and 8-bit parameters cut the all-gather, which the others send in fp32. (The
    # counted bytes of FSDP2's own collectives on Gloo fall short of the link's: the link is
    # the measurement these methods are compared by.)
    link = {m: records[m]["link_bytes_per_step"] for m in fsdp}
    assert link["fsdp-fp32"] > link["fsdp-bf16"] > link["cgx-fsdp-8bit"] > link["cgx-fsdp-4bit"]
    assert link["cgx-fsdp-4bit-p8"] < 0.5 * link["cgx-fsdp-4bit"]
    assert all(records[m]["accounted_bytes_per_step"] > 0 for m in fsdp)
    # cgx's own collectives are counted once each, as handed to its transport: under what
    # the link carried (the quantized all-gather was once counted twice, 2.27 against
    # 1.39 MB on the link)
    p8 = records["cgx-fsdp-4bit-p8"]
    assert p8["accounted_bytes_per_step"] <= p8["link_bytes_per_step"], p8


def test_local_step_methods_cgx_torch_and_torchft(tmp_path):
    """cgx's DiLoCo, torch's post-local SGD and torchft's DiLoCo (its lighthouse and
    managers on the simulated hosts' addresses) train 3 times DDP's steps; what the link
    carried covers what torch's and torchft's formulas count (torchft's: one fp32
    allreduce a round, and its heartbeats and quorum calls besides)."""
    local = ["cgx-diloco-h4", "torch-postlocal-sgd-h4", "torchft-diloco-h4",
             "torchft-diloco-streaming-h10"]
    data = _run(tmp_path / "local", "--workloads", "lm", "--methods", ",".join(["ddp-fp32", *local]))
    records = {r["method"]: r for r in data["records"]}
    assert set(records) == {"ddp-fp32", *local}
    for name in local:
        r = records[name]
        assert "error" not in r, r
        assert r["samples_trained_per_rank"] == [3 * STEPS * TINY["lm"].batch * 2] * 2, name
        assert r["train_loss_finite"] and all(math.isfinite(p["loss"]) for p in r["curve"])
        assert r["curve"][-1]["step"] == 3 * STEPS
        assert r["accounted_bytes_per_step"] > 0, name
    for name in local[1:]:  # counted by the ring formula
        r = records[name]
        assert r["link_bytes_per_step"] >= r["accounted_bytes_per_step"], r
    torchft = records["torchft-diloco-h4"]
    assert torchft["accounted_bytes_per_step"] == 4 * _params("lm") * 3 / (3 * STEPS)
    # Streaming: a fifth of the parameters every 2 steps, 6 syncs (of 5 fragments in turn).
    streaming = records["torchft-diloco-streaming-h10"]["accounted_bytes_per_step"]
    assert 4 * _params("lm") < streaming * 3 * STEPS < 2 * 4 * _params("lm")
    for name in local[2:]:
        r = records[name]
        assert r["link_bytes_per_step"] < 2 * r["accounted_bytes_per_step"], name
        # Rounds of fp32 parameters against DDP's every step.
        assert r["link_bytes_per_step"] < 0.5 * records["ddp-fp32"]["link_bytes_per_step"], name


@pytest.mark.horovod
def test_horovod_methods(tmp_path):
    ok, why = train.horovod_available()
    if not ok:
        pytest.skip(why)
    data = _run(tmp_path / "hvd", "--workloads", "cnn", "--methods", "horovod-fp32,horovod-fp16")
    _check_consistent(data["records"])
    n = _params("cnn")
    counted = {r["method"]: r["accounted_bytes_per_step"] for r in data["records"]}
    assert counted == {"horovod-fp32": 4 * n, "horovod-fp16": 2 * n}


def test_method_names_are_checked():
    assert methods.check("cgx-2bit-ef-sfb-flat") == "cgx-2bit-ef-sfb-flat"
    for bad in ("cgx-9bit", "ddp-powersgd", "cgx-4bit-fast", "horovod"):
        with pytest.raises(ValueError, match="unknown method"):
            methods.check(bad)
    with pytest.raises(SystemExit):
        train.main(["--methods", "nope"])
