"""cgx inside Hugging Face's Trainer: one line after building the Trainer.

    torchrun --nproc-per-node 2 examples/huggingface_trainer.py --compression q4
    torchrun --nproc-per-node 2 examples/huggingface_trainer.py --compression q4ef \\
        --max-steps 8 --save-steps 4 --resume runs/hf/checkpoint-4

A tiny randomly initialised GPT-2 learns characters of Python's own standard library
source (no download). ``--compression off`` trains without cgx, for comparison; the
Trainer's DDP settings stay its defaults (find_unused_parameters=True for a GPT-2).
"""

import argparse
import dataclasses
import json
import os

import torch

COMPRESSIONS = ("off", "exact", "q4", "q4ef", "env")


@dataclasses.dataclass
class TrainConfig:
    max_steps: int = 30
    batch_size: int = 4  # per rank
    block: int = 32  # characters per sequence
    lr: float = 3e-3
    layers: int = 2
    n_embd: int = 64
    vocab: int = 128  # ASCII
    seed: int = 0
    logging_steps: int = 1
    save_steps: int = 0  # 0: no checkpoints
    output_dir: str = "runs/hf"


def compression_of(name: str):
    """``--compression`` as cgx's compression (None: the CGX_* variables)."""
    from cgx.torch import Compression
    return {"exact": Compression.exact, "q4": Compression.quantize(bits=4),
            "q4ef": Compression.quantize(bits=4, error_feedback=True), "env": None}[name]


def corpus_blocks(block: int, n: int) -> torch.Tensor:
    """``n`` sequences of ``block`` + 1 ASCII codes from the standard library's source."""
    with open(argparse.__file__, encoding="utf-8") as f:  # ~100 kB of Python
        text = f.read()
    codes = torch.tensor([min(ord(c), 127) for c in text], dtype=torch.long)
    starts = torch.arange(n) * block
    return torch.stack([codes[s:s + block] for s in starts])


class Blocks(torch.utils.data.Dataset):
    def __init__(self, data: torch.Tensor):
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def tiny_gpt2(cfg: TrainConfig):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(cfg.seed)
    config = GPT2Config(vocab_size=cfg.vocab, n_positions=64, n_embd=cfg.n_embd,
                        n_layer=cfg.layers, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", choices=COMPRESSIONS, default="q4")
    p.add_argument("--attach", choices=("compress", "callback"), default="compress",
                   help="compress(trainer) or Trainer(callbacks=[CGXTrainerCallback(...)])")
    p.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    p.add_argument("--seed", type=int, default=TrainConfig.seed)
    p.add_argument("--save-steps", type=int, default=TrainConfig.save_steps)
    p.add_argument("--output-dir", default=TrainConfig.output_dir)
    p.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    p.add_argument("--out", default=None, help="write final parameters and logs here")
    a = p.parse_args()
    cfg = TrainConfig(max_steps=a.max_steps, save_steps=a.save_steps, output_dir=a.output_dir,
                      seed=a.seed)

    from transformers import Trainer, TrainingArguments

    import cgx.integrations.huggingface as cgx_hf

    data = Blocks(corpus_blocks(cfg.block, 256))
    args = TrainingArguments(
        output_dir=cfg.output_dir, max_steps=cfg.max_steps, learning_rate=cfg.lr,
        per_device_train_batch_size=cfg.batch_size, logging_steps=cfg.logging_steps,
        save_strategy="steps" if cfg.save_steps else "no", save_steps=cfg.save_steps or 500,
        seed=cfg.seed, report_to="none", use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True)
    callbacks = []
    if a.compression != "off" and a.attach == "callback":
        callbacks = [cgx_hf.CGXTrainerCallback(compression_of(a.compression))]
    trainer = Trainer(model=tiny_gpt2(cfg), args=args, train_dataset=data, callbacks=callbacks)
    cgx_cb = callbacks[0] if callbacks else None
    if a.compression != "off" and a.attach == "compress":
        cgx_cb = cgx_hf.compress(trainer, compression=compression_of(a.compression))  # the line
    trainer.train(resume_from_checkpoint=a.resume)

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    stats = cgx_cb.state.stats() if cgx_cb is not None and cgx_cb.state is not None else None
    if args.process_index == 0:
        ratio = stats.ratio if stats else None
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; cgx ratio "
              f"{'-' if ratio is None else f'{ratio:.2f}x'}", flush=True)
        if a.out:
            torch.save({"params": {k: v.detach().clone() for k, v in
                                   trainer.model.named_parameters()},
                        "log_history": json.loads(json.dumps(trainer.state.log_history)),
                        "ratio": ratio, "wire_bytes": stats.wire_bytes if stats else None,
                        "find_unused": getattr(trainer.model_wrapped, "find_unused_parameters",
                                               None),
                        "bucket_view": getattr(trainer.model_wrapped,
                                               "gradient_as_bucket_view", None),
                        "hooked": cgx_cb is not None and cgx_cb.state is not None,
                        "world": args.world_size}, a.out)
    if a.out:  # every rank's parameters, to see that the ranks agree
        torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()},
                   f"{a.out}.rank{args.process_index}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
    main()
