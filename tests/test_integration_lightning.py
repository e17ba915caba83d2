"""cgx.integrations.lightning: CGXCallback on the real Lightning Trainer, 2 CPU processes.

Lightning's ``strategy="ddp"`` re-runs the script as its other processes, so every fit runs
examples/lightning_ddp.py in a subprocess (several fits per launch where they can share
one: a launch costs ~20 s of imports on 2 cores). The example writes rank 0's parameters,
losses and cgx's figures to ``--out``.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_ddp.py"
STEPS = 16  # two epochs of 8 steps; checkpoints at step 8 and 16
TIMEOUT = 240


def _launch(tmp: Path, *args: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    """One run of the example: Lightning starts the second process itself, or (``torchrun``)
    torchrun starts both and its exit code is non-zero when any rank's is."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(var, None)  # a fresh job
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())] \
        if torchrun else [sys.executable]
    return subprocess.run([*launcher, str(EXAMPLE), "--max-steps", str(STEPS),
                           "--log-dir", str(tmp / "logs"), "--out", str(tmp / "out"), *args],
                          cwd=tmp, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=TIMEOUT)



def _ok(run: subprocess.CompletedProcess) -> str:
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    return out


def _params_diff(a: dict, b: dict) -> float:
    assert a["params"].keys() == b["params"].keys()
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One launch, three fits of 16 steps: plain Lightning DDP, cgx exact, cgx 4-bit with
    error feedback (checkpointed at steps 8 and 16)."""
    tmp = tmp_path_factory.mktemp("lightning")
    out = _ok(_launch(tmp, "--compression", "plain,exact,4bit-ef", "--ckpt-dir",
                      str(tmp / "ckpt")))
    runs = {n: torch.load(tmp / "out" / f"{n}.pt") for n in ("plain", "exact", "4bit-ef")}
    return tmp, runs, out


@pytest.mark.multiproc
def test_exact_compression_is_plain_lightning_ddp(ddp_runs):
    _, runs, _ = ddp_runs
    assert runs["exact"]["global_step"] == runs["plain"]["global_step"] == STEPS
    assert runs["exact"]["figures"]["route"] == "ddp"
    assert runs["exact"]["figures"]["wire_bytes"] > 0  # the exchange went through cgx
    assert _params_diff(runs["exact"], runs["plain"]) <= 1e-6
    # the callback has DDP keep gradients as views of its buckets; plain DDP does not
    assert runs["exact"]["bucket_view"] is True and runs["plain"]["bucket_view"] is False


@pytest.mark.multiproc
def test_4bit_sends_less_logs_its_bytes_and_learns(ddp_runs):
    tmp, runs, _ = ddp_runs
    fig, exact = runs["4bit-ef"]["figures"], runs["exact"]["figures"]
    print(f"4-bit + EF: ratio {fig['ratio']:.2f}x, {fig['bytes_per_step']:.0f} bytes/step "
          f"(exact: {exact['bytes_per_step']:.0f})")
    assert fig["ratio"] >= 5.0
    assert fig["bytes_per_step"] * 5 <= exact["bytes_per_step"]
    losses = runs["4bit-ef"]["losses"]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    # the CSV logger got cgx's figures every 4 steps, and the plan at the end
    with open(Path(runs["4bit-ef"]["log_dir"]) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [r for r in rows if r.get("cgx/bytes_per_step")]
    assert [int(r["step"]) for r in logged] == [4, 8, 12, 16], rows
    assert all(float(r["cgx/bytes_per_step"]) == pytest.approx(fig["bytes_per_step"], rel=0.01)
               for r in logged)
    assert all(float(r["cgx/ratio"]) >= 5.0 for r in logged)
    assert any(r.get("cgx/plan_bits") and 4.0 < float(r["cgx/plan_bits"]) < 5.0 for r in rows)


@pytest.mark.multiproc
def test_resume_from_a_checkpoint_continues_exactly(ddp_runs):
    tmp, runs, _ = ddp_runs
    ckpt = tmp / "ckpt" / "4bit-ef" / "step=8.ckpt"
    # the checkpoint holds both ranks' cgx state, residuals included (not zero)
    saved = torch.load(ckpt, weights_only=True)["callbacks"]["CGXCallback"]
    assert saved["world"] == 2 and len(saved["ranks"]) == 2
    for blob in saved["ranks"]:
        state = torch.load(io.BytesIO(blob), weights_only=True)
        assert state["iteration"] == 8
        residuals = state["plan"]["residuals"]
        assert residuals and any(float(r.abs().sum()) > 0 for r in residuals.values())
    resumed_dir = tmp / "resumed"
    resumed_dir.mkdir()
    # under torchrun: every rank's exit code counts (Lightning's own launcher reports rank 0's)
    _ok(_launch(resumed_dir, "--compression", "4bit-ef", "--ckpt-path", str(ckpt),
                torchrun=True))
    resumed = torch.load(resumed_dir / "out" / "4bit-ef.pt")
    assert resumed["global_step"] == STEPS and len(resumed["losses"]) == STEPS - 8
    assert resumed["losses"] == pytest.approx(runs["4bit-ef"]["losses"][8:], abs=1e-6)
    assert _params_diff(resumed, runs["4bit-ef"]) <= 1e-6
    # and the residuals matter: 4 bits with them is not plain DDP
    assert _params_diff(runs["4bit-ef"], runs["plain"]) > 1e-5


@pytest.mark.multiproc
def test_pytorch_lightning_package_and_fsdp2_on_cpu(tmp_path):
    """The standalone ``pytorch_lightning`` Trainer takes PLCGXCallback (``lightning``'s
    CGXCallback ran in the fixture's launch), here on the FSDP2 route:
    ModelParallelStrategy + fully_shard in configure_model, cgx's reduce-scatter on 2 CPU
    processes (one launch for both: each costs ~20 s of imports)."""
    out = _ok(_launch(tmp_path, "--package", "pytorch_lightning", "--strategy", "fsdp2",
                      "--compression", "4bit", "--max-steps", "8"))
    run = torch.load(tmp_path / "out" / "4bit.pt")
    print(f"FSDP2 4-bit (pytorch_lightning): ratio {run['figures']['ratio']:.2f}x, "
          f"{run['figures']['bytes_per_step']:.0f} bytes/step")
    assert run["figures"]["route"] == "fsdp2" and run["global_step"] == 8, out[-2000:]
    assert run["figures"]["ratio"] >= 5.0
    assert run["losses"][-1] < run["losses"][0]


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy,message", [
    ("ddp-hook", "the model has one already"),
    ("model-parallel", "CGXCallback supports strategy='ddp'"),
])
def test_conflicting_or_unsupported_strategy_fails_before_the_first_step(tmp_path, strategy,
                                                                          message):
    run = _launch(tmp_path, "--strategy", strategy, "--compression", "4bit", "--max-steps", "4")
    out = run.stdout + run.stderr
    assert run.returncode != 0 and message in out, out[-4000:]
    assert "RuntimeError" in out
    assert not (tmp_path / "out").exists()  # no fit finished
    metrics = list((tmp_path / "logs").rglob("metrics.csv"))
    assert all("train_loss" not in m.read_text() for m in metrics)  # no step ran


def test_one_process_does_nothing_and_says_so(tmp_path):
    import lightning.pytorch as L
    from cgx.integrations.lightning import CGXCallback
    import cgx.torch

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)),
                                       batch_size=4)
    cb = CGXCallback(cgx.torch.Compression.quantize(bits=4))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, enable_progress_bar=False,
                        enable_model_summary=False, logger=False, enable_checkpointing=False,
                        callbacks=[cb], default_root_dir=tmp_path)
    with pytest.warns(UserWarning, match="one process"):
        trainer.fit(Tiny(), data)
    assert cb.route == "none" and cb.state is None and cb.state_dict() == {}
    assert trainer.global_step == 2


def test_bucket_views_unless_the_strategy_says_otherwise():
    """What CGXCallback.setup leaves in DDPStrategy's DDP arguments (the fit's own DDP
    module is checked by the multi-process tests)."""
    import lightning as L
    from cgx.integrations.lightning import CGXCallback

    def after_setup(strategy, stage="fit") -> dict:
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False)
        CGXCallback().setup(trainer, None, stage)
        return trainer.strategy._ddp_kwargs

    assert after_setup("ddp")["gradient_as_bucket_view"] is True
    kept = after_setup(L.pytorch.strategies.DDPStrategy(gradient_as_bucket_view=False))
    assert kept["gradient_as_bucket_view"] is False
    assert "gradient_as_bucket_view" not in after_setup("ddp", stage="validate")


def test_bad_arguments_and_states_are_clear_errors():
    from cgx.integrations.lightning import CGXCallbackImpl
    with pytest.raises(ValueError, match="log_every_n_steps"):
        CGXCallbackImpl(log_every_n_steps=0)
    with pytest.raises(ValueError, match="not a CGXCallback checkpoint state"):
        CGXCallbackImpl().load_state_dict({"format": 99})


def test_missing_package_names_the_pip_package(monkeypatch):
    import cgx.integrations.lightning as mod
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)  # import fails
    monkeypatch.setattr(mod, "_classes", {})
    with pytest.raises(ImportError, match="pip install pytorch-lightning"):
        mod.PLCGXCallback
