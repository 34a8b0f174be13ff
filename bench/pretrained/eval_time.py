"""What finetune.py's evaluation costs with the pool embedded in its order and in batches of similar
length: the same model (the pretrained weights, fp32, one thread), the same 1000 test pairs of task 1,
both ways in one process; the time of each, the padded positions each computes, and the largest
difference between their embeddings.

    .venv/bin/python bench/pretrained/eval_time.py --out bench/results/pretrained/eval_time.json
"""

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import ground_truth as gt  # noqa: E402

PAIRS = HERE.parent / "results" / "pretrained" / "finetune" / "pairs.json"
BATCH = 64


def in_order(model, tokens, batch=BATCH):
    """finetune.Task.embed before it sorted: batches in the pool's order, each cut to its longest."""
    out = []
    for i in range(0, tokens["input_ids"].shape[0], batch):
        longest = int(tokens["attention_mask"][i:i + batch].sum(1).max())
        part = {k: v[i:i + batch, :longest] for k, v in tokens.items()}
        with finetune.compute_precision():
            out.append(gt.Task.embed(model, part, batch).float())
    return torch.cat(out)


def computed_positions(lengths, batch=BATCH):
    """Positions a pass computes when each batch is cut to its longest sequence."""
    return sum(int(lengths[i:i + batch].max()) * min(batch, len(lengths) - i) for i in range(0, len(lengths), batch))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    finetune.COMPUTE["dtype"] = "fp32"
    splits = finetune.cached_pairs(PAIRS)
    tokenizer = finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())
    model = finetune.load_model().eval()
    task = finetune.Task(tokenizer, splits["test"], finetune.POOL, finetune.QUERY_TOKENS, finetune.DOCUMENT_TOKENS)
    timed = {}
    for name, embed in (("in_order", in_order), ("by_length", finetune.Task.embed)):
        started = time.perf_counter()
        timed[name] = {"embeddings": [embed(model, task.queries), embed(model, task.documents)],
                       "seconds": time.perf_counter() - started}
        print("%s: %.1f s" % (name, timed[name]["seconds"]), flush=True)
    positions = {}
    for part in ("queries", "documents"):
        lengths = getattr(task, part)["attention_mask"].sum(1)
        positions[part] = {"real": int(lengths.sum()), "in_order": computed_positions(lengths),
                           "by_length": computed_positions(lengths[torch.argsort(lengths, descending=True, stable=True)])}
    difference = max(float((a - b).abs().max())
                     for a, b in zip(timed["in_order"]["embeddings"], timed["by_length"]["embeddings"]))
    print("positions %s; max |difference| %.2e" % (positions, difference))
    finetune.write_json(Path(args.out), {
        "what": "finetune.py's evaluation (1000 test pairs of task 1, pretrained weights, fp32, one thread): the "
                "pool embedded in its order against in batches of similar length",
        "seconds": {name: t["seconds"] for name, t in timed.items()},
        "ratio_in_order_over_by_length": timed["in_order"]["seconds"] / timed["by_length"]["seconds"],
        "positions": positions, "max_abs_embedding_difference": difference, "provenance": finetune.provenance(),
        "command": "bench/pretrained/eval_time.py --out %s" % args.out})


if __name__ == "__main__":
    main()
