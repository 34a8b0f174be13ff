#!/usr/bin/env python3
"""A Hugging Face LlamaForCausalLM whose decoder layers stream through Selective Precision, trained
with the plain PyTorch loop: the model's own `for layer in self.layers` calls each streamed layer,
whose fp32 masters are the layer's own parameters on the host; the policy plugin picks per layer
the format its weights cross in (BF16, INT8 or NF4).

    .venv/bin/python examples/python/hf_llama.py --steps 20

(with the package installed by scripts/install-package.sh; from a build tree alone:
PYTHONPATH=build/python .venv/bin/python ...). On two processes, each training on half of every
batch (data parallelism over Gloo):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/python/hf_llama.py

`--gradient-checkpointing` turns on Hugging Face's own checkpointing of the layers, and
`--contrastive` runs a siamese loop: two forwards (a window and the same window one byte on), then
one backward of their language-model losses and an InfoNCE between their pooled states.

The model is a small LlamaConfig with random weights (nothing is downloaded) and the text is the
example's own source, as bytes. The lines that concern Selective Precision are marked `# [sp]`.
"""

import argparse
import os

import torch
import torch.distributed as dist
import transformers

import selective_precision as sp  # [sp]


def batches(text, batch, seq, rank, world, generator):
    """Random windows of the bytes; each rank takes its own rows of every global batch."""
    data = torch.tensor(list(text), dtype=torch.long)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=generator)
        rows = torch.stack([data[s : s + seq] for s in starts])
        yield rows[rank::world]


def contrastive_loss(model, ids):
    """Two views of each row through the model, before one backward: their language-model losses,
    and an InfoNCE that pairs each row's pooled final state with its own other view."""
    views = [model(input_ids=v, labels=v, output_hidden_states=True) for v in (ids[:, :-1], ids[:, 1:])]
    a, b = (torch.nn.functional.normalize(v.hidden_states[-1].float().mean(1), dim=-1) for v in views)
    nce = torch.nn.functional.cross_entropy(a @ b.T / 0.1, torch.arange(len(a)))
    return (views[0].loss + views[1].loss) / 2 + 0.1 * nce


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--policy", default="dynamic_v2.yaml", help="a file of the package's configs/policy/")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="the model's own checkpointing")
    parser.add_argument("--contrastive", action="store_true", help="two forwards, then one backward")
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0

    torch.manual_seed(0)  # every rank starts from the same weights
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      attention_dropout=0.1, use_cache=False)
    model = transformers.LlamaForCausalLM(config).train()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    policy = os.path.join(sp.config_dir(), "policy", args.policy)  # [sp]
    model.model.layers = sp.stream(model.model.layers, config=policy,  # [sp]
                                   process_group=dist.group.WORLD if world > 1 else None)  # [sp]
    layers = model.model.layers  # [sp]

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))
    with open(__file__, "rb") as f:
        data = batches(f.read(), args.batch // args.accumulate, args.seq, rank, world, torch.Generator().manual_seed(1))

    moved = all_bf16 = 0
    for step in range(args.steps):
        total = 0.0
        for _ in range(args.accumulate):
            ids = next(data)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (contrastive_loss(model, ids) if args.contrastive else model(input_ids=ids, labels=ids).loss)
                loss = loss / args.accumulate
            loss.backward()
            total += loss.item()
        outside = [p for n, p in model.named_parameters() if not n.startswith("model.layers.")]
        layers.average_gradients(outside)  # [sp] embeddings and head, before the norm (a no-op alone)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        layers.report_loss(total)  # [sp] for the policy's loss guard
        optimizer.step()  # the layer's step ends here: moments to the policy, images rebuilt
        scheduler.step()
        optimizer.zero_grad()
        report = layers.last_report  # [sp]
        moved, all_bf16 = moved + report.h2d_bytes, all_bf16 + report.h2d_bytes_all_bf16
        if rank == 0:
            print("step %3d  loss %.4f  routes %s" % (step, total, " ".join(report.routes)), flush=True)
    if rank == 0:
        print("moved %.1f MB of %.1f MB as BF16 everywhere: %.1f%% saved (rank %d of %d)"
              % (moved / 1e6, all_bf16 / 1e6, 100.0 * (1 - moved / all_bf16), rank, world))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
