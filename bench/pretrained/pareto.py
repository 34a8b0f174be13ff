"""The deterministic Pareto front of a task (issue 50, section 1): for each allocation of the static
family and for policy v3 at three byte budgets, what it costs at the pretrained weights, measured
by `layers.compare_routes()` against all-BF16 on the test split, with 95% intervals paired over
queries, and over batches (the queries of a batch share its documents): the mean loss difference
(relative to BF16's loss) and the KL divergence of each query's similarity distribution from BF16's. No training: this is the yardstick, not the fine-tuned outcome.

    .venv/bin/python bench/pretrained/pareto.py --task task1 --out bench/results/pretrained/pareto/task1.json
    .venv/bin/python bench/pretrained/pareto.py --task task2 --out bench/results/pretrained/pareto/task2.json

The model is finetune.py's all-MiniLM-L6-v2, its six layers streamed as twelve units (attention,
MLP), computing in fp32 (the formats' damage is in the delivered weights; a bf16 matmul on this CPU
is emulated). A closure's batch is BATCH test pairs: their queries and documents in one pass, each
query scored against the batch's documents (MultipleNegativesRanking, scale 20), so a query's loss
and its KL both come from the same 32-way distribution. v3 decides its routes by its calibration
step on CALIBRATION_PAIRS tune-split pairs (finetune.calibration_step), then they are measured like
any other allocation. The bytes are per fetch of every unit, against all-BF16.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import signals  # noqa: E402

import selective_precision as sp  # noqa: E402

BATCH = 32
V3_BUDGETS = (0.50, 0.45, 0.35)  # the fraction of all-BF16's bytes v3 may move: 50%, 55%, 65% saved


def static_family(n_layers):
    """The static rules, per unit (attention, MLP of each layer in order)."""
    def per_layer(route_of_layer):
        return [route_of_layer(layer, part) for layer in range(n_layers) for part in ("attention", "mlp")]

    last = n_layers - 1
    eighth = n_layers // 8
    more = {layer for layer in range(n_layers)
            if layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2}
    return {
        "all-int8": per_layer(lambda layer, part: "int8"),
        "all-nf4": per_layer(lambda layer, part: "nf4"),
        "first-last-bf16": per_layer(lambda layer, part: "bf16" if layer in (0, last) else "nf4"),
        "first-last-int8": per_layer(lambda layer, part: "int8" if layer in (0, last) else "nf4"),
        # llama.cpp's use_more_bits: the first and last eighth of the layers and every third between.
        "more-bits": per_layer(lambda layer, part: "int8" if layer in more else "nf4"),
        "attention-int8-mlp-nf4": per_layer(lambda layer, part: "int8" if part == "attention" else "nf4"),
    }


def stream_units(model):
    """The model's layers streamed as attention and MLP units, all-BF16 (compare_routes pins)."""
    layers = list(model.encoder.layer)
    modules = torch.nn.ModuleList([u for layer in layers for u in (layer.attn, layer.mlp)])
    names = ["%s.weight" % m for m in finetune.MATRICES]
    return sp.stream(modules, config={"mode": "off", "telemetry_enabled": False}, streamed=names)


def v3_routes(budget, tune, tokenizer):
    """The routes v3 decides at `budget` by its calibration step, on a fresh copy of the model."""
    model = finetune.load_model()
    layers = list(model.encoder.layer)
    config, _ = finetune.policy_config("v3-sublayer", 2 * len(layers), None)
    modules = torch.nn.ModuleList([u for layer in layers for u in (layer.attn, layer.mlp)])
    streamed = sp.stream(modules, config=config, streamed=["%s.weight" % m for m in finetune.MATRICES],
                         budget=sp.Budget(bytes=budget))
    calibration = finetune.calibration_step(model, streamed, tokenizer, tune)
    routes = streamed.routes()
    streamed.close()
    return routes, calibration


def closure_for(model, tokenizer):
    def closure(chosen):
        tokens = finetune.both(tokenizer, chosen)
        embedded = finetune.mean_pooled(model, tokens)
        queries, documents = embedded[:len(chosen)], embedded[len(chosen):]
        scores = 20.0 * queries @ documents.T
        loss = torch.nn.functional.cross_entropy(scores, torch.arange(len(chosen)), reduction="none")
        return loss, scores
    return closure


def interval(i):
    return {"mean": i.mean, "low": i.low, "high": i.high, "std_error": i.std_error, "n": i.n}


def task_data(task):
    """The task's splits and the tokenizer, with fp32 compute and torch's seed 0."""
    finetune.COMPUTE["dtype"] = "fp32"
    torch.manual_seed(0)
    splits = signals.cached_pairs(signals.TASKS[task]["cache"], signals.TASKS[task]["loader"])
    return splits, finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())


