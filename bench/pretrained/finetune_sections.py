"""Task 3 in finetune.py's runs (issue 50, section 6, the fine-tuning gate): classify.py's section
classifier fine-tuned, `finetune.py --task sections`.

    .venv/bin/python bench/pretrained/finetune.py --task sections --policy bf16-only,v4-sublayer --mode lora \\
        --seed 0 --compute fp32 --measured-costs bench/results/pretrained/gate/task3.json --out-dir DIR

The model: finetune.py's streamed all-MiniLM-L6-v2 (the same units, policies, modes, steps,
batches, learning rates, optimizer, clipping and seeds as the retrieval runs), its mean-pooled
embedding (finetune.mean_pooled, descriptions cut at classify.TOKENS tokens) into a linear head
384 -> 16 sections. The head is resident (not streamed), fp32, and trains in both modes (LoRA: the
adapters and the head; full: everything and the head). It starts from classify.fit_head's linear
probe (L-BFGS on the frozen pretrained encoder, the train split; the head gate.py measured v4's
unit costs with): a linear probe, then fine-tuning (LP-FT). The fit takes about a minute, so it is
made once and kept in HEAD_CACHE with a digest of the train split it was fitted on.

The loss: cross-entropy over the 16 sections, a batch's BATCH examples from the train split in
the seed's order. Evaluation: the whole split (the test split's 2048 examples), embedded in
batches of similar length (finetune.Task.embed), its mean cross-entropy as `metrics.loss` and its
accuracy. Nothing here is chosen on the test split.
"""

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import classify
import finetune
import sections

HEAD_CACHE = finetune.ROOT / "bench/results/pretrained/sections-head.json"
GATE_TASK = "task3"  # gate.py's name of this task (its --measured-costs JSON)


def fitted_head(train, names, tokenizer, path=HEAD_CACHE):
    """classify.fit_head's head on `train`, fitted once and kept in `path` (JSON, written whole by
    rename): (a trainable fp32 torch.nn.Linear, what the cache says of it). A cache fitted on
    other data is refused. Loading draws nothing from torch's generator; a fit reseeds it (the
    caller seeds its run after)."""
    key = {"examples": len(train), "sha1": finetune.digest(train)}
    path = Path(path)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["train"] != key or saved["classes"] != names:
            raise SystemExit("%s was fitted on other data (train %s, classes %s; this run's: %s, %s): delete it "
                             "to refit" % (path, saved["train"], saved["classes"], key, names))
    else:
        started = time.perf_counter()
        head, accuracy = classify.fit_head(finetune.load_model().eval(), tokenizer, train, names)
        saved = {"what": "task 3's linear probe: classify.fit_head (L-BFGS, fp32, the frozen pretrained encoder) "
                         "on the train split; finetune_sections.py's runs start from it",
                 "train": key, "classes": names, "train_accuracy": accuracy,
                 "fit_seconds": time.perf_counter() - started, "provenance": finetune.provenance(),
                 "weight": head.weight.tolist(), "bias": head.bias.tolist()}
        finetune.write_json(path, saved, indent=None)
    weight, bias = torch.tensor(saved["weight"]), torch.tensor(saved["bias"])
    head = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head, {"from": str(path.relative_to(finetune.ROOT)) if path.is_relative_to(finetune.ROOT) else str(path),
                  "train": key, "train_accuracy": saved["train_accuracy"]}


class Sections:
    """Task 3 as finetune.run() takes a task (finetune.Retrieval's methods); one object serves one
    run: its head trains."""

    what = "issue 50 section 6, task 3: one fine-tuning run of all-MiniLM-L6-v2 with a linear head on " \
           "bench/pretrained/sections.py (a package's section from its description)"

    def __init__(self, cache=None):
        self.cache = cache or classify.CACHE
        self.splits = finetune.cached_pairs(self.cache, sections.load_pairs)
        self.names = sections.labels(self.splits)
        self.tokenizer = finetune.transformers.AutoTokenizer.from_pretrained(finetune.model_path())
        self.head, self.head_from = fitted_head(self.splits["train"], self.names, self.tokenizer)
        self.parameters = list(self.head.parameters())

    def labels(self, chosen):
        return torch.tensor([self.names.index(p.document) for p in chosen])

    def loss(self, model, chosen):
        losses, _ = classify.closure_for(model, self.tokenizer, self.head, self.names)(chosen)
        return losses.mean()

    def evaluate(self, model, split, pool):
        """The whole split (`pool` is the retrieval task's)."""
        pairs = self.splits[split]
        tokens = self.tokenizer([p.query for p in pairs], padding=True, truncation=True, max_length=classify.TOKENS,
                                return_tensors="pt")
        with torch.no_grad():
            logits = self.head(finetune.Task.embed(model, tokens))
        labels = self.labels(pairs)
        return {"loss": F.cross_entropy(logits, labels).item(),
                "accuracy": (logits.argmax(-1) == labels).float().mean().item(), "examples": len(pairs)}

    def measurement(self, model):
        """gate.py's of task 3: the closure of classify.py, whole tune batches of classify.BATCH."""
        tune, size = self.splits["tune"], classify.BATCH
        return (classify.closure_for(model, self.tokenizer, self.head, self.names),
                [tune[i:i + size] for i in range(0, len(tune) - size + 1, size)])

    def calibration_step(self, model, streamed):
        raise SystemExit("v3's calibration step takes a retrieval loss; task 3 runs no v3 policy")

    def measured(self, gate):
        """gate.py's JSON of task 3, on these pairs, with this head (the same fit: its train accuracy)."""
        return (gate.get("task") == GATE_TASK and Path(self.cache).resolve() == classify.CACHE.resolve()
                and gate.get("head_train_accuracy") == self.head_from["train_accuracy"])

    def sizes(self, base):
        drop = ("query_tokens", "document_tokens", "pool", "batch_pairs")
        return {**{k: v for k, v in base.items() if k not in drop}, "batch_examples": base["batch_pairs"],
                "tokens": classify.TOKENS, "classes": len(self.names),
                "head": "linear 384 -> %d, fp32, resident, trainable in both modes, from the linear probe "
                        "(LP-FT)" % len(self.names),
                "evaluation": "the whole split: mean cross-entropy and accuracy"}

    def about(self):
        return {"task": GATE_TASK, "head": self.head_from}

    def summary(self, metrics):
        return "loss %.5f accuracy %.4f" % (metrics["loss"], metrics["accuracy"])
