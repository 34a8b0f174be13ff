#!/usr/bin/env python3
"""Writes the seed corpora of sp-train's harnesses: training configs (from configs/, and small
ones with --set overrides), checkpoints and calibration caches (valid, and near-valid ones the
readers must refuse). Run from the repository root: python3 runtime/sp_train/fuzz/make_seeds.py"""
import json
import pathlib
import struct

root = pathlib.Path(__file__).resolve().parents[3]
out = root / "runtime/sp_train/fuzz/corpus"


def write(folder, name, data):
    d = out / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# ---- train_config: config text, then optionally "#--set" and one override per line ----
write("train_config", "default.yaml", (root / "configs/default.yaml").read_bytes())
write("train_config", "lora.yaml", (root / "configs/lora.yaml").read_bytes())
small = ("model:\n  d_model: 64\n  n_heads: 2\n  n_blocks: 2\n  seq_len: 32\n"
         "train:\n  steps: 3\n  batch_size: 2\n")
write("train_config", "small-with-overrides.yaml",
      small + "\n#--set\ntrain.steps=5\nmodel.outliers=[0]\nL:data.path=corpus #2.txt\n"
      "memory.stagehand.streaming.prefetch_window=3\n")
write("train_config", "policy-section.yaml",
      small + "memory:\n  stagehand:\n    streaming:\n      bandwidth_cap_gbps: 2.5\n"
      "    selective_precision:\n      run_calibration: false\n      telemetry_file: policy.jsonl\n")
write("train_config", "unknown-key.yaml", small + "  stpes: 4\n")
# Found by this harness: a NUL after a number made yaml-cpp read "1" and blanks, which sp-train took
# for 1 and wrote back quoted (a string) into the resolved config (yaml_diagnostics' is_plain_scalar).
write("train_config", "regression-nul-after-number.yaml", "train:\n  threads: 1          \0          # cores\n  steps: 3\n")
# Found by this harness: yaml-cpp's LoadAll never returned on a stray ',' before the first node.
write("train_config", "regression-stray-comma.yaml", ",a: 1\n")
# A recursive document (the policy section is the plugin's to refuse); the harness must not loop.
write("train_config", "recursive-alias.yaml", "memory: &m\n  stagehand:\n    selective_precision: *m\n")
# Found by this harness: a d_model the default n_heads does not divide escaped as YAML::InvalidNode.
write("train_config", "regression-d-model-63.yaml", "model:\n  d_model: 63\n")
write("train_config", "bad-override.yaml", small + "\n#--set\ntrain.steps.x=1\n=3\ntrain.lr=[1\n")

# ---- checkpoint: one flags byte (bit 0: re-seal the FNV-1a trailer), then the file ----
def fnv1a64(data):
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def checkpoint(sections, version=1):
    body = b"SPTRCKPT" + struct.pack("<II", version, len(sections))
    for name, payload in sections:
        body += struct.pack("<I", len(name)) + name + struct.pack("<Q", len(payload)) + payload
    return body + struct.pack("<Q", fnv1a64(body))


sections = [(b"meta", b'{"next_step": 7}'), (b"rng", bytes(range(16))), (b"weights/block0", struct.pack("<4f", 1, -2, 0.5, 3))]
good = checkpoint(sections)
write("checkpoint", "three-sections", b"\x00" + good)
write("checkpoint", "empty", b"\x00" + checkpoint([]))
write("checkpoint", "version2-resealed", b"\x01" + checkpoint(sections, version=2))
write("checkpoint", "duplicate-section-resealed", b"\x01" + checkpoint([(b"a", b"1"), (b"a", b"2")]))
write("checkpoint", "bad-checksum", b"\x00" + good[:-1] + bytes([good[-1] ^ 1]))
write("checkpoint", "truncated-resealed", b"\x01" + good[:40] + bytes(8))

# ---- calibration_cache: one flags byte (bit 0: store the right checksum, bit 1: look up under
# the file's own fingerprint, bits 2-4: blocks - 1), then the file ----
def cache(int8, nf4, version=2, fingerprint="00aa11bb22cc33dd"):
    return json.dumps({"format": "sp-train-calibration", "version": version, "fingerprint": fingerprint,
                       "identity": {"d_model": 64, "n_blocks": len(int8)}, "block_errors": int8,
                       "nf4_block_errors": nf4, "checksum": "0"}, indent=2)


def flags(blocks, reseal=True, own_fingerprint=True):
    return bytes([(1 if reseal else 0) | (2 if own_fingerprint else 0) | ((blocks - 1) << 2)])


write("calibration_cache", "hit-2-blocks", flags(2) + cache([0.01, 0.2], [0.05, 0.4]).encode())
write("calibration_cache", "hit-4-blocks", flags(4) + cache([0.0, 1e-5, 0.3, 2.0], [0.1, 0.1, 0.5, 3.0]).encode())
write("calibration_cache", "block-count-mismatch", flags(3) + cache([0.01, 0.2], [0.05, 0.4]).encode())
write("calibration_cache", "fingerprint-mismatch", flags(2, own_fingerprint=False) + cache([0.01, 0.2], [0.05, 0.4]).encode())
write("calibration_cache", "version-1", flags(2) + cache([0.01, 0.2], [0.05, 0.4], version=1).encode())
write("calibration_cache", "negative-error", flags(2) + cache([0.01, -0.2], [0.05, 0.4]).encode())
write("calibration_cache", "bad-checksum", flags(2, reseal=False) + cache([0.01, 0.2], [0.05, 0.4]).encode())
