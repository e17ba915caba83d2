"""Every example runs (small settings) under cgxrun on 2 ranks, and Horovod's own examples
(examples/horovod/, the import swapped) behave as they do under Horovod: the PyTorch
synthetic benchmark runs unchanged under horovodrun once the import is swapped back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distutil import run_ranks

pytestmark = pytest.mark.multiproc

ROOT = Path(__file__).resolve().parent.parent
EX = ROOT / "examples"
SMALL_BENCH = ["--no-cuda", "--batch-size", "4", "--image-size", "32",
               "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"]


def _run(path, args=(), launcher="cgxrun-gloo", timeout=400):
    run = run_ranks(path=str(path), nprocs=2, launcher=launcher, args=list(args),
                    timeout=timeout)
    assert run.returncode == 0 and not run.timed_out, run.tail()
    return run.stdout


def _accuracy(out: str) -> float:
    found = re.findall(r"test accuracy ([\d.]+)%", out)
    assert found, out[-2000:]
    return float(found[-1])


def test_demo():
    """`make demo`'s table, as README shows it: five exchanges, the fixed ones with fewer
    bytes down the table (fp16 half of fp32, 4-bit and 2-bit several times less), the
    default (the deciding exchange) sending what the plan it kept sends, its plan table
    printed, every one learning, the ranks' parameters identical after each."""
    out = _run(EX / "demo.py")
    rows = re.findall(r"^(?:\[0\]<stdout>:)?\| (fp32 \(uncompressed\)|fp16 cast \(Horovod\)|"
                      r"cgx deciding \(default\)|cgx 4-bit|"
                      r"cgx 2-bit \+ error feedback) +\| +([\d.]+) kB \| +([\d.]+)x \| +[\d.]+ ms "
                      r"\| +([\d.]+)% \| (\w+) +\|$", out, flags=re.M)
    assert [r[0] for r in rows] == ["fp32 (uncompressed)", "fp16 cast (Horovod)",
                                    "cgx deciding (default)", "cgx 4-bit",
                                    "cgx 2-bit + error feedback"], out
    fixed = [r for r in rows if r[0] != "cgx deciding (default)"]
    kb, ratio = [float(r[1]) for r in fixed], [float(r[2]) for r in fixed]
    assert kb == sorted(kb, reverse=True) and ratio[0] == 1.0, out
    assert ratio[1] == pytest.approx(2.0, abs=0.05) and ratio[2] > 6 and ratio[3] > 12, out
    # the default's row: the plan it kept (one of the baselines' sizes on this model, its
    # table printed), and what measuring and trying cost beside it
    kept = re.search(r"^(?:\[0\]<stdout>:)?\| (.+?) \(kept\) \| [\d.]+ ms \| [\d.]+ ms \| "
                     r"([\d,]+) \|", out, flags=re.M)
    assert kept, out
    assert float(rows[2][1]) * 1e3 == pytest.approx(int(kept.group(2).replace(",", "")),
                                                    abs=100), out
    extra = re.search(r"sent ([\d.]+) MB\s+more over the run", out)
    assert extra and float(extra.group(1)) > 0, out
    assert all(float(r[3]) > 85 for r in rows), out  # 10 classes: chance is 10%
    assert all(r[4] == "yes" for r in rows), out


@pytest.mark.parametrize("script,args", [
    ("pytorch_horovod_style.py", ["--epochs", "3"]),
    ("pytorch_ddp_hook.py", []),
    ("keras_digits.py", ["--epochs", "3"]),
])
def test_digits_examples_learn(script, args):
    assert _accuracy(_run(EX / script, args)) > 80.0


def test_horovod_pytorch_synthetic_benchmark():
    out = _run(EX / "horovod" / "pytorch_synthetic_benchmark.py", SMALL_BENCH)
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+", out), out[-2000:]


def test_horovod_tensorflow2_synthetic_benchmark():
    out = _run(EX / "horovod" / "tensorflow2_synthetic_benchmark.py",
               SMALL_BENCH + ["--model", "MobileNetV2"])
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+", out), out[-2000:]


def test_horovod_keras_mnist_learns(tmp_path):
    out = _run(EX / "horovod" / "tensorflow2_keras_mnist.py",
               ["--epochs", "2", "--steps-per-epoch", "20", "--checkpoint-dir", str(tmp_path)])
    accs = [float(a) for a in re.findall(r"final accuracy: ([\d.]+)", out)]
    assert len(accs) == 2 and accs[0] == accs[1] > 0.5, out[-2000:]  # averaged metrics
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.keras",
                                                          "checkpoint-2.keras"]


def test_the_same_script_runs_under_horovod(horovodrun, tmp_path):
    """The example differs from a Horovod script by its import line only."""
    src = (EX / "horovod" / "pytorch_synthetic_benchmark.py").read_text()
    line = re.compile(r"^import cgx\.torch as hvd$", re.M)
    assert len(line.findall(src)) == 1
    theirs = tmp_path / "pytorch_synthetic_benchmark.py"
    theirs.write_text(line.sub("import horovod.torch as hvd", src))
    out = _run(theirs, SMALL_BENCH, launcher="horovodrun")
    assert re.search(r"Total img/sec on 2 CPU\(s\): [\d.]+", out), out[-2000:]
