"""cgx.integrations.huggingface with the real transformers and accelerate packages.

Two CPU ranks under torchrun (and ``accelerate launch``) train a tiny randomly initialised
GPT-2 on characters of the standard library's source (examples/huggingface_trainer.py,
examples/accelerate_ddp.py); nothing is downloaded. Exact compression reproduces the
plain runs, a 4-bit run compresses and learns, and resumed runs end where uninterrupted
ones do.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "examples" / "huggingface_trainer.py"
ACCELERATE = ROOT / "examples" / "accelerate_ddp.py"
TIMEOUT_S = 180
SHORT = ("--max-steps", "6", "--save-steps", "3")



def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CGX_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _launch(cmd: list, cwd: Path) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n" \
                                 f"{out[-6000:]}"
    return out


def torchrun(script: Path, *args, cwd: Path) -> str:
    return _launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                    str(script), *map(str, args)], cwd)


def accelerate_launch(script: Path, *args, cwd: Path) -> str:
    # --multi_gpu selects Accelerate's torchrun launcher (its --cpu launches one process);
    # the script's Accelerator(cpu=True) then runs Gloo on the CPU. Every setting is a
    # flag: no config file is read (none in the home directory is needed).
    return _launch([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                    "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
                    "--main_process_port", str(free_port()), str(script), "--cpu",
                    *map(str, args)], cwd)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def trainer_run(tmp_path: Path, name: str, *args) -> dict:
    out = tmp_path / f"{name}.pt"
    torchrun(TRAINER, "--output-dir", tmp_path / name, "--out", out, *args, cwd=tmp_path)
    result = torch.load(out, weights_only=False)
    other = torch.load(f"{out}.rank1")
    assert max_diff(result["params"], other) == 0.0, "the ranks' parameters differ"
    return result


# -- (a) exact compression under the Trainer's own DDP settings ----------------------------

@pytest.mark.multiproc
def test_trainer_exact_equals_plain_trainer_with_find_unused_parameters(tmp_path):
    """Also the baseline of (c): the plain Trainer itself resumes exactly (data order, RNG,
    optimizer), so any difference there is cgx's."""
    plain = trainer_run(tmp_path, "plain", "--compression", "off", *SHORT)
    exact = trainer_run(tmp_path, "exact", "--compression", "exact", *SHORT,
                        "--attach", "callback")  # Trainer(callbacks=[CGXTrainerCallback()])
    assert exact["find_unused"] is True  # the Trainer's default for a PreTrainedModel
    assert exact["hooked"] and not plain["hooked"]
    # the callback, given at construction, has DDP keep gradients as views of its buckets
    assert exact["bucket_view"] is True and plain["bucket_view"] is False
    assert exact["wire_bytes"] > 0  # the hook did exchange
    assert max_diff(plain["params"], exact["params"]) <= 1e-6
    resumed = trainer_run(tmp_path, "plain-resumed", "--compression", "off", *SHORT,
                          "--resume", tmp_path / "plain" / "checkpoint-3")
    assert max_diff(plain["params"], resumed["params"]) <= 1e-6


# -- (b) 4 bits: compresses, logs, learns ---------------------------------------------------

@pytest.mark.multiproc
def test_trainer_4_bits_compresses_logs_and_learns(tmp_path):
    run = trainer_run(tmp_path, "q4", "--compression", "q4", "--max-steps", "10")
    assert run["bucket_view"] is True  # compress(trainer) too
    logged = [h for h in run["log_history"] if "loss" in h]
    print(f"\n4-bit Trainer: ratio {run['ratio']:.2f}x, "
          f"{logged[-1]['cgx/bytes_per_step']:.0f} bytes/step, "
          f"loss {logged[0]['loss']:.3f} -> {logged[-1]['loss']:.3f}")
    assert run["ratio"] >= 5.0
    assert len(logged) == 10 and all("cgx/bytes_per_step" in h and "cgx/ratio" in h
                                     for h in logged)
    assert all(h["cgx/bytes_per_step"] > 0 for h in logged)
    per_step = run["wire_bytes"] / 10
    assert logged[-1]["cgx/bytes_per_step"] == pytest.approx(per_step, rel=0.01)
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.3


# -- (c) resume_from_checkpoint continues exactly --------------------------------------------

