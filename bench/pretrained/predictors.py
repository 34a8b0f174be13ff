"""Which measurement at the pretrained weights predicts the fine-tuned outcome (issue 50, section 2).

Every allocation that ran in bench/results/pretrained/v3/<task>/ (each training step's routes of
each run, 12 units: attention and MLP of six layers) is measured here on the TUNE split only, at
the pretrained weights, against all-BF16, by these deterministic predictors:

  (a) loss    the relative mean loss difference (in-batch negatives, batches of 32 pairs);
  (b) kl      the KL divergence of each query's 32-way similarity distribution from BF16's;
  (c) grad    the relative error of the trainable parameters' gradient, summed over the batches:
              every parameter in full fine-tuning (`grad_full`), the LoRA adapters in LoRA mode
              (`grad_lora`: lora_B's, the only nonzero one at B = 0, with each run's own seed's
              lora_A, exactly s * dL/dW @ A^T);
  (d) map     the summed single-unit map: the same loss difference (`map_loss`) and KL
              (`map_kl`) of each unit alone in its format, added over the units;
  (e) taylor  the Taylor costs from the BF16 gradient of the same batches: the first-order term
              g.dW (`taylor_first`), first plus second order with the per-batch Fisher
              (`taylor`), and v3's own use of them: each unit's first-order term less its mean
              over the units, plus its second, clipped at 0 (`taylor_v3`).

A run's predictor is the mean over its 12 training steps of the predictor of the step's allocation.
Its outcome is the fine-tuned test loss relative to the BF16-only run of the same mode and seed
(same data order, initialisation and dropout). The correlations are over runs (BF16-only excluded)
and over policies (the mean of their seeds), per mode, with 95% intervals (Fisher z).

The model computes in fp32 with each unit's weights replaced by the dequantized image of its format
(what the streamed layer delivers; checked against `compare_routes` on one allocation, below).

    .venv/bin/python bench/pretrained/predictors.py measure --task task1 --out bench/results/pretrained/predictors/task1.json
    .venv/bin/python bench/pretrained/predictors.py measure --task task2 --out bench/results/pretrained/predictors/task2.json
    .venv/bin/python bench/pretrained/predictors.py table bench/results/pretrained/predictors/task1.json bench/results/pretrained/predictors/task2.json
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from scipy.stats import pearsonr, spearmanr

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import finetune  # noqa: E402
import ground_truth as gt  # noqa: E402
import signals  # noqa: E402

import selective_precision as sp  # noqa: E402

BATCH = 32
SCALE = 20.0
UNITS = ("attn", "mlp")
FORMATS = ("int8", "nf4")
PREDICTORS = ("loss", "kl", "grad_full", "grad_lora", "map_loss", "map_kl", "taylor_first", "taylor", "taylor_v3")


# ---- the runs -----------------------------------------------------------------------------------


def unit_routes(routes):
    """A step's routes per sublayer unit: a block's route stands for both of its units."""
    return tuple(routes) if len(routes) == 12 else tuple(r for r in routes for _ in UNITS)


def load_runs(task):
    runs = []
    for path in sorted((finetune.ROOT / "bench/results/pretrained/v3" / task).glob("*-seed*.json")):
        run = json.loads(path.read_text())
        runs.append({"file": path.name, "policy": run["policy"], "mode": run["mode"], "seed": run["seed"],
                     "loss": run["metrics"]["loss"],
                     "steps": [unit_routes(h["routes"]) for h in run["history"]]})
    base = {(r["mode"], r["seed"]): r["loss"] for r in runs if r["policy"] == "bf16-only"}
    for r in runs:
        r["delta"] = r["loss"] / base[(r["mode"], r["seed"])] - 1.0
    return runs


# ---- the measurement ----------------------------------------------------------------------------


class Bench:
    """The tune batches, the model, each unit's weights in every format, and BF16's reference."""

    def __init__(self, task, pairs):
        splits = signals.cached_pairs(signals.TASKS[task]["cache"], signals.TASKS[task]["loader"])
        tokenizer = finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())
        tune = splits["tune"][:pairs - pairs % BATCH]
        self.batches = [finetune.both(tokenizer, tune[i:i + BATCH]) for i in range(0, len(tune), BATCH)]
        self.pairs = len(tune)
        self.tokenizer, self.tune = tokenizer, tune
        self.model = finetune.load_model().eval()
        self.matrices = [getattr(getattr(layer, u), m) for layer in self.model.encoder.layer for u in UNITS
                         for m in finetune.MATRICES]
        with torch.no_grad():
            self.images = {fmt: [gt.FORMATS[fmt](m.weight.detach().clone()) for m in self.matrices]
                           for fmt in ("bf16",) + FORMATS}
        self.params = [p for p in self.model.parameters()]
        self.reference = self.evaluate(("bf16",) * 12, keep_batch_gradients=True)

    def set_routes(self, routes):
        with torch.no_grad():
            for index, matrix in enumerate(self.matrices):
                matrix.weight.copy_(self.images[routes[index // len(finetune.MATRICES)]][index])

    def evaluate(self, routes, keep_batch_gradients=False):
        """Per query: loss and log-probabilities; the gradient of every parameter summed over the
        batches (and, for BF16, the sum of the per-batch squared gradients of the streamed
        matrices: the per-batch Fisher)."""
        self.set_routes(routes)
        for p in self.params:
            p.grad = None
        losses, logprobs = [], []
        fisher = [torch.zeros_like(m.weight) for m in self.matrices] if keep_batch_gradients else None
        previous = [torch.zeros_like(m.weight) for m in self.matrices] if keep_batch_gradients else None
        for tokens in self.batches:
            embedded = finetune.mean_pooled(self.model, tokens)
            n = embedded.shape[0] // 2
            scores = SCALE * embedded[:n] @ embedded[n:].T
            loss = torch.nn.functional.cross_entropy(scores, torch.arange(n), reduction="none")
            loss.mean().backward()
            losses.append(loss.detach())
            logprobs.append(torch.log_softmax(scores.detach(), dim=-1))
            if keep_batch_gradients:
                for i, m in enumerate(self.matrices):
                    batch_gradient = m.weight.grad - previous[i]
                    fisher[i] += batch_gradient.pow(2)
                    previous[i] = m.weight.grad.clone()
        gradient = [p.grad.detach().clone() for p in self.params]
        self.set_routes(("bf16",) * 12)
        return {"loss": torch.cat(losses), "logprobs": torch.cat(logprobs), "gradient": gradient, "fisher": fisher}

    def lora_a(self, seed):
        """Each streamed matrix's lora_A as finetune.load_model(rank, seed) draws it."""
        model = finetune.load_model(finetune.LORA_RANK, seed)
        return [(getattr(getattr(layer, u), m).lora_A.detach(), getattr(getattr(layer, u), m).parts)
                for layer in model.encoder.layer for u in UNITS for m in finetune.MATRICES]


