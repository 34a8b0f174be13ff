"""The layer's host optimizer against the ones people use for the same pass (issue 32, part 1), in
one process, on the same fp32 masters, gradients and moments: torch.optim.AdamW with
fused=True and with foreach=True, and DeepSpeed's DeepSpeedCPUAdam (ZeRO-Offload's) where its op
builds here. The data is one transformer block of width d (four d x d attention matrices, the
d x 4d and 4d x d MLP ones: 12 d^2 parameters), d = 1024 and 4096, on 1 and 2 threads.

Two comparisons per peer:
- the optimizer alone: ours is sp.adamw_step_ without an image;
- the optimizer and the transfer image of the updated weights, the work a streaming step does
  after each update: ours writes the image in the same sweep (sp.adamw_step_(image=...), into
  an image allocated once, as the layer's pinned slabs are); a
  peer needs a second pass, a bf16 copy (copy_ into tensors allocated once), torch's per-row
  INT8 (quantize_per_channel with its absmax) or bitsandbytes' NF4 (quantize_4bit).
Every side steps the same state: each timed call is one more step of it. Throughput is
parameters per second; median of --repeats after one untimed call, interleaved. Every side runs
on torch's intra-op threads, torch.set_num_threads(threads) of them: ours with threads=0, which
puts the kernels on torch's own team (DeepSpeed's op takes its OpenMP threads from the same
setting).

    .venv/bin/python bench/peers/optimizer.py --out bench/results/peers/optimizer.json
"""

import argparse
import os
import sys

import torch

import selective_precision as sp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from peer_report import PeerRows, write_report  # noqa: E402
from timing import median_seconds  # noqa: E402

COMMAND = "bash bench/run_peers.sh OUT_DIR (bench/peers/optimizer.py)"
# The goal issue 32 sets: >= 1.0x each peer on the optimizer alone.
GOAL_ALONE = 1.0
# Bytes per parameter of an AdamW step on fp32 state (read the weight, gradient and two moments,
# write the weight and moments), and of each image (its codes; the per-row or per-64 scales
# add under 0.1 byte). Ours writes the image in the update's sweep; a peer's second pass reads
# the weights again. Once the image counts, the bytes bound ours at (28 + 4 + image) / (28 +
# image) of a peer, about 1.13x: issue 32's 1.3x could not be met, so the goal is 0.95 of that
# bound (issue 41), written into each row.
ADAMW_BYTES, IMAGE_BYTES = 28.0, {"bf16": 2.0, "int8": 1.0, "nf4": 0.5}


def goal_with_image(image):
    ours, peer = ADAMW_BYTES + IMAGE_BYTES[image], ADAMW_BYTES + 4.0 + IMAGE_BYTES[image]
    basis = "0.95 x the bytes the peer's two passes move (%g B/param) / ours (%g B/param)" % (peer, ours)
    return round(0.95 * peer / ours, 3), basis
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01


def block(d, seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]
    return [torch.randn(*shape, generator=g) * 0.02 for shape in shapes]


class Ours:
    def __init__(self, weights, grads):
        self.params = [w.clone() for w in weights]
        self.grads = grads
        self.m = [torch.zeros_like(w) for w in weights]
        self.v = [torch.zeros_like(w) for w in weights]
        self.t = 0
        self.images = {}  # allocated once per format, as the layer's pinned slabs are

    def step(self, image=None):
        self.t += 1
        written = sp.adamw_step_(self.params, self.grads, self.m, self.v, lr=LR, step=self.t, betas=BETAS, eps=EPS,
                                 weight_decay=WEIGHT_DECAY, image=image, threads=0,
                                 out=self.images.get(image))
        if image is not None:
            self.images[image] = written


class TorchAdamW:
    def __init__(self, weights, grads, **flavour):
        self.params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                           **flavour)

    def step(self):
        self.optimizer.step()


class DeepSpeedAdam(TorchAdamW):
    def __init__(self, weights, grads):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        self.params = [torch.nn.Parameter(w.clone()) for w in weights]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.optimizer = DeepSpeedCPUAdam(self.params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                          adamw_mode=True)


def image_passes(params):
    """The second pass a peer makes after its step, by image: tensors allocated once where the
    API takes them."""
    bf16 = [torch.empty_like(p, dtype=torch.bfloat16) for p in params]

    def to_bf16():
        for p, out in zip(params, bf16):
            out.copy_(p.detach())

    def to_int8():
        for p in params:
            w = p.detach()
            scales = w.abs().amax(dim=1).clamp_min(1e-12) / 127
            torch.quantize_per_channel(w, scales, torch.zeros_like(scales, dtype=torch.int64), 0, torch.qint8)

    passes = {"bf16": ("a bf16 copy", to_bf16), "int8": ("torch.quantize_per_channel", to_int8)}
    try:
        import bitsandbytes.functional as bnb

        def to_nf4():
            for p in params:
                bnb.quantize_4bit(p.detach(), blocksize=64, quant_type="nf4")

        passes["nf4"] = ("bitsandbytes quantize_4bit", to_nf4)
    except ImportError as error:
        print("bitsandbytes: NF4 image not measured (%s)" % error, file=sys.stderr)
    return passes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    rows, unavailable = PeerRows(COMMAND, "M params/s"), {}

    def row(name, peer, ours_s, theirs_s, n, threads, goal):
        rows.add(name, peer, n / ours_s / 1e6, n / theirs_s / 1e6, threads, goal)

    for threads in args.threads:
        torch.set_num_threads(threads)
        for d in args.widths:
            weights = block(d, 1)
            grads = [g * 0.01 for g in block(d, 2)]
            n = sum(w.numel() for w in weights)
            label = "d=%d block (%.1f M params)" % (d, n / 1e6)
            ours = Ours(weights, grads)
            peers = {"torch AdamW fused=True": lambda: TorchAdamW(weights, grads, fused=True),
                     "torch AdamW foreach=True": lambda: TorchAdamW(weights, grads, foreach=True),
                     "DeepSpeedCPUAdam": lambda: DeepSpeedAdam(weights, grads)}
            ours_alone = median_seconds(args.repeats, ours.step)
            ours_with = {image: median_seconds(args.repeats, lambda image=image: ours.step(image))
                         for image in ("bf16", "int8", "nf4")}
            for peer_name, make in peers.items():
                try:
                    peer = make()
                except Exception as error:  # DeepSpeed's op build: say why, once
                    unavailable.setdefault(peer_name, "%s: %s" % (type(error).__name__, error))
                    continue
                row("adamw %s" % label, peer_name, ours_alone, median_seconds(args.repeats, peer.step), n, threads,
                    GOAL_ALONE)
                for image, (how, second_pass) in image_passes(peer.params).items():
                    def peer_with_image(step=peer.step, second_pass=second_pass):
                        step()
                        second_pass()

                    goal, basis = goal_with_image(image)
                    row("adamw + %s image %s" % (image, label), "%s, then %s" % (peer_name, how), ours_with[image],
                        median_seconds(args.repeats, peer_with_image), n, threads, goal)
                    rows[-1]["goal_basis"] = basis
                del peer
    for name, why in unavailable.items():
        print("%s: not measured: %s" % (name, why), file=sys.stderr)
    write_report(args.out, "peers-optimizer", args.repeats, rows, ("deepspeed", "bitsandbytes"),
                 not_measured=unavailable)

if __name__ == "__main__":
    main()
