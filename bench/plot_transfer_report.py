#!/usr/bin/env python3
"""Plots an `sp-bench transfer` report: effective bandwidth and time per block against block
size, for the raw pinned copy, the BF16 path and the INT8 path (frozen and trained blocks).

    .venv/bin/python bench/plot_transfer_report.py REPORT.json OUT.png

Effective bandwidth is BF16 bytes delivered per second: the INT8 path delivers the same
weights with half the bytes on the wire, so it can exceed the raw copy rate.
"""
import json
import os
import sys
import tempfile

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def fail(message):
    print(f"plot_transfer_report: {message}", file=sys.stderr)
    sys.exit(2)


def load(path):
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: {e}")
    if report.get("format") != "sp-transfer-report" or report.get("version") != 1:
        fail(f"{path}: not an sp-transfer-report version 1")
    points = sorted(report["points"], key=lambda p: p["bf16_bytes"])
    if not points:
        fail(f"{path}: the report has no measurement")
    return report, points


def main():
    if len(sys.argv) != 3:
        fail("usage: plot_transfer_report.py REPORT.json OUT.png")
    report, points = load(sys.argv[1])
    mib = [p["bf16_bytes"] / 2**20 for p in points]
    series = {
        "raw pinned copy": [p["raw_copy_s"] for p in points],
        "BF16 path": [p["bf16_path_s"] for p in points],
        "INT8 path, frozen": [p["int8_frozen_path_s"] for p in points],
        "INT8 path, trained (+ rebuild)": [p["int8_trained_path_s"] for p in points],
        "BF16 path, trained (+ rebuild)": [p["bf16_trained_path_s"] for p in points],
    }
    fig, (bw, tm) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, seconds in series.items():
        style = "--" if "trained" in label else "-"
        bw.plot(mib, [p["bf16_bytes"] / s / 1e9 for p, s in zip(points, seconds)], style, marker="o", ms=3, label=label)
        tm.plot(mib, [s * 1e3 for s in seconds], style, marker="o", ms=3, label=label)
    for ax in (bw, tm):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("BF16 block size (MiB)")
        ax.grid(True, which="both", alpha=0.3)
    bw.set_ylabel("effective GB/s (BF16 bytes delivered per second)")
    tm.set_ylabel("ms per block")
    tm.set_yscale("log")
    bw.legend(fontsize=8)
    device = report["device"]
    fig.suptitle(f"sp-bench transfer on {report['machine']}: {device}", fontsize=10)
    fig.tight_layout()
    out = sys.argv[2]
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(out)), suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
