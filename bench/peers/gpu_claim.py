"""The GPU claim (issue 41, section 9): a Llama-style model too large to want resident, streamed
on the device, against the same model resident and against a musubi-style block swap.

The model: LlamaForCausalLM with blocks of d = 4096 (intermediate 11008, 32 heads of 128, no
grouped KV), 8 blocks of 202 M parameters (1.62 B streamed) and a 32000-token vocabulary with an
untied head (262 M resident): 1.88 B parameters. Batch 4 x 1024 tokens.

Two modes:
- full: every weight trains; torch.optim.AdamW over model.parameters() (the streamed blocks'
  fp32 masters are on the host, so their update runs on the host; the resident side's on the
  GPU);
- lora: the base is frozen; rank-16 adapters on the four attention projections train (resident
  on the GPU, fp32), as peft's would.

The sides, each computing under torch.autocast("cuda", bfloat16) on fp32 weights:
- resident: the whole model on the GPU;
- block swap (musubi-tuner's way): each block's 2-D weights stay fp32 masters on the host; its
  forward, and its recompute in the backward (torch.utils.checkpoint, non-reentrant), copy them
  into bf16 buffers on the GPU allocated once (two sets, alternate blocks) and run the block on
  them; the gradient reaches the masters through copy_;
- sp.stream BF16, INT8 and NF4: every block's route pinned (policy mode static, or off for
  BF16), device="cuda", compute_dtype=bfloat16, the activations kept; and BF16 with
  recompute=True, for its peak memory.

Per side: two untimed steps (warm-up; the forced routes hold from the first), then --steps timed ones,
each synchronized; the median step, its phases (forward, backward, optimizer), the peak GPU
memory of the timed steps (torch.cuda.max_memory_allocated), and for sp.stream the bytes a step
moved. Rows: ours / peer in steps per second, for information (the issue sets no goal on the
GPU yet).

On a GPU machine (scripts/gpu-check.sh claim, about 6 minutes on an H100):
    python3 bench/peers/gpu_claim.py --out gpu-out/gpu-claim.json
Here, to check the script on a model of a few kilobytes:
    PYTHONPATH=build/python .venv/bin/python bench/peers/gpu_claim.py --tiny --device cpu --out /tmp/claim.json
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402
import transformers  # noqa: E402

import selective_precision as sp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "common"))
from peer_report import PeerRows, routes_config, write_report  # noqa: E402

CLAIM = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=8, num_attention_heads=32,
             num_key_value_heads=32, max_position_embeddings=1024, use_cache=False, attn_implementation="sdpa",
             tie_word_embeddings=False)
TINY = dict(CLAIM, vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4)
BATCH, SEQ, TINY_SEQ = 4, 1024, 16
LORA_RANK, LORA_TARGETS = 16, ("q_proj", "k_proj", "v_proj", "o_proj")
LR = 1e-5
BF16 = torch.bfloat16


class LoraLinear(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, under peft's names (lora_A,
    lora_B), which sp.stream() leaves resident."""

    def __init__(self, base, rank):
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_B = torch.nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)
        torch.nn.init.zeros_(self.lora_B.weight)
        self.scale = 2.0

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def add_lora(model):
    model.requires_grad_(False)
    for block in model.model.layers:
        for name in LORA_TARGETS:
            setattr(block.self_attn, name, LoraLinear(getattr(block.self_attn, name), LORA_RANK))
    return model


class SwappedBlock(torch.nn.Module):
    """musubi-tuner's block swap: the block's 2-D base weights stay fp32 masters on the host; its
    forward, and its recompute in the backward, copy them into GPU buffers allocated once."""

    def __init__(self, block, buffers, device):
        super().__init__()
        self.block = block
        with torch.no_grad():
            for name, p in block.named_parameters():
                if "lora_" in name:
                    continue
                if p.dim() != 2:
                    p.data = p.data.to(device)
        self.masters = {n: p for n, p in block.named_parameters() if p.dim() == 2 and "lora_" not in n}
        self.buffers = buffers

    def forward(self, *args, **kwargs):
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _run(self, *args, **kwargs):
        weights = {n: self.buffers[n].detach().copy_(m, non_blocking=True) for n, m in self.masters.items()}
        return torch.func.functional_call(self.block, weights, args, kwargs, strict=False)


def block_swap(model, device):
    """The model on the device but its blocks' 2-D base weights, which stay on the host."""
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList()
    model.to(device)
    shapes = {n: p.shape for n, p in layers[0].named_parameters() if p.dim() == 2 and "lora_" not in n}
    buffers = [{n: torch.empty(s, dtype=BF16, device=device) for n, s in shapes.items()} for _ in range(2)]
    for block in layers:  # the adapters go to the device; the masters stay
        for module in block.modules():
            if isinstance(module, LoraLinear):
                module.lora_A.to(device)
                module.lora_B.to(device)
    model.model.layers = torch.nn.ModuleList(SwappedBlock(b, buffers[i % 2], device) for i, b in enumerate(layers))
    return model


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Side:
    def __init__(self, label, model, device, streamed=None):
        self.label, self.model, self.device, self.streamed = label, model.train(), device, streamed
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
        self.times, self.phases, self.losses = [], [], []

    def step(self, ids, record=True):
        synchronize(self.device)
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=BF16):
            loss = self.model(input_ids=ids, labels=ids).loss
        synchronize(self.device)
        t1 = time.perf_counter()
        loss.backward()
        synchronize(self.device)
        t2 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.device)
        t3 = time.perf_counter()
        self.losses.append(loss.item())
        if record:
            self.times.append(t3 - t0)
            self.phases.append({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2})