def lora_gradient(weight_gradients, lora_a):
    """lora_B's gradient at B = 0: per part p, s * dL/dW[rows of p] @ A_p^T."""
    out = []
    for g, (a, parts) in zip(weight_gradients, lora_a):
        rank = a.shape[0] // parts
        rows = g.shape[0] // parts
        for p in range(parts):
            out.append(g[p * rows:(p + 1) * rows] @ a[p * rank:(p + 1) * rank].T)
    return torch.cat([o.flatten() for o in out])


def relative_error(a, b):
    return ((a - b).norm() / b.norm()).item()


def fields(i):
    return {"mean": i.mean, "low": i.low, "high": i.high, "std_error": i.std_error, "n": i.n}


def interval(values):
    return fields(sp.Interval.of([float(v) for v in values]))


class Measured:
    """The predictors (a)-(c) of one allocation against the bench's BF16 reference."""

    def __init__(self, bench, lora_as):
        self.bench, self.lora_as = bench, lora_as
        ref = bench.reference
        self.weight_index = [next(i for i, p in enumerate(bench.params) if p is m.weight) for m in bench.matrices]
        self.ref_lora = {seed: lora_gradient([ref["gradient"][i] for i in self.weight_index], a)
                         for seed, a in lora_as.items()}
        self.ref_full = torch.cat([g.flatten() for g in ref["gradient"]])

    def __call__(self, routes):
        bench, ref = self.bench, self.bench.reference
        started = time.perf_counter()
        got = bench.evaluate(routes)
        p_ref = ref["logprobs"].exp()
        kl = (p_ref * (ref["logprobs"] - got["logprobs"])).sum(-1)
        relative_loss = (got["loss"] - ref["loss"]) / ref["loss"].mean()
        weights = [got["gradient"][i] for i in self.weight_index]
        return {
            "routes": list(routes),
            "loss": interval(relative_loss), "kl": interval(kl),
            "grad_full": relative_error(torch.cat([g.flatten() for g in got["gradient"]]), self.ref_full),
            "grad_lora": {str(seed): relative_error(lora_gradient(weights, a), self.ref_lora[seed])
                          for seed, a in self.lora_as.items()},
            "seconds": time.perf_counter() - started,
        }


