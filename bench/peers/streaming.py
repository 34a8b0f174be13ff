"""The cost of streaming (issue 32, part 3): one training step (forward, backward, AdamW step) of
a Hugging Face LlamaForCausalLM on the CPU, resident against streamed, in one process, on the
same initial weights and batch, interleaved.

The model: hidden 512, intermediate 1376 (LLaMA's 8/3 ratio, rounded to 32), 8 heads of 64
(no grouped KV), 4 blocks, vocab 4096, untied head; batch 4 x 128 tokens. 12.6 M streamed
parameters (4 blocks of 3.16 M) and 4.2 M resident ones (embeddings and head), so the blocks
hold 75% of the weights and the machinery moves most of the model. On this CPU (AMX) the bf16
matmuls of such a step take tens of milliseconds; the step (0.3-0.5 s of CPU time on one
thread) is mostly the memory-bound work around them: casts, elementwise ops, attention, the
optimizer. Four blocks, not six, keep the whole run (seven sides, 1 and 2 threads) within about
5 minutes on the shared 2-core VM.

The sides (every one steps torch.optim.AdamW(fused=True, weight_decay=0.01) over
model.parameters(), fp32 masters and fp32 moments, except the pure-bf16 reference):
- resident fp32: plain PyTorch, fp32 weights, fp32 compute (no autocast);
- resident bf16: fp32 weights under torch.autocast("cpu", bfloat16): the matmuls in bf16, the
  same numbers as the block swap and the streamed BF16 side compute. This is the "resident bf16" the
  goals compare with (the fair one: same optimizer, same fp32 masters, same bf16 compute);
- resident pure bf16: model.to(torch.bfloat16), AdamW on the bf16 weights, no masters (a
  different, cheaper recipe: information only);
- block swap: what musubi-tuner, OneTrainer and sd-scripts write by hand (class SwappedBlock
  below): fp32 masters on the host; each block's forward and its recompute in the backward
  (torch.utils.checkpoint, non-reentrant) first copy_() the masters into bf16 compute copies
  allocated once (two sets, alternate blocks, as a swap double-buffers) and run the block on
  them (torch.func.functional_call); autograd takes the gradient through copy_ to the fp32
  master. Under the same bf16 autocast;
- block swap without recompute: the same copies, made fresh for each forward and kept by
  autograd for the backward (no checkpoint): each block's compute copy lives until its
  backward, so on a GPU it would hold every block's weights at once. The fastest a hand-written
  swap without recompute can be, and the peer of sp.stream's default;
- sp.stream(): the blocks streamed from their fp32 masters, compute_dtype=bfloat16, under the
  same autocast, with every block's route pinned (policy mode static with force_*_blocks, or
  mode off for BF16): BF16, INT8 and NF4; keeping the activations (the default), and with
  recompute=True (against the block swap with checkpointing).

--compute fp32: every side computes in fp32 (no autocast, sp.stream compute_dtype=float32, the
swap's copies fp32), and "resident fp32" is the resident side the goals compare with. For CPUs
without native bf16 matmuls (AVX-512-BF16 or AMX), where a bf16 step of this model takes about
25 times the fp32 one and would be all matmul.

Time per step is the wall-clock median of --repeats after two untimed steps per side (the
policy's forced routes take effect at the second), the sides interleaved within each repeat (each
repeat starting one side later); rate = steps/s, ours_over_peer > 1: ours is faster. The
process's CPU time per step (every thread, the layer's own included) is kept beside it: on a
shared VM it moves less than the wall clock. Each timed step is also split into its phases
(forward, backward, and the optimizer step with the layer's hooks on either side of the update)
for the "profile" section, and the streamed BF16 step, the resident bf16 one and the block
swap's are profiled by operator (torch.profiler, two steps) on the first thread count.

    PYTHONPATH=build/python HF_HUB_OFFLINE=1 .venv/bin/python bench/peers/streaming.py \
        --out bench/results/peers/streaming.json [--compute fp32]
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

COMMAND = "bash bench/run_peers.sh OUT_DIR (bench/peers/streaming.py)"
# Issue 32's goals: streamed BF16 within 10% of the resident bf16 step (ours/peer >= 1/1.10),
# and no slower than the hand-written block swap.
GOAL_VS_RESIDENT, GOAL_VS_SWAP = round(1 / 1.10, 3), 1.0
MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=128, use_cache=False, attn_implementation="sdpa",
             tie_word_embeddings=False)
BATCH, SEQ = 4, 128
LR, WEIGHT_DECAY = 1e-4, 0.01
BF16 = torch.bfloat16
PHASES_NOTE = (
    "median ms per phase of a timed step. forward: model(...) and the loss; backward: loss.backward(), "
    "with the blocks' recompute for the block swap and sp.stream; before_update: the optimizer's global "
    "pre-hooks, where the layer computes every streamed block's gradient moments (one pass over all their "
    "fp32 gradients) and takes the policy's hints, in every policy mode, 'off' and 'static' included; update: "
    "torch's fused AdamW over every parameter; after_update: the global post-hooks, where the layer rebuilds "
    "each block's transfer image from its updated masters (a second pass over the masters: a stock torch "
    "optimizer cannot write the image in its own sweep) and ends the policy's step")


class SwappedBlock(torch.nn.Module):
    """The hand-written block swap, as its authors write it for a GPU, here with the CPU as the
    compute device: the block's 2-D weights stay its fp32 masters; its forward, and its
    recompute in the backward, copy them into compute copies allocated once and run the block
    on those. The gradient reaches the masters through copy_. Without `compute` (no recompute),
    each forward copies into fresh tensors, which autograd keeps for the backward."""

    def __init__(self, block, compute, dtype):
        super().__init__()
        self.block = block
        self.masters = {n: p for n, p in block.named_parameters() if p.dim() == 2}
        self.compute = compute  # name -> tensor, shared with the blocks of the same parity; None: fresh
        self.dtype = dtype

    def forward(self, *args, **kwargs):
        if self.compute is None:
            return self._run(*args, **kwargs)
        return checkpoint(self._run, *args, use_reentrant=False, **kwargs)

    def _run(self, *args, **kwargs):
        if self.compute is None:
            weights = {n: m.to(self.dtype, copy=True) for n, m in self.masters.items()}
        else:
            # detach(): each copy starts a fresh history, so the backward does not carry the
            # previous block's use of the same buffer along with it.
            weights = {n: self.compute[n].detach().copy_(m) for n, m in self.masters.items()}
        return torch.func.functional_call(self.block, weights, args, kwargs)


def block_swap(model, dtype, recompute):
    block = model.model.layers[0]
    buffers = [{n: torch.empty(p.shape, dtype=dtype) for n, p in block.named_parameters() if p.dim() == 2}
               for _ in range(2)]
    model.model.layers = torch.nn.ModuleList(
        SwappedBlock(b, buffers[i % 2] if recompute else None, dtype) for i, b in enumerate(model.model.layers))
    return model


class Side:
    """One model and its optimizer; step() runs one training step and keeps its phases."""

    def __init__(self, label, model, autocast, streamed=None):
        self.label, self.model, self.autocast, self.streamed = label, model.train(), autocast, streamed
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.marks = {}
        # Per-optimizer hooks run after the global pre-hooks (the layer's gradient moments) and
        # before the global post-hooks (the layer's image rebuild and end of step).
        self.optimizer.register_step_pre_hook(lambda *a: self.marks.__setitem__("update_begin", time.perf_counter()))
        self.optimizer.register_step_post_hook(lambda *a: self.marks.__setitem__("update_end", time.perf_counter()))
        self.times, self.cpu_times, self.phases, self.losses = [], [], [], []

    def step(self, ids, record=True):
        c0, t0 = time.process_time(), time.perf_counter()
        with torch.autocast("cpu", dtype=BF16, enabled=self.autocast):
            loss = self.model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.optimizer.step()
        t3 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        t4, c4 = time.perf_counter(), time.process_time()
        self.losses.append(loss.item())
        if record:
            self.times.append(t4 - t0)
            self.cpu_times.append(c4 - c0)
            self.phases.append({"forward": t1 - t0, "backward": t2 - t1,
                                "before_update (layer's moments hook)": self.marks["update_begin"] - t2,
                                "update (AdamW fused)": self.marks["update_end"] - self.marks["update_begin"],
                                "after_update (layer's image rebuild, end of step)": t3 - self.marks["update_end"],
                                "zero_grad": t4 - t3})

    def median(self):
        return statistics.median(self.times)

    def phase_medians(self):
        return {k: round(statistics.median(p[k] for p in self.phases) * 1e3, 2) for k in self.phases[0]}


RESIDENT = {"bf16": "resident bf16 (autocast)", "fp32": "resident fp32"}
SWAP, SWAP_KEPT = "block swap", "block swap without recompute"


def make_sides(state, output_dir, compute):
    config = transformers.LlamaConfig(**MODEL)
    autocast, dtype = compute == "bf16", {"bf16": BF16, "fp32": torch.float32}[compute]

    def fresh():
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(state)
        return model

    sides = {"resident fp32": Side("resident fp32", fresh(), autocast=False)}
    if autocast:
        sides["resident bf16 (autocast)"] = Side("resident bf16 (autocast)", fresh(), autocast=True)
        sides["resident pure bf16"] = Side("resident pure bf16", fresh().to(BF16), autocast=False)
    sides[SWAP] = Side(SWAP, block_swap(fresh(), dtype, recompute=True), autocast=autocast)
    sides[SWAP_KEPT] = Side(SWAP_KEPT, block_swap(fresh(), dtype, recompute=False), autocast=autocast)
    for recompute in (False, True):
        for route in ("bf16", "int8", "nf4"):
            model = fresh()
            model.model.layers = sp.stream(model.model.layers,
                                           config=routes_config(route, config.num_hidden_layers), device="cpu",
                                           compute_dtype=dtype, output_dir=output_dir, recompute=recompute)
            label = streamed_label(route, recompute)
            sides[label] = Side(label, model, autocast=autocast, streamed=route)
    return sides


def streamed_label(route, recompute):
    return "sp.stream %s%s" % (route.upper(), " recompute" if recompute else "")


def operator_profile(side, ids, steps=2, top=14):
    """torch.profiler over `steps` steps: the operators with the most self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            side.step(ids, record=False)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"self_cpu_ms_per_step_all_ops": round(total / 1e3 / steps, 1),
            "top_ops": [{"op": e.key, "calls_per_step": e.count // steps,
                         "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2)}
                        for e in events[:top]]}


