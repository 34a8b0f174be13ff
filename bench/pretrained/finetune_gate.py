"""Issue 50, section 6: the fine-tuning gate of policy v4 on a set of finetune.py runs (one JSON a
run in RUN_DIR: the same seeds under bf16-only, v4-sublayer and static rules, each seed the same
data order, initialization and dropout for every policy).

    .venv/bin/python bench/pretrained/finetune_gate.py bench/results/pretrained/v4/task2

Per seed, Δ = L_policy / L_BF16-only - 1 on the test split (the same seed's runs). Reported:
- v4 against BF16-only: the mean Δ and its one-sided 95% upper bound (Student t over the seeds);
  the gate is upper bound <= +1%;
- v4 against each static rule present, paired by seed: Δ_v4 - Δ_rule with its 95% interval and
  a two-sided t test, Holm-corrected over the rules: "better" where the corrected test rejects
  and the interval is below 0, "no worse" where the upper bound is <= +0.5%;
- each policy's bytes saved over the training's fetches and, for v4, counting its measurement;
- "seeds within 1%" of BF16-only, for information only.
Writes RUN_DIR/gate.json and prints the table (Markdown).
"""

import argparse
import json
import math
import re
import sys
from pathlib import Path

from scipy import stats

V4 = "v4-sublayer"
BASE = "bf16-only"
CONFIDENCE = 0.95
UPPER_VS_BF16 = 0.01
NO_WORSE_VS_RULE = 0.005


def load(run_dir):
    runs = {}
    for path in sorted(Path(run_dir).glob("*.json")):
        match = re.fullmatch(r"(lora|full)-(.+)-seed(\d+)\.json", path.name)
        if match:
            runs[(match.group(1), match.group(2), int(match.group(3)))] = json.loads(path.read_text())
    return runs


def interval(values, confidence=CONFIDENCE, one_sided=False):
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    se = sd / math.sqrt(n)
    q = stats.t.ppf(confidence if one_sided else 0.5 + confidence / 2, n - 1) if n > 1 else math.nan
    p = 2 * stats.t.sf(abs(mean / se), n - 1) if n > 1 and se > 0 else (0.0 if mean != 0 else 1.0)
    return {"mean": float(mean), "low": float(mean - q * se), "high": float(mean + q * se), "std_error": float(se), "n": n,
            "p_two_sided": float(p)}


def holm(p_values):
    """Holm's step-down adjusted p-values, in the given order."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    args = parser.parse_args()
    runs = load(args.run_dir)
    modes = sorted({m for m, _, _ in runs})
    result = {"run_dir": args.run_dir, "confidence": CONFIDENCE, "modes": {}}
    for mode in modes:
        seeds = sorted(s for m, p, s in runs if m == mode and p == V4 and (mode, BASE, s) in runs)
        if len(seeds) < 2:
            continue
        delta = {}
        for m, p, s in runs:
            if m == mode and s in seeds and (mode, BASE, s) in runs:
                base = runs[(mode, BASE, s)]["metrics"]["loss"]
                delta.setdefault(p, {})[s] = runs[(m, p, s)]["metrics"]["loss"] / base - 1.0
        rules = sorted(p for p in delta if p not in (V4, BASE) and all(s in delta[p] for s in seeds))
        v4 = [delta[V4][s] for s in seeds]
        versus_bf16 = interval(v4, one_sided=True)
        comparisons = [interval([delta[V4][s] - delta[r][s] for s in seeds]) for r in rules]
        adjusted = holm([c["p_two_sided"] for c in comparisons])
        saved = {p: sum(runs[(mode, p, s)]["h2d_bytes"]["saved_fraction"] for s in seeds) / len(seeds)
                 for p in delta}
        with_measurement = sum(runs[(mode, V4, s)]["h2d_bytes"].get("with_calibration", {}).get("saved_fraction", math.nan)
                               for s in seeds) / len(seeds)
        row = {
            "seeds": seeds,
            "v4_vs_bf16": versus_bf16, "v4_vs_bf16_passes": bool(versus_bf16["high"] <= UPPER_VS_BF16),
            "v4_vs_rules": [{
                "rule": r, **c, "p_holm": a, "rule_saved": saved[r],
                "verdict": ("better" if a < 1 - CONFIDENCE and c["high"] < 0 else
                            "no worse" if c["high"] <= NO_WORSE_VS_RULE else "not shown"),
            } for r, c, a in zip(rules, comparisons, adjusted)],
            "saved": saved, "v4_saved_with_measurement": with_measurement,
            "within_1pct": {p: sum(1 for s in seeds if delta[p][s] <= 0.01) for p in delta},
        }
        result["modes"][mode] = row
        print("\n%s, %d seeds: v4 vs BF16-only %+.2f%%, one-sided 95%% upper %+.2f%% (gate <= +1%%: %s); "
              "v4 saved %.1f%% (%.1f%% counting its measurement)" % (
                  mode, len(seeds), 100 * versus_bf16["mean"], 100 * versus_bf16["high"],
                  "passes" if row["v4_vs_bf16_passes"] else "fails", 100 * saved[V4], 100 * with_measurement))
        print("| against | it saves | v4 − it, loss | 95% CI | p (Holm) | verdict |\n|---|---|---|---|---|---|")
        for c in row["v4_vs_rules"]:
            print("| %s | %.1f%% | %+.2f%% | [%+.2f, %+.2f] | %.3f | %s |" % (
                c["rule"], 100 * c["rule_saved"], 100 * c["mean"], 100 * c["low"], 100 * c["high"], c["p_holm"],
                c["verdict"]))
        print("seeds within 1%% of BF16-only: %s" % ", ".join("%s %d/%d" % (p, k, len(seeds))
                                                            for p, k in sorted(row["within_1pct"].items())))
    out = Path(args.run_dir) / "gate.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


if __name__ == "__main__":
    sys.exit(main())
