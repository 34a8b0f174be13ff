"""Our NF4 and INT8 formats against the libraries people use for them, in one process, on the
same tensors: bitsandbytes' quantize_4bit / dequantize_4bit (nf4, blocks of 64) and torchao's
to_nf4 / get_original_weight for NF4, torch.quantize_per_channel for INT8 (per row), with a copy
of the bf16 weights as the ceiling. Each operation is timed interleaved with its peers (median
of --repeats samples after one untimed call, a sample timing calls in a row for at least 50 ms), on 1 and 2 threads: torch.set_num_threads for every side,
ours with threads=0, which runs the kernels on torch's own intra-op team. Throughput is the bf16
weights' bytes (2 per element) per second, for every side, so that the ratios compare like with
like. A dequantize writes into a tensor allocated once where the API takes one (ours;
bitsandbytes' out= has no CPU kernel), as a streaming step writes into its slot; the ceiling is a
copy of the bf16 weights into such a tensor.

    .venv/bin/python bench/peers/formats.py --out bench/results/peers/formats.json
"""

import argparse
import os
import sys

import torch

import selective_precision as sp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from peer_report import PeerRows, write_report  # noqa: E402
from timing import median_seconds  # noqa: E402

COMMAND = "bash bench/run_peers.sh OUT_DIR (bench/peers/formats.py)"
SHAPES = [(4096, 4096), (1024, 4096)]
# The goals issue 32 sets: >= 2x each peer on quantize and dequantize, >= 0.5x a copy on dequantize.
GOAL_PEER, GOAL_COPY = 2.0, 0.5
# Each sample times calls in a row for at least this long: a 1024 x 4096 dequantize takes half a
# millisecond, and timed one call at a time its row swung from 1.2x to 2.7x between runs.
SAMPLE_SECONDS = 0.05


def peers():
    """The peers that import here, by name: what quantizes and what dequantizes."""
    found = {}
    try:
        import bitsandbytes.functional as bnb

        found["bitsandbytes"] = (
            lambda x: bnb.quantize_4bit(x, blocksize=64, quant_type="nf4"),
            lambda q, out: bnb.dequantize_4bit(q[0], q[1]),  # its out= has no CPU kernel (0.50.2)
        )
    except ImportError as error:
        print("bitsandbytes: not measured (%s)" % error, file=sys.stderr)
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        found["torchao"] = (lambda x: to_nf4(x, block_size=64, scaler_block_size=256),
                            lambda q, out: q.get_original_weight())  # it takes no output tensor
    except ImportError as error:
        print("torchao: not measured (%s)" % error, file=sys.stderr)
    return found


def int8_per_channel(x):
    scales = x.float().abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.quantize_per_channel(x.float(), scales, torch.zeros_like(scales, dtype=torch.int64), 0, torch.qint8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    nf4_peers = peers()
    rows = PeerRows(COMMAND, "GB/s")

    def row(name, peer, ours_s, theirs_s, nbytes, threads, goal):
        rows.add(name, peer, nbytes / ours_s / 1e9, nbytes / theirs_s / 1e9, threads, goal)

    def timed(body):
        return median_seconds(args.repeats, body, SAMPLE_SECONDS)

    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows_n, cols in SHAPES:
            torch.manual_seed(0)
            x = torch.randn(rows_n, cols).to(torch.bfloat16)
            nbytes = x.numel() * 2
            shape = "%dx%d" % (rows_n, cols)
            out = torch.empty_like(x)
            copy = timed(lambda: out.copy_(x))
            ours_q = timed(lambda: sp.quantize_nf4(x, 64, threads=0))
            codes, scales = sp.quantize_nf4(x, 64, threads=0)
            ours_dq = timed(lambda: sp.dequantize_nf4(codes, scales, 64, threads=0, out=out))
            row("nf4 dequantize %s" % shape, "copy of the bf16 weights", ours_dq, copy, nbytes, threads, GOAL_COPY)
            for peer, (quantize, dequantize) in nf4_peers.items():
                row("nf4 quantize %s" % shape, peer, ours_q, timed(lambda: quantize(x)),
                    nbytes, threads, GOAL_PEER)
                image = quantize(x)
                row("nf4 dequantize %s" % shape, peer, ours_dq,
                    timed(lambda: dequantize(image, out)), nbytes, threads, GOAL_PEER)
            ours_q8 = timed(lambda: sp.quantize_int8(x, 0, threads=0))
            q8, s8 = sp.quantize_int8(x, 0, threads=0)
            ours_dq8 = timed(lambda: sp.dequantize_int8(q8, s8, 0, threads=0, out=out))
            row("int8 quantize %s, per row" % shape, "torch.quantize_per_channel", ours_q8,
                timed(lambda: int8_per_channel(x)), nbytes, threads, GOAL_PEER)
            quantized = int8_per_channel(x)
            row("int8 dequantize %s, per row" % shape, "torch.quantize_per_channel", ours_dq8,
                timed(lambda: quantized.dequantize().to(torch.bfloat16)), nbytes, threads,
                GOAL_PEER)
            row("int8 dequantize %s, per row" % shape, "copy of the bf16 weights", ours_dq8, copy, nbytes, threads,
                GOAL_COPY)

    write_report(args.out, "peers-formats", args.repeats, rows, ("bitsandbytes", "torchao"))

if __name__ == "__main__":
    main()