def phase_deltas(ours, peer):
    """Ours minus the peer, phase by phase (median ms), and the step's median."""
    out = {k: round(ours["phases_median_ms"][k] - peer["phases_median_ms"][k], 1) for k in ours["phases_median_ms"]}
    out["step"] = round(ours["median_step_ms"] - peer["median_step_ms"], 1)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-op-profile", action="store_true")
    parser.add_argument("--compute", choices=("bf16", "fp32"), default="bf16",
                        help="what every side computes in (fp32: for CPUs without native bf16 matmuls)")
    args = parser.parse_args()
    rows = PeerRows(" ".join([COMMAND] + sys.argv[1:]), "steps/s")

    def info(name, peer, ours_s, theirs_s, threads):
        """A row for information: no goal."""
        rows.append({"name": name, "peer": peer, "ours": round(1 / ours_s, 3), "theirs": round(1 / theirs_s, 3),
                     "unit": rows.unit, "ours_over_peer": round(theirs_s / ours_s, 3), "goal": None,
                     "threads": threads, "command": rows.command})
        print("%-44s %-40s %d thr  ours %8.2f  theirs %8.2f %s  ratio %5.2f (information)"
              % (name, peer, threads, 1 / ours_s, 1 / theirs_s, rows.unit, theirs_s / ours_s), flush=True)

    torch.manual_seed(0)
    state = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).state_dict()
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    per_threads, profiles, first_losses, routes, h2d = {}, {}, {}, {}, {}
    output_dir = tempfile.mkdtemp(prefix="sp-streaming-bench-")
    started, load_before = time.perf_counter(), os.getloadavg()
    for threads in args.threads:
        torch.set_num_threads(threads)
        sides = make_sides(state, output_dir, args.compute)
        for side in sides.values():  # two untimed steps, to warm up (the forced routes hold from the first)
            side.step(ids, record=False)
            side.step(ids, record=False)
            first_losses.setdefault(side.label, round(side.losses[0], 5))
        order = list(sides.values())
        for r in range(args.repeats):  # interleaved, each repeat starting one side later
            for side in order[r % len(order):] + order[:r % len(order)]:
                side.step(ids)
        for side in sides.values():
            if side.streamed:
                report = side.model.model.layers.last_report
                routes[side.label] = report.routes
                h2d[side.label] = {"h2d_bytes_per_step": report.h2d_bytes,
                                   "all_bf16_bytes_per_step": report.h2d_bytes_all_bf16}
                assert set(report.routes) == {side.streamed}, (side.label, report.routes)
        s = {label: side.median() for label, side in sides.items()}
        per_threads[threads] = {label: {"median_step_ms": round(t * 1e3, 1),
                                        "min_step_ms": round(min(sides[label].times) * 1e3, 1),
                                        "samples_ms": [round(x * 1e3, 1) for x in sides[label].times],
                                        "median_cpu_ms": round(statistics.median(sides[label].cpu_times) * 1e3, 1),
                                        "phases_median_ms": sides[label].phase_medians()} for label, t in s.items()}
        resident, swap = RESIDENT[args.compute], SWAP
        peer_resident = {"bf16": "resident bf16 (fp32 weights, bf16 autocast)",
                         "fp32": "resident fp32 (fp32 weights, fp32 compute)"}[args.compute]
        for route in ("bf16", "int8", "nf4"):
            ours, recomputing = streamed_label(route, False), streamed_label(route, True)
            rows.add("%s step vs %s" % (ours, resident), peer_resident, 1 / s[ours], 1 / s[resident], threads,
                     GOAL_VS_RESIDENT)
            rows.add("%s step vs block swap without recompute" % ours,
                     "hand-written block swap (fresh copies kept by autograd)", 1 / s[ours], 1 / s[SWAP_KEPT],
                     threads, GOAL_VS_SWAP)
            rows.add("%s step vs block swap" % recomputing, "hand-written block swap (copy_ + checkpoint)",
                     1 / s[recomputing], 1 / s[swap], threads, GOAL_VS_SWAP)
            info("%s step vs %s" % (ours, recomputing), "the same layer recomputing", s[ours], s[recomputing],
                 threads)
        if args.compute == "bf16":
            info("sp.stream BF16 step vs resident pure bf16", "resident pure bf16 (model.to(bf16))",
                 s["sp.stream BF16"], s["resident pure bf16"], threads)
            info("resident fp32 step vs resident bf16", peer_resident, s["resident fp32"], s[resident], threads)
        info("block swap step vs %s" % resident, peer_resident, s[swap], s[resident], threads)
        info("block swap without recompute step vs %s" % resident, peer_resident, s[SWAP_KEPT], s[resident],
             threads)
        if threads == args.threads[0] and not args.no_op_profile:
            for label in ("sp.stream BF16", resident, swap):
                profiles[label] = operator_profile(sides[label], ids)
        for side in sides.values():
            if side.streamed:
                side.model.model.layers.close()
        del sides
    elapsed = time.perf_counter() - started
    print("%.0f s" % elapsed)
    n_block = sum(p.numel() for n, p in transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL))
                  .model.layers.named_parameters())
    write_report(
        args.out, "peers-streaming", args.repeats, rows, ("transformers",),
        model={**MODEL, "batch": BATCH, "seq": SEQ, "block_parameters": n_block,
               "parameters": sum(v.numel() for v in state.values())},
        compute=(("every side but 'resident fp32' and 'resident pure bf16' keeps fp32 weights (masters) and "
                  "computes under torch.autocast('cpu', bfloat16); sp.stream with compute_dtype=bfloat16 "
                  "(its blocks get the delivered bf16, INT8- or NF4-dequantized weights)") if args.compute == "bf16"
                 else ("--compute fp32: every side keeps fp32 weights (masters) and computes in fp32; sp.stream "
                       "with compute_dtype=float32 (its blocks get the delivered bf16, INT8- or NF4-dequantized "
                       "weights converted to fp32); the goals' resident side is 'resident fp32'"))
                + "; the optimizer is torch.optim.AdamW(fused=True) over model.parameters() for every side",
        resident_bf16=("the goals' 'resident bf16' is fp32 weights under bf16 autocast (same optimizer, masters "
                       "and compute as the streamed side); model.to(bfloat16) with AdamW on bf16 weights is "
                       "'resident pure bf16', information only"),
        threads_note=("torch.set_num_threads(threads) for every side; the layer's own kernels (images, "
                      "dequantize) and its copy queue take their own threads (hardware_concurrency), not "
                      "torch's setting"),
        compute_mode=args.compute, first_step_loss=first_losses, routes=routes, transfer=h2d,
        steps={str(t): v for t, v in per_threads.items()},
        profile={"phases_note": PHASES_NOTE,
                 "phases": {str(t): {label: v["phases_median_ms"] for label, v in d.items()}
                            for t, d in per_threads.items()},
                 "sp.stream BF16 minus": {str(t): {peer: phase_deltas(d["sp.stream BF16"], d[peer])
                                                   for peer in (RESIDENT[args.compute], SWAP_KEPT)}
                                          for t, d in per_threads.items()},
                 "operators_%d_thread(s)" % args.threads[0]: profiles},
        seconds=round(elapsed, 1),
        load_average={"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in os.getloadavg()]})


if __name__ == "__main__":
    main()
