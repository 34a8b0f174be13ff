#!/usr/bin/env python3
"""A GPT-2-style byte-level model, written in plain PyTorch, whose transformer blocks stream
through Selective Precision: the blocks' matrices live on the host as fp32 masters and cross to
the compute device in the precision the policy plugin picks per block (BF16, INT8 or NF4).

    .venv/bin/python examples/python/train_tiny.py --steps 40

(with the package installed into the project's .venv by scripts/install-package.sh; from a build
tree alone: PYTHONPATH=build/python .venv/bin/python ...). On two processes, each training on
half of every batch (data parallelism over Gloo):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/python/train_tiny.py

Prints each step's loss and routes, and the bytes the policy saved against BF16 everywhere.
The lines that concern Selective Precision are marked `# [sp]`.
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import selective_precision as sp  # [sp]


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        mixed = (scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(mixed)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGpt(torch.nn.Module):
    def __init__(self, d=64, heads=4, blocks=4, context=64):
        super().__init__()
        self.wte = torch.nn.Embedding(256, d)
        self.wpe = torch.nn.Embedding(context, d)
        self.blocks = torch.nn.ModuleList(Block(d, heads) for _ in range(blocks))
        self.ln_f = torch.nn.LayerNorm(d)
        self.streamed = None  # [sp] set by main(); not a submodule

    def forward(self, idx):
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        h = self.streamed(h)  # [sp] instead of: for block in self.blocks: h = block(h)
        return self.ln_f(h) @ self.wte.weight.t()


def corpus(path):
    data = bytearray()
    for root, _, files in sorted(os.walk(path)):
        for name in sorted(files):
            with open(os.path.join(root, name), "rb") as f:
                data += f.read()
    return torch.tensor(list(data), dtype=torch.long)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--data", default="/usr/share/common-licenses")
    parser.add_argument("--out", default="train_tiny_run", help="where the plugin writes its telemetry")
    parser.add_argument("--shard-masters", action="store_true",
                        help="under torchrun: each block's fp32 masters and AdamW state on one rank only")
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun
    if world > 1:
        dist.init_process_group("gloo")  # the layer's collectives take CPU tensors
    rank = dist.get_rank() if world > 1 else 0
    out = args.out if world == 1 else os.path.join(args.out, "rank%d" % rank)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)  # the same model and batches on every rank
    data = corpus(args.data)
    model = TinyGpt()
    policy = (  # [sp] the policy plugin's section: decide early, on a short run
        "selective_precision:\n  mode: dynamic\n  warmup_steps: 4\n  update_interval_steps: 4\n"
        "  history_window: 4\n  min_steps_between_switches: 4\n  int8_threshold: 0.5\n  bf16_threshold: 0.7\n"
    )
    model.streamed = sp.StreamedBlocks(model.blocks, config=policy, output_dir=out,  # [sp]
                                       process_group=dist.group.WORLD if world > 1 else None,  # [sp]
                                       shard_masters=args.shard_masters)  # [sp]
    optimizer = torch.optim.AdamW(model.streamed.optimizer_parameters(model), lr=3e-3)  # [sp]
    samples = torch.stack([data[i : i + 64] for i in range(0, 64 * 4, 64)])
    model.streamed.calibrate([model.wte(samples) + model.wpe(torch.arange(64))])  # [sp]

    moved = all_bf16 = 0
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - 65, (16,))
        batch = torch.stack([data[s : s + 65] for s in starts]).chunk(world)[rank]  # this rank's rows
        with model.streamed.step(step, optimizer) as s:  # [sp]
            logits = model(batch[:, :-1])
            s.loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
            s.loss.backward()
        r = s.report  # [sp]
        moved += r.h2d_bytes
        all_bf16 += r.h2d_bytes_all_bf16
        if rank == 0:  # s.loss_mean: the mean across ranks
            print("step %3d  loss %.4f  routes %s" % (step, s.loss_mean, " ".join(model.streamed.routes())))
    if rank == 0:
        print("moved %.1f MB of %.1f MB as BF16 everywhere: %.1f%% saved%s"
              % (moved / 1e6, all_bf16 / 1e6, 100.0 * (all_bf16 - moved) / all_bf16,
                 "" if world == 1 else " (rank 0 of %d)" % world))
    model.streamed.close()  # [sp]


if __name__ == "__main__":
    main()
