"""What the experiment scripts of runtime/sp_train/tools share when they read a run directory
and write their bench/results JSON. Their inline Python finds it on PYTHONPATH (set by each
script to this folder)."""

import json
import os


def jsonl(path):
    """The records of a JSON-lines file (train_metrics.jsonl, transfer_metrics.jsonl, telemetry)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path, doc):
    """Writes `doc` to `path` through a temporary file renamed over it."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)