def taylor_costs(bench):
    """Per unit and format: the first-order term g.dW and the second-order term 1/2 dW^2 . F with
    g the BF16 gradient summed over the batches and F the sum of the per-batch squared gradients,
    both divided by the number of batches (a mean batch's loss)."""
    ref, n = bench.reference, len(bench.batches)
    weight_grads = {id(p): g for p, g in zip(bench.params, ref["gradient"])}
    out = {}
    per_unit = len(finetune.MATRICES)
    for fmt in FORMATS:
        first, second = [0.0] * 12, [0.0] * 12
        for i, m in enumerate(bench.matrices):
            delta = bench.images[fmt][i] - bench.images["bf16"][i]
            first[i // per_unit] += (weight_grads[id(m.weight)] * delta).sum().item() / n
            second[i // per_unit] += 0.5 * (ref["fisher"][i] * delta.pow(2)).sum().item() / n
        out[fmt] = {"first": first, "second": second}
    return out


def single(unit, fmt):
    return tuple(fmt if u == unit else "bf16" for u in range(12))


def cross_check(bench, routes):
    """The same allocation measured by the product's `compare_routes` on the first two batches."""
    model = finetune.load_model().eval()
    modules = torch.nn.ModuleList([u for layer in model.encoder.layer for u in (layer.attn, layer.mlp)])
    layers = sp.stream(modules, config={"mode": "off", "telemetry_enabled": False},
                       streamed=["%s.weight" % m for m in finetune.MATRICES])
    pairs = bench.tune[:2 * BATCH]

    def closure(chosen):
        embedded = finetune.mean_pooled(model, finetune.both(bench.tokenizer, chosen))
        scores = SCALE * embedded[:len(chosen)] @ embedded[len(chosen):].T
        return torch.nn.functional.cross_entropy(scores, torch.arange(len(chosen)), reduction="none"), scores

    c = layers.compare_routes(closure, [pairs[:BATCH], pairs[BATCH:]], list(routes), "bf16")
    layers.close()
    got = bench.evaluate(routes)
    p_ref = bench.reference["logprobs"][:2 * BATCH].exp()
    kl = (p_ref * (bench.reference["logprobs"][:2 * BATCH] - got["logprobs"][:2 * BATCH])).sum(-1).mean().item()
    return {"routes": list(routes), "compare_routes_kl": c.kl.mean, "here_kl": kl,
            "relative_difference": abs(c.kl.mean - kl) / c.kl.mean}


def measure(task, pairs, out, every):
    started = time.perf_counter()
    finetune.COMPUTE["dtype"] = "fp32"
    runs = load_runs(task)
    allocations = sorted({s for r in runs for s in r["steps"]})
    allocations += [single(u, fmt) for fmt in FORMATS for u in range(12)]
    allocations = list(dict.fromkeys(allocations))
    previous = json.loads(Path(out).read_text()) if Path(out).exists() else {}
    done = {tuple(m["routes"]): m for m in previous.get("allocations", [])}
    if previous and previous.get("pairs") != pairs:
        raise SystemExit("%s was measured on %s tune pairs, not %d: give another --out" % (out, previous.get("pairs"), pairs))
    torch.manual_seed(0)
    bench = Bench(task, pairs)
    seeds = sorted({r["seed"] for r in runs})
    measured = Measured(bench, {seed: bench.lora_a(seed) for seed in seeds})
    result = {
        "what": "issue 50 section 2: the deterministic predictors of every allocation that ran, on the tune split",
        "task": task, "split": "tune", "pairs": bench.pairs, "batch": BATCH, "compute": "fp32",
        "reference": "all-BF16", "taylor": taylor_costs(bench),
        "cross_check": previous.get("cross_check") or cross_check(bench, max(allocations, key=lambda a: a.count("nf4"))),
        "provenance": finetune.provenance(),
        "command": "bench/pretrained/predictors.py measure --task %s --pairs %d" % (task, pairs),
    }
    print("cross-check against compare_routes:", result["cross_check"], flush=True)
    rows = [done[a] for a in allocations if a in done]
    for count, routes in enumerate(a for a in allocations if a not in done):
        rows.append(measured(routes))
        print("%3d/%d %s  loss %+.4f  KL %.5f  grad full %.4f  %.1f s" % (
            len(rows), len(allocations), " ".join(r[0] for r in routes), rows[-1]["loss"]["mean"],
            rows[-1]["kl"]["mean"], rows[-1]["grad_full"], rows[-1]["seconds"]), flush=True)
        if (count + 1) % every == 0:
            finetune.write_json(out, {**result, "allocations": rows, "complete": False})
    result["wall_seconds"] = time.perf_counter() - started + previous.get("wall_seconds", 0.0)
    finetune.write_json(out, {**result, "allocations": rows, "complete": True})


# ---- the table ----------------------------------------------------------------------------------


def predictors_of(result, seed):
    """Each predictor of each allocation (a routes tuple), for the LoRA adapters of `seed`."""
    by = {tuple(m["routes"]): m for m in result["allocations"]}
    taylor = result["taylor"]
    single_loss = {(u, f): by[single(u, f)]["loss"]["mean"] for f in FORMATS for u in range(12)}
    single_kl = {(u, f): by[single(u, f)]["kl"]["mean"] for f in FORMATS for u in range(12)}
    centre = {f: sum(taylor[f]["first"]) / 12 for f in FORMATS}

    def of(routes):
        m = by[routes]
        quantized = [(u, f) for u, f in enumerate(routes) if f != "bf16"]
        first = [taylor[f]["first"][u] for u, f in quantized]
        second = [taylor[f]["second"][u] for u, f in quantized]
        centred = [taylor[f]["first"][u] - centre[f] + taylor[f]["second"][u] for u, f in quantized]
        return {"loss": m["loss"]["mean"], "kl": m["kl"]["mean"], "grad_full": m["grad_full"],
                "grad_lora": m["grad_lora"][str(seed)],
                "map_loss": sum(single_loss[q] for q in quantized), "map_kl": sum(single_kl[q] for q in quantized),
                "taylor_first": sum(first), "taylor": sum(first) + sum(second),
                "taylor_v3": sum(max(c, 0.0) for c in centred)}
    return of


def correlation(x, y):
    """Pearson's r with its 95% interval (Fisher z), and Spearman's rho."""
    n = len(x)
    r = float(pearsonr(x, y).statistic)
    if n > 3 and abs(r) < 1:
        z, half = math.atanh(r), 1.96 / math.sqrt(n - 3)
        low, high = math.tanh(z - half), math.tanh(z + half)
    else:
        low, high = float("nan"), float("nan")
    return {"r": r, "low": low, "high": high, "rho": float(spearmanr(x, y).statistic), "n": n}


def analyse(result):
    runs = load_runs(result["task"])
    table = {}
    for mode in ("lora", "full"):
        rows = []
        for r in runs:
            if r["mode"] != mode or r["policy"] == "bf16-only":
                continue
            of = predictors_of(result, r["seed"])
            values = [of(s) for s in r["steps"]]
            rows.append({"policy": r["policy"], "seed": r["seed"], "delta": r["delta"],
                         **{p: sum(v[p] for v in values) / len(values) for p in PREDICTORS}})
        policies = sorted({r["policy"] for r in rows})
        means = [{"policy": p, **{k: sum(r[k] for r in rows if r["policy"] == p) / sum(r["policy"] == p for r in rows)
                                  for k in ("delta",) + PREDICTORS}} for p in policies]
        table[mode] = {
            "runs": {p: correlation([r[p] for r in rows], [r["delta"] for r in rows]) for p in PREDICTORS},
            "policies": {p: correlation([m[p] for m in means], [m["delta"] for m in means]) for p in PREDICTORS},
            "ceiling": ceiling(rows), "layer0": layer_zero_groups(rows, runs, mode), "per_policy": means,
        }
    return table


def ceiling(rows):
    """How much of the outcome a predictor that is the same for every seed of a policy could
    explain: the share of the runs' variance between policies (the intraclass correlation) and the
    reliability of the policies' means (their between-policy variance less the seeds' noise)."""
    groups = {}
    for r in rows:
        groups.setdefault(r["policy"], []).append(r["delta"])
    means = [sum(v) / len(v) for v in groups.values()]
    within = sum(sum((x - sum(v) / len(v)) ** 2 for x in v) for v in groups.values()) / sum(len(v) - 1 for v in groups.values())
    seeds = len(rows) / len(groups)
    grand = sum(means) / len(means)
    between = sum((m - grand) ** 2 for m in means) / (len(means) - 1)
    true_between = max(between - within / seeds, 0.0)
    return {"within_policy_sd": math.sqrt(within), "between_policy_sd": math.sqrt(true_between),
            "max_r_over_runs": math.sqrt(true_between / (true_between + within)),
            "max_r_over_policies": math.sqrt(true_between / between) if between > 0 else 0.0}


def layer_zero_groups(rows, runs, mode):
    """The runs by what layer 0's units were in most steps: the outcome, and each predictor's mean
    over the group divided by its mean over all runs."""
    status = {}
    for r in runs:
        if r["mode"] != mode or r["policy"] == "bf16-only":
            continue
        nf4 = [sum(s[u] == "nf4" for s in r["steps"]) * 2 > len(r["steps"]) for u in (0, 1)]
        status[(r["policy"], r["seed"])] = {(False, False): "neither", (False, True): "MLP only",
                                            (True, False): "attention only", (True, True): "both"}[tuple(nf4)]
    overall = {p: sum(r[p] for r in rows) / len(rows) for p in PREDICTORS}
    out = {}
    for name in ("neither", "attention only", "MLP only", "both"):
        group = [r for r in rows if status[(r["policy"], r["seed"])] == name]
        if group:
            out[name] = {"runs": len(group), "delta": interval([r["delta"] for r in group]) if len(group) > 1 else
                         {"mean": group[0]["delta"]},
                         **{p: (sum(r[p] for r in group) / len(group)) / overall[p] if overall[p] else float("nan")
                            for p in PREDICTORS}}
    return out


def layer_zero(result):
    """Each unit alone in NF4: its rank (1 = most damaging) among the 12 by every predictor."""
    by = {tuple(m["routes"]): m for m in result["allocations"]}
    taylor = result["taylor"]["nf4"]
    values = {
        "loss": [by[single(u, "nf4")]["loss"]["mean"] for u in range(12)],
        "kl": [by[single(u, "nf4")]["kl"]["mean"] for u in range(12)],
        "grad_full": [by[single(u, "nf4")]["grad_full"] for u in range(12)],
        "grad_lora": [sum(by[single(u, "nf4")]["grad_lora"].values()) / len(by[single(u, "nf4")]["grad_lora"])
                      for u in range(12)],
        "taylor": [a + b for a, b in zip(taylor["first"], taylor["second"])],
    }
    out = {}
    for name, v in values.items():
        order = sorted(range(12), key=lambda u: -v[u])
        out[name] = {"values": v, "rank_of_layer0_attn": order.index(0) + 1, "rank_of_layer0_mlp": order.index(1) + 1,
                     "layer0_share": (v[0] + v[1]) / sum(v) if sum(v) else float("nan")}
    return out


def table(paths):
    lines = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        t = analyse(result)
        lines.append("%s (%d tune pairs, %d allocations)" % (result["task"], result["pairs"], len(result["allocations"])))
        lines.append("| predictor | LoRA: r over runs [95% CI] | LoRA: r over policies | full: r over runs [95% CI] | full: r over policies |")
        lines.append("|---|---|---|---|---|")
        for p in PREDICTORS:
            cells = []
            for mode in ("lora", "full"):
                a, b = t[mode]["runs"][p], t[mode]["policies"][p]
                cells.append("%+.2f [%+.2f, %+.2f] (n %d)" % (a["r"], a["low"], a["high"], a["n"]))
                cells.append("%+.2f (rho %+.2f, n %d)" % (b["r"], b["rho"], b["n"]))
            lines.append("| %s | %s |" % (p, " | ".join(cells)))
        for mode in ("lora", "full"):
            c = t[mode]["ceiling"]
            lines.append("%s: seeds' sd %.2f%%, policies' sd %.2f%%; the most r can be: %.2f over runs, %.2f over policies"
                         % (mode, 100 * c["within_policy_sd"], 100 * c["between_policy_sd"], c["max_r_over_runs"],
                            c["max_r_over_policies"]))
        lines.append("")
        lines.append("| mode | layer 0 in NF4 | runs | outcome | %s |" % " | ".join(PREDICTORS))
        lines.append("|---|---|---|---|" + "---|" * len(PREDICTORS))
        for mode in ("lora", "full"):
            for name, g in t[mode]["layer0"].items():
                lines.append("| %s | %s | %d | %+.2f%% | %s |" % (mode, name, g["runs"], 100 * g["delta"]["mean"],
                                                              " | ".join("%.2f" % g[p] for p in PREDICTORS)))
        z = layer_zero(result)
        lines.append("")
        lines.append("| one unit in NF4 | rank of layer 0 attention | rank of layer 0 MLP | layer 0's share |")
        lines.append("|---|---|---|---|")
        for name, row in z.items():
            lines.append("| %s | %d | %d | %.0f%% |" % (name, row["rank_of_layer0_attn"], row["rank_of_layer0_mlp"],
                                                       100 * row["layer0_share"]))
        lines.append("")
    print("\n".join(lines))


def layer_zero_interaction(task, out, test_pairs):
    """Layer 0 in NF4 at the pretrained weights, on the whole tune split and on the test split,
    by compare_routes against all-BF16: alone, and added to first-last-int8 (whose layers 1-4
    are NF4 already), the MLP alone and both units. Whether its damage needs training to show,
    or the other NF4 units, or the split."""
    import pareto
    finetune.COMPUTE["dtype"] = "fp32"
    splits = signals.cached_pairs(signals.TASKS[task]["cache"], signals.TASKS[task]["loader"])
    tokenizer = finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())
    first_last_int8 = ["int8", "int8"] + ["nf4"] * 8 + ["int8", "int8"]
    allocations = {
        "layer 0 MLP alone": single(1, "nf4"),
        "layer 0 alone": ("nf4", "nf4") + ("bf16",) * 10,
        "first-last-int8": tuple(first_last_int8),
        "first-last-int8, layer 0 MLP NF4": ("int8", "nf4") + tuple(first_last_int8[2:]),
        "first-last-int8, layer 0 NF4": ("nf4", "nf4") + tuple(first_last_int8[2:]),
    }
    model = finetune.load_model().eval()
    layers = pareto.stream_units(model)
    closure = pareto.closure_for(model, tokenizer)
    result = {"what": "issue 50 section 2: layer 0 in NF4 at the pretrained weights, alone and with the other NF4 "
                      "units, on the tune and the test split",
              "task": task, "batch": BATCH, "allocations": {k: list(v) for k, v in allocations.items()},
              "provenance": finetune.provenance(),
              "command": "bench/pretrained/predictors.py layer0 --task %s --test-pairs %d" % (task, test_pairs)}
    for split, pairs in (("tune", splits["tune"]), ("test", splits["test"][:test_pairs])):
        pairs = pairs[:len(pairs) - len(pairs) % BATCH]
        batches = [pairs[i:i + BATCH] for i in range(0, len(pairs), BATCH)]
        measured = [layers.compare_routes(closure, batches, list(v), "bf16") for v in allocations.values()]
        result[split] = {"pairs": len(pairs), "rows": {}}
        for name, c in zip(allocations, measured):
            result[split]["rows"][name] = {"relative_loss_difference": fields(c.relative_loss_difference),
                                           "kl": fields(c.kl)}
            print("%s %-34s loss %+6.2f%% [%+6.2f, %+6.2f]  KL %.5f" % (
                split, name, 100 * c.relative_loss_difference.mean, 100 * c.relative_loss_difference.low,
                100 * c.relative_loss_difference.high, c.kl.mean), flush=True)
    layers.close()
    finetune.write_json(out, result)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure every allocation that ran (resumes --out)")
    m.add_argument("--task", required=True, choices=sorted(signals.TASKS))
    m.add_argument("--pairs", type=int, default=256, help="tune pairs (a multiple of %d)" % BATCH)
    m.add_argument("--out", required=True)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--every", type=int, default=5, help="write --out after this many allocations")
    z = sub.add_parser("layer0", help="layer 0 in NF4, alone and with others, on the tune and test splits")
    z.add_argument("--task", required=True, choices=sorted(signals.TASKS))
    z.add_argument("--test-pairs", type=int, default=1024)
    z.add_argument("--out", required=True)
    z.add_argument("--threads", type=int, default=1)
    t = sub.add_parser("table", help="the correlation tables of measured JSONs")
    t.add_argument("json", nargs="+")
    args = parser.parse_args()
    if args.command == "table":
        table(args.json)
        return
    torch.set_num_threads(args.threads)
    if args.command == "layer0":
        layer_zero_interaction(args.task, args.out, args.test_pairs)
        return
    if args.pairs < BATCH:
        parser.error("--pairs must be at least %d" % BATCH)
    measure(args.task, args.pairs, args.out, args.every)


if __name__ == "__main__":
    main()