def batched(pairs, most=None):
    """Whole batches of BATCH pairs, at most `most` of them."""
    count = len(pairs) // BATCH if most is None else min(len(pairs) // BATCH, most)
    return [pairs[i * BATCH:(i + 1) * BATCH] for i in range(count)]


def measure(task, pairs, out):
    started = time.perf_counter()
    splits, tokenizer = task_data(task)
    batches = batched(splits["test"][:pairs])
    test = [p for b in batches for p in b]

    allocations = dict(static_family(6))
    decided = {}
    for budget in V3_BUDGETS:
        name = "v3-save%d" % round(100 * (1 - budget))
        allocations[name], decided[name] = v3_routes(budget, splits["tune"], tokenizer)

    model = finetune.load_model().eval()
    layers = stream_units(model)
    closure = closure_for(model, tokenizer)
    rows = []
    for name, routes in allocations.items():
        t0 = time.perf_counter()
        c = layers.compare_routes(closure, batches, routes, "bf16")
        rows.append({
            "allocation": name, "routes": routes, "bytes_saved": c.bytes_saved_a,
            "loss_bf16": c.loss_b, "loss": c.loss_a,
            "loss_difference": interval(c.loss_difference),
            "relative_loss_difference": interval(c.relative_loss_difference),
            "kl": interval(c.kl),
            # The queries of a batch share its documents: the intervals over the batches, each one draw.
            "kl_over_batches": interval(sp.Interval.of(c.batch_kl)),
            "relative_loss_difference_over_batches": interval(
                sp.Interval.of(c.batch_loss_differences).scaled(1.0 / c.loss_b)),
            "measurement_h2d_bytes": c.h2d_bytes, "seconds": time.perf_counter() - t0,
            **({"calibration": {k: decided[name][k] for k in ("pairs", "loss", "seconds", "budget")}}
               if name in decided else {}),
        })
        by_batch = rows[-1]["kl_over_batches"]
        print("%-24s saved %5.1f%%  loss %+6.2f%% [%+6.2f, %+6.2f]  KL %.5f [%.5f, %.5f], over batches [%.5f, %.5f]" % (
            name, 100 * c.bytes_saved_a, 100 * c.relative_loss_difference.mean, 100 * c.relative_loss_difference.low,
            100 * c.relative_loss_difference.high, c.kl.mean, c.kl.low, c.kl.high, by_batch["low"], by_batch["high"]),
            flush=True)
    layers.close()
    result = {
        "task": task, "split": "test", "pairs": len(test), "batch": BATCH, "confidence": 0.95,
        "paired_over": "queries", "units": "attention and MLP of each of 6 layers", "compute": "fp32",
        "reference": "all-BF16", "allocations": rows, "provenance": finetune.provenance(),
        "wall_seconds": time.perf_counter() - started,
        "command": "bench/pretrained/pareto.py --task %s --pairs %d" % (task, pairs),
    }
    finetune.write_json(out, result)
    return result


def plot(results, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        for row in r["allocations"]:
            kl = row["kl"]
            policy = row["allocation"].startswith("v")  # a policy's allocation (v3, v4), not a static rule
            ax.errorbar(100 * row["bytes_saved"], kl["mean"], yerr=[[kl["mean"] - kl["low"]], [kl["high"] - kl["mean"]]],
                        fmt="o" if policy else "s", color="tab:red" if policy else "tab:blue", capsize=3)
            ax.annotate(row["allocation"], (100 * row["bytes_saved"], kl["mean"]), fontsize=7,
                        xytext=(4, 4), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bytes saved against all-BF16 (%)")
        ax.set_ylabel("KL from BF16 per example (95% CI)")
        ax.set_title("%s: %d test examples" % (r["task"], r["pairs"]))
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(signals.TASKS), help="measure this task")
    parser.add_argument("--pairs", type=int, default=512, help="test pairs measured (a multiple of %d)" % BATCH)
    parser.add_argument("--out", help="the task's JSON")
    parser.add_argument("--plot", nargs="+", metavar="JSON", help="plot these JSONs into --png")
    parser.add_argument("--png")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.plot:
        if not args.png:
            parser.error("--plot needs --png")
        plot([json.loads(Path(p).read_text()) for p in args.plot], args.png)
        return
    if not args.task or not args.out:
        parser.error("give --task and --out (or --plot and --png)")
    if args.pairs < BATCH:
        parser.error("--pairs must be at least %d" % BATCH)
    measure(args.task, args.pairs, args.out)


if __name__ == "__main__":
    main()
