"""Issue 50, section 4: whether policy v4's boundary swaps, measured jointly, move its allocation on a task.

For each budget of the task's deterministic gate (gate.py's JSON, whose calibration holds the unit
costs v4 decides by):

1. Policy v4 (configs/policy/v4.yaml) takes the unit costs through the plugin and decides, as in
   gate.py; its routes must be the gate's.
2. It proposes its allocation with the swaps at its knapsack's boundary (`propose_allocations`:
   the units nearest the cut each way, paired at no more bytes).
3. They are measured jointly on the batches the units were measured on (the tune split's first
   `calibration.batches`), KL per example against all-BF16, one `compare_allocations`, and handed
   back (`set_allocation_measurements`) as calibrate() does. v4 moves to a swap only where its paired
   difference from the allocation is below zero beyond its interval, Bonferroni-corrected over the
   K swaps measured (1 - 0.05 / K), as the torch layer computes it.
4. Where it moved, the allocation before and after are measured on the test split, paired: whether
   the joint measurement on the tune split held out of sample.

    .venv/bin/python bench/pretrained/swaps.py --gate bench/results/pretrained/gate/task2.json \\
        --out bench/results/pretrained/swaps/task2.json
"""

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import gate  # noqa: E402
import pareto  # noqa: E402

import selective_precision as sp  # noqa: E402


def unit_costs(saved, units):
    """gate.py's calibration as calibrate() returned it, enough to send to the policy."""
    return sp.UnitCosts(
        units=units, formats=list(saved["costs"]), yardstick="kl", paired_over="examples",
        costs={f: [sp.Interval(**i) for i in c] for f, c in saved["costs"].items()}, loss_differences={},
        split_half_rho=saved["split_half_rho"], batch_costs={}, batches=saved["batches"], examples=saved["examples"],
        stopped_because=saved["stopped_because"], confidence=0.95, h2d_bytes=saved["h2d_bytes"],
        all_bf16_fetches=saved["all_bf16_fetches"], seconds=saved["seconds"])


def v4_layers(model, saving):
    modules = torch.nn.ModuleList([u for layer in model.encoder.layer for u in (layer.attn, layer.mlp)])
    return sp.stream(modules, config=os.path.join(sp.config_dir(), "policy", "v4.yaml"),
                     streamed=["%s.weight" % m for m in finetune.MATRICES], budget=sp.Budget(bytes=1.0 - saving))


def one_budget(row, pristine, closure_of, costs, calibration, test):
    model = copy.deepcopy(pristine).eval()
    layers = v4_layers(model, row["budget_saving"])
    link = layers._layer().model
    if not link.set_unit_signals(*costs.signal_table()):
        raise RuntimeError("policy v4 refused the gate's measurement (see the log)")
    before = layers.routes()
    if before != row["routes"]:
        raise RuntimeError("v4 decided %s from the gate's costs, but the gate recorded %s" % (before, row["routes"]))
    closure = closure_of(model)
    proposed = link.propose_allocations()
    out = {"policy": row["policy"], "budget_saving": row["budget_saving"], "routes_before": before,
           "alternatives": max(len(proposed) - 1, 0), "measured": [], "routes_after": before, "moved": False}
    if len(proposed) < 2:
        layers.close()
        return out
    t0 = time.perf_counter()
    measured = layers.compare_allocations(closure, calibration, {str(k): r for k, r in enumerate(proposed)}, "bf16")
    ordered = [measured[str(k)] for k in range(len(proposed))]
    out["measure_seconds"] = time.perf_counter() - t0
    out["difference_confidence"] = 1.0 - 0.05 / (len(proposed) - 1)
    for k, m in enumerate(ordered):
        difference = sp.Interval.of([a - b for a, b in zip(m.example_kl, ordered[0].example_kl)],
                                    out["difference_confidence"])
        out["measured"].append({"routes": proposed[k], "bytes_saved": m.bytes_saved_a, "kl": pareto.interval(m.kl),
                                "difference_from_allocation": pareto.interval(difference) if k else None})
    link.set_allocation_measurements(proposed, [m.example_kl for m in ordered], 0.95)
    after = layers.routes()
    out.update({"routes_after": after, "moved": after != before})
    if after != before:
        on_test = layers.compare_allocations(closure, test, {"before": before, "after": after}, "bf16")
        out["test"] = {"before": pareto.interval(on_test["before"].kl), "after": pareto.interval(on_test["after"].kl),
                       "after_minus_before": pareto.interval(gate.paired(on_test["after"], on_test["before"]))}
    layers.close()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gate", required=True, help="gate.py's JSON of the task")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    saved = json.loads(Path(args.gate).read_text())
    pristine, closure_of, calibration, test, _ = gate.task(saved["task"], saved["test"]["examples"])
    calibration = calibration[:saved["calibration"]["batches"]]
    units = ["%d" % u for u in range(2 * len(pristine.encoder.layer))]
    costs = unit_costs(saved["calibration"], units)
    rows = [one_budget(row, pristine, closure_of, costs, calibration, test) for row in saved["gates"]]
    for r in rows:
        print("%-11s alternatives %d moved %s%s" % (
            r["policy"], r["alternatives"], r["moved"],
            "" if not r["moved"] else "  test KL after - before %+.5f [%+.5f, %+.5f]" % (
                r["test"]["after_minus_before"]["mean"], r["test"]["after_minus_before"]["low"],
                r["test"]["after_minus_before"]["high"])), flush=True)
        for k, m in enumerate(r["measured"][1:], 1):
            d = m["difference_from_allocation"]
            print("    %d: KL %.5f  minus the allocation's %+.6f [%+.6f, %+.6f]" % (
                k, m["kl"]["mean"], d["mean"], d["low"], d["high"]), flush=True)
    finetune.write_json(args.out, {
        "what": "issue 50 section 4: policy v4's boundary swaps measured jointly on the calibration batches, and "
                "whether they moved its allocation (KL per example against all-BF16; 95% intervals of the KL, "
                "Bonferroni-corrected ones of the differences)",
        "task": saved["task"], "gate": args.gate, "calibration_batches": len(calibration),
        "budgets": rows, "provenance": finetune.provenance(), "wall_seconds": time.perf_counter() - started,
        "command": "bench/pretrained/swaps.py --gate %s --out %s --threads %d" % (args.gate, args.out, args.threads)})


if __name__ == "__main__":
    main()