@pytest.mark.multiproc
def test_trainer_resume_from_checkpoint_ends_where_the_uninterrupted_run_does(tmp_path):
    """Error feedback: residuals that only cgx's checkpoint files carry (the plain
    Trainer's own exact resume is checked in the first test)."""
    common = ("--compression", "q4ef", *SHORT)
    full = trainer_run(tmp_path, "full", *common)
    checkpoint = tmp_path / "full" / "checkpoint-3"
    cgx_files = sorted(p.name for p in checkpoint.glob("cgx-rank*.pt"))
    assert cgx_files == ["cgx-rank0.pt", "cgx-rank1.pt"]
    # resumed into another output_dir: the files are found beside the resumed checkpoint
    resumed = trainer_run(tmp_path, "resumed", *common, "--resume", checkpoint)
    assert max_diff(full["params"], resumed["params"]) <= 1e-6
    # The same resume without cgx's files: residuals restart at zero, and it shows
    for f in cgx_files:
        (checkpoint / f).unlink()
    out = torchrun(TRAINER, "--output-dir", tmp_path / "lost", "--out", tmp_path / "lost.pt",
                   *common, "--resume", checkpoint, cwd=tmp_path)
    assert "residuals start from zero" in out
    lost = torch.load(tmp_path / "lost.pt", weights_only=False)
    assert max_diff(full["params"], lost["params"]) > 1e-4


# -- (d) Accelerate ----------------------------------------------------------------------------

def accelerate_result(out: Path) -> list:
    return [torch.load(f"{out}.rank{r}", weights_only=False) for r in (0, 1)]


@pytest.mark.multiproc
def test_accelerate_exact_equals_plain_accelerate(tmp_path):
    accelerate_launch(ACCELERATE, "--compression", "off", "--max-steps", "6", "--out",
                      tmp_path / "plain", cwd=tmp_path)
    out = accelerate_launch(ACCELERATE, "--compression", "exact", "--max-steps", "6",
                            "--out", tmp_path / "exact", cwd=tmp_path)
    plain, exact = accelerate_result(tmp_path / "plain"), accelerate_result(tmp_path / "exact")
    assert "cgx/bytes_per_step" in out and exact[0]["figures"]["cgx/bytes_per_step"] > 0
    for r in (0, 1):
        assert max_diff(plain[r]["params"], exact[r]["params"]) <= 1e-6
        # the example passes DistributedDataParallelKwargs(gradient_as_bucket_view=True)
        # with cgx, as docs/huggingface.md says to; plain Accelerate keeps DDP's default
        assert exact[r]["bucket_view"] is True and plain[r]["bucket_view"] is False


@pytest.mark.multiproc
def test_accelerate_save_state_load_state_restores_each_rank_and_continues_exactly(tmp_path):
    # Accelerate's default find_unused_parameters=False: DDP rebuilds its buckets after the
    # first step of each run, in another order; the hook reduces in model order
    common = ("--cpu", "--compression", "q4ef", "--max-steps", "6")
    torchrun(ACCELERATE, *common, "--save-at", "3", "--save-dir", tmp_path / "state",
             "--out", tmp_path / "full", cwd=tmp_path)
    torchrun(ACCELERATE, *common, "--resume", tmp_path / "state", "--out",
             tmp_path / "resumed", cwd=tmp_path)
    full, resumed = accelerate_result(tmp_path / "full"), accelerate_result(tmp_path / "resumed")
    res = [{k: v for k, v in run["cgx_saved"]["plan"]["residuals"].items()} for run in full]
    assert res[0] and max_diff(res[0], res[1]) > 0  # residuals are per rank
    for r in (0, 1):
        back = resumed[r]["cgx_restored"]
        assert back["iteration"] == full[r]["cgx_saved"]["iteration"] == 3
        assert max_diff(back["plan"]["residuals"], res[r]) == 0.0  # its own, not rank 0's
        assert max_diff(full[r]["params"], resumed[r]["params"]) <= 1e-6


# -- (e) unsupported set-ups: clear errors before the first step ----------------------------

ERRORS_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from accelerate import Accelerator, DistributedType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    sys.path.insert(0, "examples")
    from accelerate_ddp import TrainConfig, tiny_gpt2
    import cgx.integrations.huggingface as cgx_hf

    acc = Accelerator(cpu=True)
    cfg = TrainConfig()
    errors = {}

    def expect(label, exc, fn):
        try:
            fn()
        except exc as e:
            errors[label] = str(e)
        else:
            errors[label] = None

    expect("unprepared", RuntimeError, lambda: cgx_hf.prepare(acc, tiny_gpt2(cfg)))
    sharded = tiny_gpt2(cfg)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (acc.num_processes,)))
    expect("fsdp2", RuntimeError, lambda: cgx_hf.prepare(acc, sharded))
    expect("fsdp1", RuntimeError, lambda: cgx_hf.prepare(acc, FSDP1(tiny_gpt2(cfg),
                                                                   device_id="cpu")))
    expect("not_accelerator", TypeError, lambda: cgx_hf.prepare(object(), tiny_gpt2(cfg)))
    # DeepSpeed is not installed here: the Accelerator's state says so instead
    acc.state.distributed_type = DistributedType.DEEPSPEED
    expect("deepspeed", RuntimeError, lambda: cgx_hf.prepare(acc, tiny_gpt2(cfg)))
    acc.state.distributed_type = DistributedType.FSDP
    expect("fsdp_plugin", RuntimeError, lambda: cgx_hf.prepare(acc, tiny_gpt2(cfg)))
    with open(sys.argv[1] + f".rank{acc.process_index}", "w") as f:
        json.dump(errors, f)
