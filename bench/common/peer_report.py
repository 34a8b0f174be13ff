"""What the peer benchmarks (bench/peers/) share: their rows, in the schema bench/run_peers.sh
gathers into peers.json, and the report they write."""

import json
import os
import platform

import torch

import selective_precision as sp


class PeerRows(list):
    """Rows {name, peer, ours, theirs, unit, ours_over_peer, goal, threads, command}, from two
    rates of the same work (higher is faster), printed as they come."""

    def __init__(self, command, unit):
        super().__init__()
        self.command, self.unit = command, unit

    def add(self, name, peer, ours, theirs, threads, goal):
        self.append({"name": name, "peer": peer, "ours": round(ours, 3), "theirs": round(theirs, 3),
                     "unit": self.unit, "ours_over_peer": round(ours / theirs, 3), "goal": goal,
                     "threads": threads, "command": self.command})
        print("%-44s %-40s %d thr  ours %8.2f  theirs %8.2f %s  ratio %5.2f (goal %.3g)"
              % (name, peer, threads, ours, theirs, self.unit, ours / theirs, goal), flush=True)


def routes_config(route, blocks):
    """A policy config that pins every one of `blocks` blocks to `route` ("bf16", "int8" or
    "nf4") from the first fetch on (ABI 1.3 initial hints): mode off for BF16, static with the
    blocks forced otherwise."""
    if route == "bf16":
        return {"mode": "off", "telemetry_enabled": False}
    return {"mode": "static", "telemetry_enabled": False, "tiers": ["bf16", "int8", "nf4"],
            "force_%s_blocks" % route: list(range(blocks))}


def write_report(path, benchmark, repeats, rows, peer_modules, **extra):
    """The report, written atomically: the machine, the versions of torch, ours and each peer
    module that imports, and the rows."""
    versions = {"torch": torch.__version__, "selective_precision": sp.__version__}
    for name in peer_modules:
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            pass
    report = {"benchmark": benchmark, "machine": {"cpu": platform.processor() or platform.machine(),
                                                  "cores": os.cpu_count()},
              "versions": versions, "repeats": repeats, **extra, "rows": list(rows)}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)
