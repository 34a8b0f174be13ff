"""Task 3's deterministic front (issue 50, section 6): a classification head on all-MiniLM-L6-v2
predicting a Debian package's section from its one-line description (bench/pretrained/sections.py),
each allocation of the static family measured at the pretrained weights by
`layers.compare_routes()` against all-BF16 on the test split: the KL of each example's
16-way section distribution from BF16's and the loss difference, paired over examples, with 95%
intervals; and `layers.calibrate()`'s unit costs on the tune split.

The head is a linear layer (384 -> 16) on the mean-pooled BF16 embedding, fitted by L-BFGS on the
train split's 8192 examples with the encoder frozen (cross-entropy, weight decay 1e-4, 100
iterations, torch seed 0): deterministic, refitted by each run in about a minute. No tuning on the
test split: its accuracy is reported, nothing is chosen by it.

    .venv/bin/python bench/pretrained/classify.py --out bench/results/pretrained/pareto/task3.json
"""

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import pareto  # noqa: E402
import sections  # noqa: E402

CACHE = finetune.ROOT / "bench/results/pretrained/sections.json"
BATCH = 64
TOKENS = 32


def embed(model, tokenizer, texts):
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=TOKENS, return_tensors="pt")
    return finetune.mean_pooled(model, tokens)


def fit_head(model, tokenizer, train, names):
    with torch.no_grad():
        x = torch.cat([embed(model, tokenizer, [p.query for p in train[i:i + BATCH]]) for i in range(0, len(train), BATCH)])
    y = torch.tensor([names.index(p.document) for p in train])
    torch.manual_seed(0)
    head = torch.nn.Linear(x.shape[1], len(names))
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=100, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(head(x), y) + 1e-4 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        accuracy = (head(x).argmax(-1) == y).float().mean().item()
    return head.requires_grad_(False), accuracy


def closure_for(model, tokenizer, head, names):
    def closure(chosen):
        logits = head(embed(model, tokenizer, [p.query for p in chosen]))
        labels = torch.tensor([names.index(p.document) for p in chosen])
        return F.cross_entropy(logits, labels, reduction="none"), logits
    return closure


def measure(out, calibrate_batches):
    started = time.perf_counter()
    finetune.COMPUTE["dtype"] = "fp32"
    torch.manual_seed(0)
    splits = finetune.cached_pairs(CACHE, sections.load_pairs)
    names = sections.labels(splits)
    tokenizer = finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())
    model = finetune.load_model().eval()
    t0 = time.perf_counter()
    head, train_accuracy = fit_head(model, tokenizer, splits["train"], names)
    fit_seconds = time.perf_counter() - t0
    layers = pareto.stream_units(model)
    closure = closure_for(model, tokenizer, head, names)
    test = [splits["test"][i:i + BATCH] for i in range(0, len(splits["test"]) - BATCH + 1, BATCH)]
    with torch.no_grad():
        correct = sum((closure(b)[1].argmax(-1) == torch.tensor([names.index(p.document) for p in b])).sum().item()
                      for b in test)
    rows = []
    for name, routes in pareto.static_family(6).items():
        t0 = time.perf_counter()
        c = layers.compare_routes(closure, test, routes, "bf16")
        rows.append({"allocation": name, "routes": routes, "bytes_saved": c.bytes_saved_a, "loss_bf16": c.loss_b,
                     "loss": c.loss_a, "relative_loss_difference": pareto.interval(c.relative_loss_difference),
                     "kl": pareto.interval(c.kl), "seconds": time.perf_counter() - t0})
        print("%-24s saved %5.1f%%  loss %+6.2f%% [%+6.2f, %+6.2f]  KL %.5f [%.5f, %.5f]" % (
            name, 100 * c.bytes_saved_a, 100 * c.relative_loss_difference.mean, 100 * c.relative_loss_difference.low,
            100 * c.relative_loss_difference.high, c.kl.mean, c.kl.low, c.kl.high), flush=True)
    tune = [splits["tune"][i:i + BATCH] for i in range(0, len(splits["tune"]) - BATCH + 1, BATCH)]
    costs = layers.calibrate(closure, tune[:calibrate_batches], rho=None, max_batches=calibrate_batches)
    layers.close()
    print(costs.table())
    result = {
        "what": "issue 50 section 6, task 3: the static family's deterministic front for a section classifier",
        "task": "task3", "split": "test", "examples": sum(len(b) for b in test), "batch": BATCH, "classes": names,
        "confidence": 0.95, "paired_over": "examples", "compute": "fp32", "reference": "all-BF16",
        "head": {"train_examples": len(splits["train"]), "train_accuracy": train_accuracy,
                 "test_accuracy_bf16": correct / sum(len(b) for b in test), "fit_seconds": fit_seconds},
        "allocations": rows,
        "calibrate": {"split": "tune", "batches": costs.batches, "yardstick": costs.yardstick, "units": costs.units,
                      "costs": {f: [pareto.interval(i) for i in costs.costs[f]] for f in costs.formats},
                      "split_half_by_batches": [{"batches": n, "split_half_rho": costs.split_half_at(n)}
                                                for n in range(2, costs.batches + 1, 2)],
                      "seconds": costs.seconds, "all_bf16_fetches": costs.all_bf16_fetches},
        "data": {k: {"examples": len(v), "sha1": finetune.digest(v)} for k, v in splits.items()},
        "provenance": finetune.provenance(), "wall_seconds": time.perf_counter() - started,
        "command": "bench/pretrained/classify.py --calibrate-batches %d" % calibrate_batches,
    }
    finetune.write_json(out, result)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--calibrate-batches", type=int, default=16, help="tune batches of %d for calibrate()" % BATCH)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not 2 <= args.calibrate_batches <= 16:
        parser.error("--calibrate-batches must be in [2, 16] (the tune split holds 16 batches)")
    torch.set_num_threads(args.threads)
    measure(args.out, args.calibrate_batches)


if __name__ == "__main__":
    main()
