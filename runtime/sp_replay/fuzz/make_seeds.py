#!/usr/bin/env python3
"""Writes the seed corpora of sp-replay's harnesses (a 4-block model): traces cut from
runtime/sp_replay/examples/trace-48-blocks.jsonl (first steps, first 4 blocks) and calibration
files, valid and near-valid. Run from the repository root: python3 runtime/sp_replay/fuzz/make_seeds.py"""
import json
import pathlib

root = pathlib.Path(__file__).resolve().parents[3]
out = root / "runtime/sp_replay/fuzz/corpus"
BLOCKS = 4


def write(folder, name, text):
    d = out / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)


steps = []
with open(root / "runtime/sp_replay/examples/trace-48-blocks.jsonl") as f:
    for _ in range(3):
        record = json.loads(f.readline())
        record["blocks"] = [b for b in record["blocks"] if b["id"] < BLOCKS]
        steps.append(record)
compact = [json.dumps(s, separators=(",", ":")) for s in steps]
write("replay_trace", "three-steps.jsonl", "\n".join(compact) + "\n")
with_loss = [dict(s, loss=2.5 - 0.1 * i) for i, s in enumerate(steps[:2])]
with_loss[1]["loss"] = None
with_loss[1]["blocks"] = with_loss[1]["blocks"][1:3]  # blocks without a gradient are absent
write("replay_trace", "loss-and-gaps.jsonl", json.dumps(with_loss[0]) + "\n\n  \n" + json.dumps(with_loss[1]) + "\r\n")
bad = dict(steps[0])
bad["blocks"] = [dict(steps[0]["blocks"][0], nonfinite=13000000)]
write("replay_trace", "nonfinite-above-count.jsonl", json.dumps(bad, separators=(",", ":")) + "\n")
write("replay_trace", "step-gap.jsonl", compact[0] + "\n" + compact[2] + "\n")
write("replay_trace", "huge-number.jsonl", '{"step":0,"blocks":[{"id":0,"sum_sq":1e400,"sum":0,"max_abs":1,"count":1,"nonfinite":0}]}\n')

write("replay_calibration", "both.json", json.dumps({"block_errors": {"0": 0.01, "1": 0.2, "3": 0.05},
                                                      "nf4_block_errors": {"0": 0.1, "2": 0.4}}, indent=1))
write("replay_calibration", "int8-only.json", json.dumps({"block_errors": {str(b): 0.01 * (b + 1) for b in range(BLOCKS)}}))
write("replay_calibration", "id-out-of-range.json", json.dumps({"nf4_block_errors": {"4": 0.1}}))
write("replay_calibration", "same-block-twice.json", '{"block_errors": {"1": 0.1, "01": 0.2}}')
write("replay_calibration", "neither.json", '{}')
write("replay_calibration", "negative.json", '{"block_errors": {"2": -0.5}}')
