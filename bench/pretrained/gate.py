"""Issue 50, section 6: the deterministic gate of policy v4 against the static rule a user would pick,
at equal bytes, on one task.

For the task's model (all-MiniLM-L6-v2, its six layers streamed as twelve units, attention and MLP,
fp32 compute, the pretrained weights: no training):

1. `layers.calibrate(closure, calibration)` measures each unit alone in INT8 and in NF4 against
   all-BF16 (KL per example) on the calibration batches (the tune split), until the split-half rho
   reaches 0.9 or the batches run out. This is v4's measurement.
2. For each budget, policy v4 (configs/policy/v4.yaml, `budget=sp.Budget(bytes=1 - saving)`) takes
   that measurement through the plugin (`set_unit_signals`, as calibrate sends it) and decides its
   routes. The budgets are the savings of all-INT8 and of attention-INT8-MLP-NF4 (the static family's
   49.6% and 65.4%), and the issue's 55%, where v4 is reported against BF16 (no rule of the family
   saves that little, so it is not a gate).
3. The rival at each budget is the rule a user would pick: of the static family's rules saving at
   least as many bytes, the one with the least KL on the same calibration batches.
4. On the test split, every allocation against all-BF16 in one `compare_allocations`: the KL per
   example, and v4 - rival paired over the same examples with its 95% interval. The gate: the upper
   bound of that difference is at most 5% of the rival's own KL. The best rule in hindsight (least
   test KL among those saving as much) is reported beside it, as information: chosen on the test
   split, it is not a gate.

    .venv/bin/python bench/pretrained/gate.py --task task3 --out bench/results/pretrained/gate/task3.json
    .venv/bin/python bench/pretrained/gate.py --task task2 --out bench/results/pretrained/gate/task2.json
    .venv/bin/python bench/pretrained/gate.py --task task1 --out bench/results/pretrained/gate/task1.json
    .venv/bin/python bench/pretrained/gate.py --plot bench/results/pretrained/gate/task{1,2,3}.json \
        --out bench/results/pretrained/gate/front.png

Tasks 1 and 2 are the retrieval tasks of pareto.py (batches of 32 pairs: a query's KL is over its
batch's 32 documents; 1024 test pairs); task 3 is classify.py's section classifier (batches of 64,
a 16-way KL; 2048 test examples).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import classify  # noqa: E402
import finetune  # noqa: E402
import pareto  # noqa: E402
import sections  # noqa: E402

import selective_precision as sp  # noqa: E402

MARGIN = 0.05  # v4 may be at most this fraction of the rival's KL worse, at the upper bound
GATED = ("all-int8", "attention-int8-mlp-nf4")  # v4's budget is each of these rules' own saving
ISSUE_SAVING = 0.55


def task(name, test_pairs):
    """(model, closure, calibration batches, test batches, what the data is)."""
    if name == "task3":
        finetune.COMPUTE["dtype"] = "fp32"
        torch.manual_seed(0)
        splits = finetune.cached_pairs(classify.CACHE, sections.load_pairs)
        names = sections.labels(splits)
        tokenizer = finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())
        model = finetune.load_model().eval()
        head, accuracy = classify.fit_head(model, tokenizer, splits["train"], names)
        size = classify.BATCH
        cut = lambda pairs: [pairs[i:i + size] for i in range(0, len(pairs) - size + 1, size)]  # noqa: E731
        return (model, lambda m: classify.closure_for(m, tokenizer, head, names), cut(splits["tune"]),
                cut(splits["test"]), {"head_train_accuracy": accuracy, "batch": size, "classes": len(names)})
    splits, tokenizer = pareto.task_data(name)
    model = finetune.load_model().eval()
    return (model, lambda m: pareto.closure_for(m, tokenizer), pareto.batched(splits["tune"]),
            pareto.batched(splits["test"][:test_pairs]), {"batch": pareto.BATCH})


def v4_routes(costs, saving):
    """The routes policy v4 decides at `saving` from calibrate's measurement, through the plugin."""
    model = finetune.load_model()
    modules = torch.nn.ModuleList([u for layer in model.encoder.layer for u in (layer.attn, layer.mlp)])
    config = os.path.join(sp.config_dir(), "policy", "v4.yaml")
    layers = sp.stream(modules, config=config, streamed=["%s.weight" % m for m in finetune.MATRICES],
                       budget=sp.Budget(bytes=1.0 - saving))
    if not layers._layer().model.set_unit_signals(*costs.signal_table()):
        raise RuntimeError("policy v4 refused calibrate's measurement (see the log)")
    routes = layers.routes()
    report = layers._layer().model.budget_status()
    layers.close()
    return routes, report


def paired(a, b):
    """a - b per example, and its 95% interval."""
    return sp.Interval.of([x - y for x, y in zip(a.example_kl, b.example_kl)], 0.95)


