#!/usr/bin/env python3
"""Summarizes one experiment setting run over several seeds (docs/results.md, issue 13): each
policy's final validation loss against the same seed's BF16-only run, and its H2D bytes, with
the mean gap across seeds and its 95% confidence interval, and how many seeds end inside the
goal's band (within 1% of BF16-only at >= 50% fewer bytes).

    summarize_seeds.py --results bench/results --prefix train-nf4-wide-outliers2 --mode full \
        --seeds 1234 1 2 3 --policies all-nf4 first-last-bf16 dynamic-v2 --out FILE.json

Reads <results>/<prefix>[-seed<N>]-<mode>-<policy>.json (seed 1234, the default, has no
suffix), the summaries run_experiments.sh copies there. Writes the JSON atomically and prints a
markdown table.
"""

import argparse
import json
import math
import os
import statistics

from run_records import write_json

# Two-sided 95% quantiles of Student's t by degrees of freedom (n - 1 seeds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
       10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131}
LOSS_BAND, BYTES_GOAL = 0.01, 0.50


def summary(results, prefix, seed, mode, policy):
    name = f"{prefix}{'' if seed == 1234 else f'-seed{seed}'}-{mode}-{policy}.json"
    with open(os.path.join(results, name), encoding="utf-8") as f:
        return name, json.load(f)


def interval(values):
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    half = T95[len(values) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return mean, half


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--mode", default="full")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--policies", nargs="+", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    doc = {"prefix": args.prefix, "mode": args.mode, "seeds": args.seeds,
           "band": {"loss_within": LOSS_BAND, "bytes_saved_at_least": BYTES_GOAL},
           "bf16_only": {}, "policies": {}}
    base = {}
    for seed in args.seeds:
        name, s = summary(args.results, args.prefix, seed, args.mode, "bf16-only")
        base[seed] = s
        doc["bf16_only"][str(seed)] = {"file": name, "final_val_loss": s["final_val_loss"]}
    for policy in args.policies:
        rows = {}
        for seed in args.seeds:
            name, s = summary(args.results, args.prefix, seed, args.mode, policy)
            gap = s["final_val_loss"] / base[seed]["final_val_loss"] - 1.0
            saved = 1.0 - s["h2d_bytes"]["total"] / base[seed]["h2d_bytes"]["total"]
            rows[str(seed)] = {"file": name, "final_val_loss": s["final_val_loss"], "loss_vs_bf16_only": gap,
                               "bytes_saved": saved, "in_band": gap <= LOSS_BAND and saved >= BYTES_GOAL}
        gaps = [r["loss_vs_bf16_only"] for r in rows.values()]
        finals = [r["final_val_loss"] for r in rows.values()]
        saved = [r["bytes_saved"] for r in rows.values()]
        gap_mean, gap_half = interval(gaps)
        saved_mean, saved_half = interval(saved)
        final_mean, final_half = interval(finals)
        doc["policies"][policy] = {
            "final_val_loss": {"mean": final_mean, "ci95_half_width": final_half},
            "seeds": rows,
            "loss_vs_bf16_only": {"mean": gap_mean, "ci95_half_width": gap_half, "min": min(gaps), "max": max(gaps)},
            "bytes_saved": {"mean": saved_mean, "ci95_half_width": saved_half, "min": min(saved), "max": max(saved)},
            "seeds_in_band": sum(r["in_band"] for r in rows.values()),
        }
    losses = [b["final_val_loss"] for b in doc["bf16_only"].values()]
    loss_mean, loss_half = interval(losses)
    doc["bf16_only_spread"] = {"mean": loss_mean, "ci95_half_width": loss_half, "min": min(losses),
                               "max": max(losses), "stdev": statistics.stdev(losses) if len(losses) > 1 else None}
    write_json(args.out, doc)

    pct = lambda v: f"{100 * v:+.2f}%"  # noqa: E731
    ci = lambda m, h, f=pct: f(m) + ("" if h is None else f" ± {f(h).lstrip('+').rstrip('%')}")  # noqa: E731
    loss = lambda v: f"{v:.4f}"  # noqa: E731
    spread = doc["bf16_only_spread"]
    print(f"| policy | mean final val loss (95% CI) | loss vs the seed's BF16-only: mean (95% CI) | worst | "
          f"bytes saved: mean | fewest | seeds in the band (of {len(args.seeds)}) |")
    print("|---|---|---|---|---|---|---|")
    print(f"| bf16-only | {ci(spread['mean'], spread['ci95_half_width'], loss)} | — | — | — | — | — |")
    for policy, p in doc["policies"].items():
        f, g, b = p["final_val_loss"], p["loss_vs_bf16_only"], p["bytes_saved"]
        print(f"| {policy} | {ci(f['mean'], f['ci95_half_width'], loss)} | {ci(g['mean'], g['ci95_half_width'])} | "
              f"{pct(g['max'])} | {100 * b['mean']:.1f}% | {100 * b['min']:.1f}% | {p['seeds_in_band']} |")

if __name__ == "__main__":
    main()
