"""Two builds of the package against each other on bench/peers/streaming.py's model: whether a
change to the layer costs step time. Each round runs one process per build, alternating A, B,
A, B, ...; each process steps three sides interleaved (resident fp32, sp.stream BF16 keeping
its activations, sp.stream BF16 with recompute=True) on one torch thread with fp32 compute.

A side's figure is its step time over the resident step's in the same repeat (paired, so the
machine's drift between processes cancels), pooled over the rounds; the result is B's median
ratio over A's with a 95% bootstrap interval, per phase (step, forward, backward). The noise
floor is the spread between rounds of the same build: rounds_a/rounds_b hold each round's
median.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/peers/streaming_ab.py \\
        --a OLD_BUILD/python --b NEW_BUILD/python --plugins NEW_BUILD/plugins --out ab.json

(--a/--b: the folder holding the selective_precision package of each build, put first on
PYTHONPATH; --plugins: one plugin folder for both, so only the layer differs.)
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

SIDES = ("resident fp32", "sp.stream BF16", "sp.stream BF16 recompute")
PHASES = ("step", "forward", "backward")


def run_one(repeats, out):
    """In the child: the three sides, `repeats` interleaved steps each, times written to `out`."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch

    import streaming as bench

    torch.set_num_threads(1)
    torch.manual_seed(0)
    state = bench.transformers.LlamaForCausalLM(bench.transformers.LlamaConfig(**bench.MODEL)).state_dict()
    ids = torch.randint(0, bench.MODEL["vocab_size"], (bench.BATCH, bench.SEQ),
                        generator=torch.Generator().manual_seed(1))
    sides = bench.make_sides(state, tempfile.mkdtemp(prefix="sp-streaming-ab-"), "fp32")
    for name in list(sides):
        if name not in SIDES:
            if sides[name].streamed:
                sides[name].model.model.layers.close()
            del sides[name]
    for side in sides.values():
        side.step(ids, record=False)
        side.step(ids, record=False)
    order = [sides[name] for name in SIDES]
    for r in range(repeats):
        for side in order[r % len(order):] + order[:r % len(order)]:
            side.step(ids)
    with open(out, "w", encoding="utf-8") as f:
        json.dump({name: {"step": sides[name].times,
                          "forward": [p["forward"] for p in sides[name].phases],
                          "backward": [p["backward"] for p in sides[name].phases]} for name in SIDES}, f)


def ratios(runs, side, phase):
    """Per repeat, the side's phase time over the resident side's, pooled over the runs."""
    return [x / y for run in runs for x, y in zip(run[side][phase], run[SIDES[0]][phase])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="build A's package folder (put first on PYTHONPATH)")
    parser.add_argument("--b", required=True, help="build B's package folder")
    parser.add_argument("--plugins", required=True, help="the plugin folder both builds load (SP_PLUGIN_DIR)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_one(args.repeats, args.child)
        return
    runs = {"a": [], "b": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="sp-streaming-ab-") as scratch:
        for round_ in range(args.rounds):
            for build in ("a", "b"):
                out = os.path.join(scratch, "%s-%d.json" % (build, round_))
                env = dict(os.environ, PYTHONPATH=getattr(args, build), SP_PLUGIN_DIR=args.plugins)
                subprocess.run([sys.executable, os.path.abspath(__file__), "--a", args.a, "--b", args.b,
                                "--plugins", args.plugins, "--out", args.out, "--repeats", str(args.repeats),
                                "--child", out], env=env, check=True)
                with open(out, encoding="utf-8") as f:
                    runs[build].append(json.load(f))
                print("round %d, build %s: done (%.0f s)" % (round_ + 1, build, time.perf_counter() - started),
                      flush=True)
    rng = random.Random(0)
    result = {}
    for side in SIDES[1:]:
        for phase in PHASES:
            a, b = ratios(runs["a"], side, phase), ratios(runs["b"], side, phase)
            boots = sorted(statistics.median(rng.choices(b, k=len(b))) / statistics.median(rng.choices(a, k=len(a)))
                           for _ in range(4000))
            result["%s: %s" % (side, phase)] = {
                "a_over_resident": round(statistics.median(a), 4), "b_over_resident": round(statistics.median(b), 4),
                "b_over_a": round(statistics.median(b) / statistics.median(a), 4),
                "b_over_a_ci95": [round(boots[99], 4), round(boots[3899], 4)],
                "rounds_a": [round(statistics.median(ratios([r], side, phase)), 4) for r in runs["a"]],
                "rounds_b": [round(statistics.median(ratios([r], side, phase)), 4) for r in runs["b"]]}
            print("%-28s %-8s A %.3f  B %.3f  B/A %.3f [%.3f, %.3f]" % (
                side, phase, statistics.median(a), statistics.median(b), result["%s: %s" % (side, phase)]["b_over_a"],
                boots[99], boots[3899]), flush=True)
    report = {"benchmark": "streaming-ab", "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "a": args.a, "b": args.b, "rounds": args.rounds, "repeats": args.repeats, "threads": 1,
              "compute": "fp32", "load_average_after": os.getloadavg(), "seconds": round(time.perf_counter() - started),
              "results": result}
    tmp = args.out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