def measure(name, test_pairs, out, threads):
    torch.set_num_threads(threads)
    started = time.perf_counter()
    model, closure_of, calibration, test, about = task(name, test_pairs)
    layers = pareto.stream_units(model)
    closure = closure_of(model)

    costs = layers.calibrate(closure, calibration, rho=0.9, max_batches=32)
    print(costs.table(), flush=True)
    print("calibrate: %d batches, %s, %.0f s, %.1f all-BF16 fetches" % (
        costs.batches, costs.stopped_because, costs.seconds, costs.all_bf16_fetches), flush=True)
    used = calibration[:costs.batches]

    family = pareto.static_family(6)
    t0 = time.perf_counter()
    on_calibration = layers.compare_allocations(closure, used, family, "bf16")
    rival_seconds = time.perf_counter() - t0
    savings = {r: on_calibration[r].bytes_saved_a for r in family}

    budgets = {"v4-save%d" % round(100 * savings[r]): savings[r] for r in GATED}
    issue_name = "v4-save%d" % round(100 * ISSUE_SAVING)
    budgets[issue_name] = ISSUE_SAVING
    decided = {n: v4_routes(costs, s) for n, s in budgets.items()}

    t0 = time.perf_counter()
    on_test = layers.compare_allocations(closure, test, {**family, **{n: r for n, (r, _) in decided.items()}}, "bf16")
    test_seconds = time.perf_counter() - t0
    layers.close()

    def figures(c):
        return {"bytes_saved": c.bytes_saved_a, "kl": pareto.interval(c.kl),
                "relative_loss_difference": pareto.interval(c.relative_loss_difference)}

    gates = []
    for n, saving in budgets.items():
        v4 = on_test[n]
        eligible = [r for r in family if savings[r] >= saving - 1e-9]
        rival = min(eligible, key=lambda r: on_calibration[r].kl.mean)
        hindsight = min(eligible, key=lambda r: on_test[r].kl.mean)
        difference = paired(v4, on_test[rival])
        row = {
            "policy": n, "budget_saving": saving, "routes": decided[n][0], "budget_status": decided[n][1],
            "v4": figures(v4), "rival": rival, "rival_calibration_kl": pareto.interval(on_calibration[rival].kl),
            "rival_test": figures(on_test[rival]),
            "difference": pareto.interval(difference),
            "difference_relative": pareto.interval(difference.scaled(1.0 / on_test[rival].kl.mean)),
            # At the issue's 55% no rule of the family saves as few bytes: v4 is reported against
            # BF16 (its own figures) and the rival saves more; it is not a gate.
            "gated": n != issue_name,
            "passes": difference.high <= MARGIN * on_test[rival].kl.mean,
            # The plugin's byte model is the layer's: v4 saves at least the budget's bytes.
            "saves_at_least_the_budget": v4.bytes_saved_a >= saving - 1e-9,
            "hindsight": hindsight, "hindsight_test": figures(on_test[hindsight]),
            "v4_minus_hindsight": pareto.interval(paired(v4, on_test[hindsight])),
        }
        gates.append(row)
        print("%-11s saved %5.1f%%  KL %.5f [%.5f, %.5f]  rival %-24s (saved %5.1f%%) KL %.5f  v4-rival %+6.1f%% "
              "[%+6.1f, %+6.1f]  %s  hindsight %s" % (
                  n, 100 * v4.bytes_saved_a, v4.kl.mean, v4.kl.low, v4.kl.high, rival,
                  100 * on_test[rival].bytes_saved_a, on_test[rival].kl.mean,
                  100 * row["difference_relative"]["mean"], 100 * row["difference_relative"]["low"],
                  100 * row["difference_relative"]["high"],
                  ("PASS" if row["passes"] else "FAIL") if row["gated"] else "(not a gate)", hindsight),
              flush=True)

    result = {
        "what": "issue 50 section 6: policy v4 against the static rule a user would pick, at equal bytes, "
                "deterministic (pretrained weights, KL per example against all-BF16)",
        "task": name, "margin": MARGIN, "confidence": 0.95, "paired_over": "examples", "compute": "fp32",
        "units": "attention and MLP of each of 6 layers", **about,
        "calibration": {"split": "tune", "batches": costs.batches, "examples": costs.examples,
                        "stopped_because": costs.stopped_because, "split_half_rho": costs.split_half_rho,
                        "seconds": costs.seconds, "h2d_bytes": costs.h2d_bytes,
                        "all_bf16_fetches": costs.all_bf16_fetches,
                        "costs": {f: [pareto.interval(i) for i in costs.costs[f]] for f in costs.formats},
                        "rival_measurement_seconds": rival_seconds},
        "static_on_calibration": {r: figures(on_calibration[r]) for r in family},
        "test": {"examples": len(on_test["all-int8"].example_kl), "seconds": test_seconds,
                 "allocations": {n: figures(c) for n, c in on_test.items()}},
        "gates": gates,
        "provenance": finetune.provenance(), "wall_seconds": time.perf_counter() - started,
        "command": "bench/pretrained/gate.py --task %s --test-pairs %d --threads %d" % (name, test_pairs, threads),
    }
    finetune.write_json(out, result)


def plot(paths, png):
    """The test split's front of each task's result: the static family and v4 at its budgets."""
    results = []
    for path in paths:
        r = json.loads(Path(path).read_text())
        rows = [{"allocation": n, **f} for n, f in r["test"]["allocations"].items()]
        results.append({"task": r["task"], "pairs": r["test"]["examples"], "allocations": rows})
    pareto.plot(results, png)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="draw these results into --out (a .png) instead")
    parser.add_argument("--task", choices=("task1", "task2", "task3"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--test-pairs", type=int, default=1024, help="tasks 1 and 2: test pairs measured")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.plot:
        plot(args.plot, args.out)
    elif args.task is None:
        parser.error("--task is required to measure (or give --plot)")
    else:
        measure(args.task, args.test_pairs, args.out, args.threads)


if __name__ == "__main__":
    main()
