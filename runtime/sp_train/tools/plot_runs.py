#!/usr/bin/env python3
"""Turns sp-train run directories into PNG figures.

  .venv/bin/python runtime/sp_train/tools/plot_runs.py --out bench/results --prefix train-full \
      bf16-only=runs/bf16 dynamic=runs/dynamic all-int8=runs/int8

Reads <run>/train_metrics.jsonl (one record per step) and writes
  <prefix>-loss.png       train loss (moving average) and validation loss, all runs overlaid
  <prefix>-bytes.png      H2D bytes per step, all runs overlaid
  <prefix>-heatmap-<label>.png  route of every block at every step (blocks x steps)

Needs matplotlib: run it with the project's .venv/bin/python.
"""
import argparse
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402


def read_run(directory):
    path = pathlib.Path(directory) / "train_metrics.jsonl"
    records = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"{path}:{number}: not valid JSON: {e}")
    except OSError as e:
        sys.exit(f"{path}: cannot read: {e.strerror}")
    if not records:
        sys.exit(f"{path}: no step records")
    for key in ("step", "loss", "routes", "h2d_bytes_bf16", "h2d_bytes_int8"):
        if key not in records[0]:
            sys.exit(f"{path}:1: missing field '{key}'")
    return records


def moved_bytes(record):
    # Runs from before the NF4 route have no h2d_bytes_nf4.
    return record["h2d_bytes_bf16"] + record["h2d_bytes_int8"] + record.get("h2d_bytes_nf4", 0)


def moving_average(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss(runs, out, window):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, records in runs:
        steps = [r["step"] for r in records]
        line, = ax.plot(steps, moving_average([r["loss"] for r in records], window), alpha=0.8,
                        label=f"{label} train (avg {window})")
        val = [(r["step"] + 1, r["val_loss"]) for r in records if "val_loss" in r]
        if val:
            ax.plot(*zip(*val), "o--", color=line.get_color(), label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_bytes(runs, out):
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, records in runs:
        ax.plot([r["step"] for r in records], [moved_bytes(r) / 1e6 for r in records], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("H2D MB per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_heatmap(label, records, out):
    grid = [[r["routes"][b] for r in records] for b in range(len(records[0]["routes"]))]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(grid) + 1.2))
    ax.imshow(grid, aspect="auto", interpolation="nearest", origin="lower",
              cmap=ListedColormap(["#4c72b0", "#dd8452", "#55a868"]), vmin=0, vmax=2,
              extent=(records[0]["step"] - 0.5, records[-1]["step"] + 0.5, -0.5, len(grid) - 0.5))
    ax.set_xlabel("step")
    ax.set_ylabel("block")
    ax.set_yticks(range(len(grid)))
    ax.set_title(f"{label}: block route per step (blue BF16, orange INT8, green NF4)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    parser.add_argument("--out", default=".", help="directory for the PNG files")
    parser.add_argument("--prefix", default="train", help="file name prefix")
    parser.add_argument("--window", type=int, default=10, help="moving-average window of the train loss")
    args = parser.parse_args()
    runs = []
    for spec in args.runs:
        label, sep, directory = spec.partition("=")
        if not sep or not label or not directory:
            parser.error(f"{spec}: expected LABEL=RUN_DIR")
        runs.append((label, read_run(directory)))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_loss(runs, out / f"{args.prefix}-loss.png", args.window)
    plot_bytes(runs, out / f"{args.prefix}-bytes.png")
    for label, records in runs:
        plot_heatmap(label, records, out / f"{args.prefix}-heatmap-{label}.png")
    print(f"wrote {2 + len(runs)} figures to {out}")


if __name__ == "__main__":
    main()
