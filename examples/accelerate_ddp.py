"""cgx inside Hugging Face Accelerate: one line after ``accelerator.prepare``.

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py --compression q4
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --compression q4 --cpu

A tiny randomly initialised GPT-2 learns characters of Python's own standard library
source (no download). ``--compression off`` trains plain Accelerate DDP, for comparison;
``--save-at N --save-dir D`` calls ``accelerator.save_state(D)`` after step N, and
``--resume D`` loads it and continues from there.
"""

import argparse
import os

import torch

# The model, data and compression names are the Trainer example's (the same tiny GPT-2 on
# the standard library's source), so the two runs compare.
from huggingface_trainer import COMPRESSIONS, TrainConfig, compression_of, corpus_blocks, \
    tiny_gpt2


class Progress:
    """The step reached, saved with ``accelerator.save_state`` like any custom object."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compression", choices=COMPRESSIONS, default="q4")
    p.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    p.add_argument("--cpu", action="store_true", help="Accelerator(cpu=True)")
    p.add_argument("--find-unused", action="store_true",
                   help="DDP's find_unused_parameters=True (as the Trainer sets for GPT-2)")
    p.add_argument("--save-at", type=int, default=0, help="save_state after this step")
    p.add_argument("--save-dir", default="runs/accelerate")
    p.add_argument("--resume", default=None, help="load_state from this folder first")
    p.add_argument("--out", default=None, help="write final parameters and figures here")
    a = p.parse_args()
    cfg = TrainConfig(max_steps=a.max_steps)

    from accelerate import Accelerator, DistributedDataParallelKwargs

    import cgx.integrations.huggingface as cgx_hf

    # With cgx's hook, DDP's gradients as views of its buckets: DDP then copies no bucket
    # back into the gradients after the hook (docs/huggingface.md).
    ddp_kwargs = DistributedDataParallelKwargs(find_unused_parameters=a.find_unused,
                                               gradient_as_bucket_view=a.compression != "off")
    accelerator = Accelerator(cpu=a.cpu, kwargs_handlers=[ddp_kwargs])
    rank, world = accelerator.process_index, accelerator.num_processes
    data = corpus_blocks(cfg.block, 256)
    model = tiny_gpt2(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    model, opt = accelerator.prepare(model, opt)
    cgx_state = None
    if a.compression != "off":
        cgx_state = cgx_hf.prepare(accelerator, model, compression_of(a.compression))  # the line
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if a.resume:
        accelerator.load_state(a.resume)
    restored = cgx_state.state.state_dict() if a.resume and cgx_state is not None else None

    losses, figures, saved = [], {}, None
    while progress.step < cfg.max_steps:
        # batch (step, rank): the same data whatever the launch, resumed or not
        first = (progress.step * world + rank) * cfg.batch_size % (len(data) - cfg.batch_size)
        batch = data[first:first + cfg.batch_size].to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        progress.step += 1
        losses.append(float(loss.detach()))
        if progress.step == a.save_at:
            accelerator.save_state(a.save_dir)
            saved = cgx_state.state.state_dict() if cgx_state is not None else None
    if cgx_state is not None:
        figures = cgx_hf.log_figures(cgx_state, steps=len(losses))
    if rank == 0:
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; {figures or 'no cgx'}", flush=True)
    if a.out:
        params = {k: v.detach().cpu().clone() for k, v in
                  accelerator.unwrap_model(model).named_parameters()}
        torch.save({"params": params, "losses": losses, "figures": figures, "world": world,
                    "cgx_saved": saved, "cgx_restored": restored,
                    "bucket_view": getattr(model, "gradient_as_bucket_view", None)},
                   f"{a.out}.rank{rank}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the hub
    main()
