"""What a training pass holds for its backward (issue 41, section 2): the host memory a forward
leaves allocated, side by side, for streaming.py's model and sides (resident, the block swap
with and without recompute, sp.stream keeping its activations and with recompute=True).

Each side runs two untimed steps (warm-up; the forced routes hold from the first), then one forward
under torch.profiler(profile_memory=True): the sum of every operator's self memory over that
region is the bytes allocated in it and still alive at its end, whatever keeps them (autograd's
saved tensors, a checkpoint's inputs, the logits and loss). Weight copies a side makes for its
compute count too: the block swap without recompute keeps one per block; sp.stream's delivered
weights live in the engine's slots, allocated once, and are released after each block. The
backward and the optimizer step then run outside the profiled region.

Deterministic on a given build (no timing): one measurement per side and thread count.

    PYTHONPATH=build/python HF_HUB_OFFLINE=1 .venv/bin/python bench/peers/activation_memory.py \
        --out bench/results/peers/activation-memory.json [--compute fp32]
"""

import argparse
import os
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import streaming  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from peer_report import write_report  # noqa: E402

MIB = 2 ** 20


def forward_bytes(side, ids):
    """The bytes one forward of `side` allocates and leaves alive until its backward."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=streaming.BF16, enabled=side.autocast):
            loss = side.model(input_ids=ids, labels=ids).loss
    held = sum(e.self_cpu_memory_usage for e in prof.key_averages())
    loss.backward()
    side.optimizer.step()
    side.optimizer.zero_grad(set_to_none=True)
    return held


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compute", choices=("bf16", "fp32"), default="bf16",
                        help="what every side computes in (fp32: for CPUs without native bf16 matmuls)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = streaming.transformers.LlamaConfig(**streaming.MODEL)
    state = streaming.transformers.LlamaForCausalLM(config).state_dict()
    ids = torch.randint(0, streaming.MODEL["vocab_size"], (streaming.BATCH, streaming.SEQ),
                        generator=torch.Generator().manual_seed(1))
    sides = streaming.make_sides(state, tempfile.mkdtemp(prefix="sp-activation-memory-"), args.compute)
    resident = streaming.RESIDENT[args.compute]
    held = {}
    for side in sides.values():
        side.step(ids, record=False)
        side.step(ids, record=False)
        held[side.label] = round(forward_bytes(side, ids) / MIB, 2)
        print("%-36s %9.2f MiB" % (side.label, held[side.label]), flush=True)
    command = " ".join(["PYTHONPATH=build/python .venv/bin/python bench/peers/activation_memory.py"] + sys.argv[1:])
    # Rows in the peers' schema, for information: ours_over_peer > 1 when ours holds less.
    rows = []
    for route in ("bf16", "int8", "nf4"):
        for recompute, peers in ((False, (resident, streaming.SWAP_KEPT)), (True, (streaming.SWAP,))):
            ours = streaming.streamed_label(route, recompute)
            for peer in peers:
                rows.append({"name": ours + " (MiB held after the forward)", "peer": peer, "ours": held[ours],
                             "theirs": held[peer], "unit": "MiB", "ours_over_peer": round(held[peer] / held[ours], 3),
                             "goal": None, "threads": 1, "command": command})
    write_report(args.out, "activation_memory", 1, rows, ["transformers"], held_mib=held, compute=args.compute,
                 model=streaming.MODEL, batch=[streaming.BATCH, streaming.SEQ],
                 measure="bytes a forward allocates and leaves alive for its backward (torch.profiler "
                         "profile_memory: the sum of the operators' self memory over the forward), one thread")


if __name__ == "__main__":
    main()
