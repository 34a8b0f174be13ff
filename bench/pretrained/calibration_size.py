"""How many batches `layers.calibrate()` needs before the units' costs repeat (issue 50, section 3).

On a task's whole tune split (batches of 32 pairs, pareto.py's closure: a query's loss and its
32-way similarity distribution), `calibrate()` measures every unit alone in INT8 and in NF4 against
all-BF16 on every batch (rho=None, so it never stops early). Then, for each even number of batches
n, Spearman's rho between the units' mean KL over the even and over the odd batches of the first
n: the split-half figure calibrate() stops on. Also each cost's interval at the end, its width
relative to its mean, and what the measurement cost in time and fetches.

    .venv/bin/python bench/pretrained/calibration_size.py --task task1 --out bench/results/pretrained/calibration/task1.json
    .venv/bin/python bench/pretrained/calibration_size.py --task task2 --out bench/results/pretrained/calibration/task2.json
"""

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import pareto  # noqa: E402
import signals  # noqa: E402


def measure(task, max_batches, out):
    started = time.perf_counter()
    splits, tokenizer = pareto.task_data(task)
    batches = pareto.batched(splits["tune"], max_batches)
    tune = [p for b in batches for p in b]
    model = finetune.load_model().eval()
    layers = pareto.stream_units(model)
    costs = layers.calibrate(pareto.closure_for(model, tokenizer), batches, rho=None, max_batches=len(batches))
    layers.close()
    rows = [{"batches": n, "split_half_rho": costs.split_half_at(n)} for n in range(2, costs.batches + 1, 2)]
    for r in rows:
        print("%2d batches: rho %s" % (r["batches"], ", ".join("%s %+.2f" % kv for kv in r["split_half_rho"].items())))
    result = {
        "what": "issue 50 section 3: the split-half rho of calibrate()'s unit costs against the batches measured",
        "task": task, "split": "tune", "pairs": len(tune), "batch": pareto.BATCH, "compute": "fp32",
        "yardstick": costs.yardstick, "units": costs.units,
        "costs": {f: [pareto.interval(i) for i in costs.costs[f]] for f in costs.formats},
        "relative_half_width": {f: [(i.high - i.low) / 2 / i.mean for i in costs.costs[f]] for f in costs.formats},
        "split_half_by_batches": rows,
        "calibration": {"batches": costs.batches, "examples": costs.examples, "seconds": costs.seconds,
                        "h2d_bytes": costs.h2d_bytes, "all_bf16_fetches": costs.all_bf16_fetches},
        "provenance": finetune.provenance(), "wall_seconds": time.perf_counter() - started,
        "command": "bench/pretrained/calibration_size.py --task %s --max-batches %d" % (task, max_batches),
    }
    finetune.write_json(out, result)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", required=True, choices=sorted(signals.TASKS))
    parser.add_argument("--max-batches", type=int, default=24)
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.max_batches < 2:
        parser.error("--max-batches must be at least 2")
    torch.set_num_threads(args.threads)
    measure(args.task, args.max_batches, args.out)


if __name__ == "__main__":
    main()
