#!/usr/bin/env python3
"""Writes the seed corpora of the adapters' harnesses from the committed host-emulated report and
policy in bench/results/: small valid files, older-format ones and a few near-valid ones.
Run from the repository root: python3 adapters/fuzz/make_seeds.py"""
import copy
import json
import pathlib

root = pathlib.Path(__file__).resolve().parents[2]
out = root / "adapters/fuzz/corpus"
report = json.loads((root / "bench/results/transfer-report-host-emulated.json").read_text())
policy = json.loads((root / "bench/results/transfer-policy-host-emulated.json").read_text())


def write(folder, name, text):
    d = out / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(text)


small = copy.deepcopy(report)
small["points"] = report["points"][:2]
write("transfer_report", "two-points.json", json.dumps(small, separators=(",", ":")))
one = copy.deepcopy(report)
one["points"] = report["points"][:1]
write("transfer_report", "one-point-indented.json", json.dumps(one, indent=1))
old = copy.deepcopy(one)  # before NF4 and the fused rebuild: no "nf4", no "rebuild"
for p in old["points"]:
    p.pop("nf4", None)
old.pop("rebuild", None)
old.pop("bandwidth_cap_gbps", None)
write("transfer_report", "pre-nf4.json", json.dumps(old, separators=(",", ":")))
empty = copy.deepcopy(one)
empty["points"] = []
write("transfer_report", "no-points.json", json.dumps(empty, separators=(",", ":")))
bad = copy.deepcopy(one)
bad["points"][0]["bf16_copy"]["samples"] = -1
write("transfer_report", "negative-samples.json", json.dumps(bad, separators=(",", ":")))
write("transfer_report", "truncated.json", json.dumps(one, separators=(",", ":"))[:300])

write("transfer_policy", "host-emulated.json", json.dumps(policy, separators=(",", ":")))
v1 = copy.deepcopy(policy)  # before NF4: int8 rules only
v1["rules"] = {k: v for k, v in policy["rules"].items() if k.startswith("int8")}
write("transfer_policy", "pre-nf4.json", json.dumps(v1, indent=1))
none = copy.deepcopy(policy)
none["rules"] = {}
none["sources"] = []
write("transfer_policy", "no-rules.json", json.dumps(none))
overlap = copy.deepcopy(policy)
overlap["rules"]["int8_trained"][1]["min_bytes"] = 4000000
write("transfer_policy", "overlapping-rules.json", json.dumps(overlap, separators=(",", ":")))
unknown = copy.deepcopy(v1)
unknown["rules"]["fp8_frozen"] = []
write("transfer_policy", "unknown-path.json", json.dumps(unknown, separators=(",", ":")))
