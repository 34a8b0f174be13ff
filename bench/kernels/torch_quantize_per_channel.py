#!/usr/bin/env python3
"""Per-row INT8 quantization with torch.quantize_per_channel, timed against a tensor copy
measured in the same run, on the shapes sp-bench-kernels-cpu uses.

It gives the peer figure for docs/kernels.md: our vectorized quantize_int8 and torch's kernel,
each as a ratio to the copy bandwidth of its own run (so runs on a shared machine compare).

Two torch timings per shape:
  quantize_per_channel          torch's kernel alone, scales given (torch does less work than
                                ours: it does not find the row maxima);
  absmax + quantize_per_channel the same job as sp::kernels::quantize_int8 (scale = absmax/127,
                                1 for all-zero rows).
Bandwidth counts fp32 read + int8 written + fp32 scales written; copy bandwidth counts read +
written bytes of dst.copy_(src).

Usage: .venv/bin/python bench/kernels/torch_quantize_per_channel.py \
           [--output bench/results/kernels-torch.json] [--threads 1] [--repeats 9]
"""
import argparse
import json
import os
import platform
import sys
import tempfile

try:
    import torch
except ImportError:
    sys.exit("torch_quantize_per_channel.py: needs torch (run it with the project's .venv/bin/python)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from timing import median_seconds  # noqa: E402

SHAPES = [(4096, 4096), (3072, 1024), (4096, 1024), (1024, 4096), (12288, 4096)]



def row_scales(x):
    scales = x.abs().amax(dim=1) / 127.0
    return torch.where(scales == 0, torch.ones_like(scales), scales).to(torch.float64)


def measure(rows, cols, repeats):
    generator = torch.Generator().manual_seed(rows * 31 + cols)
    x = torch.randn(rows, cols, generator=generator) * 0.02
    dst = torch.empty_like(x)
    n = rows * cols
    copy_s = median_seconds(repeats, lambda: dst.copy_(x))
    copy_bw = 2.0 * 4 * n / copy_s
    scales = row_scales(x)
    zero_points = torch.zeros(rows, dtype=torch.int64)
    moved = 4.0 * n + n + 4.0 * rows
    kernel_s = median_seconds(repeats, lambda: torch.quantize_per_channel(x, scales, zero_points, 0, torch.qint8))
    full_s = median_seconds(
        repeats, lambda: torch.quantize_per_channel(x, row_scales(x), zero_points, 0, torch.qint8))
    return {
        "rows": rows, "cols": cols,
        "copy": {"median_s": copy_s, "gb_per_s": copy_bw / 1e9},
        "quantize_per_channel": {"median_s": kernel_s, "gb_per_s": moved / kernel_s / 1e9,
                                 "ratio_to_copy": moved / kernel_s / copy_bw},
        "absmax_plus_quantize_per_channel": {"median_s": full_s, "gb_per_s": moved / full_s / 1e9,
                                             "ratio_to_copy": moved / full_s / copy_bw},
    }


def write_atomically(path, document):
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=directory, prefix=".kernels-torch-", suffix=".json")
    with os.fdopen(handle, "w") as out:
        json.dump(document, out, indent=2)
        out.write("\n")
    os.replace(temp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="bench/results/kernels-torch.json")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: one core)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    if args.threads < 1 or args.repeats < 1:
        parser.error("--threads and --repeats must be at least 1")
    torch.set_num_threads(args.threads)
    results = []
    for rows, cols in SHAPES:
        entry = measure(rows, cols, args.repeats)
        results.append(entry)
        print(f"{rows}x{cols}: copy {entry['copy']['gb_per_s']:.2f} GB/s, "
              f"quantize_per_channel x{entry['quantize_per_channel']['ratio_to_copy']:.3f}, "
              f"absmax+quantize x{entry['absmax_plus_quantize_per_channel']['ratio_to_copy']:.3f} of copy")
    write_atomically(args.output, {
        "benchmark": "torch.quantize_per_channel (per-row int8)", "commit": args.commit,
        "torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
        "machine": {"hostname": platform.node(), "cpu": platform.processor() or platform.machine(),
                    "online_cpus": os.cpu_count()},
        "results": results,
    })
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
