#!/usr/bin/env python3
"""Writes the example gradient-moment trace and calibration file that sp-replay ships with.

The profile follows the 48-block case in the policy seed: early blocks have low gradient
activity and low INT8 error, late blocks high activity and high error, and the middle of
the network drifts over time so that the policy has to move blocks in both directions.
One block sees a non-finite gradient once, to exercise the unsafe rule. The output is a
pure function of the arguments (fixed seed), so the committed files can be regenerated.

    python3 make_example_trace.py --blocks 48 --steps 160 --out-dir .
"""
import argparse
import json
import math
import os
import random
import tempfile


def block_profile(block, n_blocks):
    """Relative gradient activity (mean 1 over blocks) and calibration error of a block."""
    depth = block / max(n_blocks - 1, 1)
    activity = 0.25 + 2.2 * depth ** 3
    error = 0.01 + 0.07 * depth ** 2
    return activity, error


def drift(block, n_blocks, step, n_steps):
    """The middle third of the network warms up halfway through the run, then cools."""
    depth = block / max(n_blocks - 1, 1)
    if not 0.35 <= depth <= 0.65:
        return 1.0
    phase = step / max(n_steps - 1, 1)
    return 1.0 + 5.0 * math.exp(-((phase - 0.45) / 0.15) ** 2)


def atomic_write(path, text):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--params-per-block", type=int, default=12 * 1024 * 1024)
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    profiles = [block_profile(b, args.blocks) for b in range(args.blocks)]
    count = args.params_per_block
    unsafe_step, unsafe_block = args.steps * 3 // 4, args.blocks // 8
    lines = []
    for step in range(args.steps):
        blocks = []
        for b, (activity, _) in enumerate(profiles):
            l2 = activity * drift(b, args.blocks, step, args.steps) * rng.lognormvariate(0.0, 0.15)
            rms = l2 / math.sqrt(count)
            nonfinite = 7 if (step, b) == (unsafe_step, unsafe_block) else 0
            blocks.append({
                "id": b,
                "sum_sq": round(l2 * l2, 9),
                "sum": round(rms * count * rng.gauss(0.0, 1e-3), 9),
                "max_abs": round(rms * rng.uniform(6.0, 9.0), 12),
                "count": count,
                "nonfinite": nonfinite,
            })
        lines.append(json.dumps({"step": step, "blocks": blocks}, separators=(",", ":")))
    atomic_write(os.path.join(args.out_dir, f"trace-{args.blocks}-blocks.jsonl"), "\n".join(lines) + "\n")
    calibration = {"block_errors": {str(b): round(err, 5) for b, (_, err) in enumerate(profiles)}}
    atomic_write(os.path.join(args.out_dir, f"calibration-{args.blocks}-blocks.json"),
                 json.dumps(calibration, indent=1) + "\n")


if __name__ == "__main__":
    main()