""")


@pytest.mark.multiproc
def test_accelerate_unsupported_set_ups_raise_clear_errors(tmp_path):
    script = tmp_path / "errors.py"
    script.write_text(ERRORS_SCRIPT)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    torchrun(script, tmp_path / "errors", cwd=tmp_path)  # Accelerator(cpu=True) in it
    for r in (0, 1):
        errors = json.loads((tmp_path / f"errors.rank{r}").read_text())
        assert "call model = accelerator.prepare(model) first" in errors["unprepared"]
        assert "FSDP2" in errors["fsdp2"] and "not supported" in errors["fsdp2"]
        assert "FSDP1" in errors["fsdp1"]
        assert "accelerate.Accelerator" in errors["not_accelerator"]
        assert "DeepSpeed" in errors["deepspeed"]
        assert "FSDP" in errors["fsdp_plugin"] and "without the FSDP plugin" in \
            errors["fsdp_plugin"]


def _tiny_trainer(tmp_path, callbacks=()):
    from transformers import Trainer, TrainingArguments
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from huggingface_trainer import Blocks, TrainConfig, corpus_blocks, tiny_gpt2
    finally:
        sys.path.remove(str(ROOT / "examples"))
    cfg = TrainConfig()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2,
                             per_device_train_batch_size=2, save_strategy="no",
                             report_to="none", use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, logging_steps=1)
    return Trainer(model=tiny_gpt2(cfg), args=args, callbacks=list(callbacks),
                   train_dataset=Blocks(corpus_blocks(cfg.block, 8)))


def test_trainer_on_one_process_trains_without_cgx_and_says_so_once(tmp_path, caplog,
                                                                     monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import cgx.integrations.huggingface as cgx_hf
    trainer = _tiny_trainer(tmp_path)
    callback = cgx_hf.compress(trainer, compression="auto")
    with caplog.at_level(logging.WARNING, logger="cgx.integrations.huggingface"):
        trainer.train()
        trainer.train()  # a second train() does not repeat it
    said = [r for r in caplog.records if "one process" in r.getMessage()]
    assert len(said) == 1 and "cgx is off" in said[0].getMessage()
    assert callback.state is None and trainer.state.global_step == 2
    assert trainer.callback_handler.callbacks[0] is callback  # before the loggers


def test_bucket_views_are_asked_for_unless_turned_off(tmp_path, monkeypatch):
    """The DDP arguments the Trainer's Accelerator will build its DDP with (the multi-process
    tests check the DDP module itself)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import cgx.integrations.huggingface as cgx_hf

    def asked(trainer) -> bool:
        return trainer.accelerator.ddp_handler.to_kwargs().get("gradient_as_bucket_view", False)

    assert not asked(_tiny_trainer(tmp_path))  # the Trainer's own default
    trainer = _tiny_trainer(tmp_path)
    cgx_hf.compress(trainer)
    assert asked(trainer)
    trainer = _tiny_trainer(tmp_path)
    cgx_hf.compress(trainer, gradient_as_bucket_view=False)
    assert not asked(trainer)
    # a callback given at construction asks when the construction ends
    assert asked(_tiny_trainer(tmp_path, [cgx_hf.CGXTrainerCallback()]))
    assert not asked(_tiny_trainer(
        tmp_path, [cgx_hf.CGXTrainerCallback(gradient_as_bucket_view=False)]))


def test_trainer_unsupported_set_ups_raise_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import cgx.integrations.huggingface as cgx_hf
    from transformers import TrainerCallback, TrainerControl, TrainerState
    with pytest.raises(TypeError, match="takes a transformers.Trainer"):
        cgx_hf.compress(object())
    trainer = _tiny_trainer(tmp_path)
    # Neither DeepSpeed nor a GPU for FSDP is here: the Trainer's own flags say so instead
    trainer.is_deepspeed_enabled = True
    with pytest.raises(RuntimeError, match="DeepSpeed.*drop the `deepspeed`"):
        cgx_hf.compress(trainer)
    trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled = False, True
    with pytest.raises(RuntimeError, match="FSDP.*drop the `fsdp`"):
        cgx_hf.compress(trainer)
    # A callback called from no Trainer cannot find the DDP model: it says what to use
    callback = cgx_hf.CGXTrainerCallback()
    assert isinstance(callback, TrainerCallback)
    with pytest.raises(RuntimeError, match=r"compress\(trainer"):
        callback.on_train_begin(trainer.args, TrainerState(), TrainerControl())


def test_a_model_not_wrapped_in_ddp_is_refused_by_name():
    from cgx.integrations.huggingface import _check_wrapped
    with pytest.raises(RuntimeError, match="DistributedDataParallel, got Linear"):
        _check_wrapped(torch.nn.Linear(2, 2), "here")
