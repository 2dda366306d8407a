"""Trains the small character-level GPT of gpt.py on examples/data/ with flowtrain, data parallel
over the launched ranks; what `make demo` runs.

    flowtrain launch --nproc-per-node 2 examples/train_gpt.py --steps 500
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

import flowtrain

sys.path.insert(0, str(Path(__file__).parent))  # gpt.py sits beside this script
from gpt import GPT, GPTConfig  # noqa: E402

HERE = Path(__file__).parent


class CharDataset(Dataset):
    """Every window of ``seq_len`` characters of the text as (input, target), the target being
    the input shifted one character to the left."""

    def __init__(self, text: str, seq_len: int) -> None:
        self.chars = sorted(set(text))
        self.index_of = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index_of[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.data) - self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i:i + self.seq_len + 1]
        return window[:-1], window[1:]

    def encode(self, text: str) -> list[int]:
        return [self.index_of[c] for c in text if c in self.index_of]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps to train for")
    parser.add_argument("--config", default=str(HERE / "ds_config_gpt.json"),
                        help="DeepSpeed-style JSON config (batch sizes, optimizer, scheduler)")
    parser.add_argument("--data", default=str(HERE / "data" / "input.txt"),
                        help="text file to train on")
    parser.add_argument("--seq-len", type=int, default=64, help="characters per training window")
    parser.add_argument("--n-layer", type=int, default=3, help="transformer blocks")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    parser.add_argument("--n-embd", type=int, default=128, help="embedding width")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each block's activations in backward")
    parser.add_argument("--print-every", type=int, default=25,
                        help="print step, loss, lr and tokens/s every this many steps (rank 0)")
    parser.add_argument("--prompt", default="We hold these truths",
                        help="text the model continues at the end")
    parser.add_argument("--sample-chars", type=int, default=120,
                        help="characters to generate from the prompt at the end")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="save a checkpoint here at the end (optional)")
    parser.add_argument("--seed", type=int, default=1337, help="seed for the model's weights")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    rank = int(os.environ.get("RANK", 0))

    def print0(*parts: object) -> None:
        if rank == 0:
            print(*parts, flush=True)

    dataset = CharDataset(Path(args.data).read_text(encoding="utf-8"), args.seq_len)
    model = GPT(GPTConfig(vocab_size=len(dataset.chars), block_size=args.seq_len,
                          n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                          gradient_checkpointing=args.gradient_checkpointing))
    config = json.loads(Path(args.config).read_text())
    # The cosine schedule should end where training ends, whatever --steps is.
    if config.get("scheduler", {}).get("type") == "WarmupCosineLR":
        config["scheduler"]["params"]["total_num_steps"] = args.steps
    engine, _, loader, _ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset, config=config)
    tokens_per_step = engine.train_batch_size() * args.seq_len
    print0(f"{model.num_parameters():,} parameters, {len(dataset.data):,} characters, "
           f"vocabulary {len(dataset.chars)}, {engine.world_size} ranks, "
           f"{tokens_per_step:,} tokens per step")

    losses: list[float] = []  # this rank's mean loss at each optimizer step
    step_losses: list[float] = []  # micro-batch losses of the step in progress
    started = last_print_time = time.perf_counter()
    last_print_step = 0
    while engine.global_steps < args.steps:  # each pass over the loader is one epoch
        for inputs, targets in loader:
            _, loss = engine(inputs, targets)
            engine.backward(loss)
            step_losses.append(loss.item())
            at_boundary = engine.is_gradient_accumulation_boundary()
            engine.step()  # the optimizer only steps at the accumulation boundary
            if not at_boundary:
                continue
            losses.append(sum(step_losses) / len(step_losses))
            step_losses.clear()
            step = engine.global_steps
            if step % args.print_every == 0 or step == 1 or step == args.steps:
                now = time.perf_counter()
                tokens_per_s = (step - last_print_step) * tokens_per_step / (now - last_print_time)
                print0(f"step {step:5d} | loss {losses[-1]:.4f} | lr {engine.get_lr()[0]:.2e} | "
                       f"{tokens_per_s:,.0f} tokens/s")
                last_print_step, last_print_time = step, now
            if step >= args.steps:
                break

    print0(f"trained {args.steps} steps in {time.perf_counter() - started:.1f} s; "
           f"first loss {losses[0]:.4f} -> last loss {losses[-1]:.4f}")
    if args.checkpoint_dir:
        path = engine.save_checkpoint(args.checkpoint_dir)  # every rank takes part
        print0(f"checkpoint saved to {path}")
    if rank == 0:
        model.eval()
        prompt = torch.tensor([dataset.encode(args.prompt)], dtype=torch.long)
        sample = model.generate(prompt, args.sample_chars)[0].tolist()
        print(f"greedy sample: {dataset.decode(sample)!r}", flush=True)


if __name__ == "__main__":
    main()