def run_side(label, make, ids, device, steps, streamed=None):
    """Builds one side, times it, and frees it: only one side's model is alive at a time."""
    started = time.perf_counter()
    side = Side(label, make(), device, streamed)
    side.step(ids, record=False)
    side.step(ids, record=False)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(steps):
        side.step(ids)
    result = {"median_step_ms": round(statistics.median(side.times) * 1e3, 1),
              "samples_ms": [round(t * 1e3, 1) for t in side.times],
              "phases_median_ms": {k: round(statistics.median(p[k] for p in side.phases) * 1e3, 1)
                                   for k in side.phases[0]},
              "losses": [round(x, 4) for x in side.losses],
              "peak_device_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    if streamed:
        report = side.model.model.layers.last_report
        assert set(report.routes) == {streamed}, (label, report.routes)
        result["h2d_bytes_per_step"] = report.h2d_bytes
        result["all_bf16_bytes_per_step"] = report.h2d_bytes_all_bf16
        side.model.model.layers.close()
    print("%-36s %8.1f ms  %s  peak %s" % (label, result["median_step_ms"], result["phases_median_ms"],
                                         result["peak_device_memory_bytes"]), flush=True)
    del side
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["seconds_with_setup"] = round(time.perf_counter() - started, 1)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--tiny", action="store_true", help="a model of a few kilobytes, to check the script")
    parser.add_argument("--commit", default=os.environ.get("SP_COMMIT", "unknown"))
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_claim.py: --device cuda, but torch sees no CUDA device")
    config_dict = TINY if args.tiny else CLAIM
    config = transformers.LlamaConfig(**config_dict)
    seq = TINY_SEQ if args.tiny else SEQ
    torch.manual_seed(0)
    with torch.device(device):  # drawn on the device: the host takes minutes for 1.9 B normals
        state = {k: v.to("cpu") for k, v in transformers.LlamaForCausalLM(config).state_dict().items()}
    ids = torch.randint(0, config.vocab_size, (BATCH, seq), generator=torch.Generator().manual_seed(1)).to(device)
    output_dir = tempfile.mkdtemp(prefix="sp-gpu-claim-")
    rows = PeerRows(" ".join(["bench/peers/gpu_claim.py"] + sys.argv[1:]), "steps/s")
    started = time.perf_counter()

    def fresh(mode):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)
        model.model.rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        return add_lora(model) if mode == "lora" else model

    def streamed(mode, route, recompute):
        def make():
            model = fresh(mode).to(device)
            model.model.layers = sp.stream(model.model.layers, config=routes_config(route, config.num_hidden_layers),
                                           device=str(device), compute_dtype=BF16, output_dir=output_dir,
                                           recompute=recompute)
            return model
        return make

    results = {}
    for mode in args.modes:
        sides = {"resident": run_side("%s resident" % mode, lambda: fresh(mode).to(device), ids, device, args.steps),
                 "block swap": run_side("%s block swap" % mode, lambda: block_swap(fresh(mode), device), ids, device,
                                        args.steps)}
        for route in ("bf16", "int8", "nf4"):
            sides["sp.stream %s" % route.upper()] = run_side(
                "%s sp.stream %s" % (mode, route.upper()), streamed(mode, route, False), ids, device, args.steps,
                streamed=route)
        sides["sp.stream BF16 recompute"] = run_side(
            "%s sp.stream BF16 recompute" % mode, streamed(mode, "bf16", True), ids, device, args.steps,
            streamed="bf16")
        for label, side in sides.items():
            if not label.startswith("sp.stream"):
                continue
            for peer in ("resident", "block swap"):
                ours, theirs = side["median_step_ms"], sides[peer]["median_step_ms"]
                rows.append({"name": "%s %s step vs %s" % (mode, label, peer), "peer": peer,
                             "ours": round(1e3 / ours, 3), "theirs": round(1e3 / theirs, 3), "unit": rows.unit,
                             "ours_over_peer": round(theirs / ours, 3), "goal": None, "threads": None,
                             "command": rows.command})
        results[mode] = sides
    n_block = sum(v.numel() for k, v in state.items() if ".layers." in k)
    write_report(args.out, "gpu-claim", args.steps, rows, ("transformers",), commit=args.commit,
                 device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 model={**config_dict, "batch": BATCH, "seq": seq, "block_parameters": n_block,
                        "parameters": sum(v.numel() for v in state.values())},
                 lora={"rank": LORA_RANK, "targets": list(LORA_TARGETS)}, sides=results,
                 seconds=round(time.perf_counter() - started, 1))
    print("%d rows in %s" % (len(rows), args.out))


if __name__ == "__main__":
    main()
