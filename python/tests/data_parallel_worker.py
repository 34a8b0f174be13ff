"""One rank of the data-parallel tests (test_data_parallel.py), run as its own process:

    data_parallel_worker.py RANK WORLD_SIZE INIT_FILE MODE GLOBAL_BATCH STEPS OUT_JSON [DIE_AT_STEP | gil]

MODE: none (one process, no group), replicated or sharded; with "-gpu" (none-gpu,
replicated-gpu) the model computes on the rank's GPU and the group is torch's
"cpu:gloo,cuda:nccl". Every rank draws the same global
batch each step and trains on its own contiguous share of the rows. Writes each step's mean
loss and routes, and the head's final weights, to OUT_JSON. DIE_AT_STEP: this rank leaves the
process in that step's backward, as a killed rank would. gil: in the last step, rank 1 enters
post_backward (a collective) only once a thread of rank 0 ran while rank 0's main thread was
inside its own post_backward, which needs the binding to release the GIL there (rank 0 switches
threads only where the GIL is released); it gives up after 20 s and records that.
"""

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import selective_precision as sp

DIM, HIDDEN, BLOCKS = 32, 64, 4
POLICY = (
    "selective_precision:\n  telemetry_enabled: false\n  mode: dynamic\n  warmup_steps: 2\n"
    "  update_interval_steps: 2\n  history_window: 2\n  min_steps_between_switches: 2\n"
    "  int8_threshold: 0.5\n  bf16_threshold: 0.7\n  quant_error_threshold: 1.0\n"
)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class Model(torch.nn.Module):
    """Blocks between two host parameters of its own, which the host's step must average."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(DIM, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = torch.nn.Linear(DIM, DIM)
        self.streamed = None

    def forward(self, x):
        return self.head(self.streamed(self.inp(x)))


def stream_state_dicts(group, sharded, rank):
    """sp.stream() on the same group: its state dict is whole when replicated; sharded, refused
    (it would hold empty tensors for the other ranks' blocks) except inside full_state_dict(),
    where each owner sends its blocks. Such a whole state dict loads into another sharded model
    (each rank keeps its own blocks) that then computes as the first; a wrong shape is refused
    by name on every rank."""
    def streamed(seed):
        torch.manual_seed(seed)
        return sp.stream(torch.nn.ModuleList(Block() for _ in range(BLOCKS)), config=POLICY, process_group=group,
                         shard_masters=sharded)

    def run(layers, x):
        with torch.no_grad():
            for block in layers:
                x = block(x)
        return x

    record = {}
    layers = streamed(12)
    try:
        record["stream_state_dict"] = sorted({tuple(v.shape) for v in layers.state_dict().values()})
    except RuntimeError as e:
        record["stream_state_dict"] = str(e)
    record["stream_exported_masters"] = len([k for k in layers.export_state() if k.startswith("master/")])
    with layers.full_state_dict():
        whole = layers.state_dict()
    weights = {k: v for k, v in whole.items() if not k.endswith("_extra_state")}
    record["stream_full_state_dict"] = sorted({tuple(v.shape) for v in weights.values()})
    record["stream_full_checksum"] = float(sum(v.double().sum() for v in weights.values()))
    other = streamed(13 + rank)
    other.load_state_dict(whole)
    with other.full_state_dict():
        again = other.state_dict()
    record["stream_reloaded_equal"] = all(torch.equal(v, again[k]) for k, v in weights.items())
    x = torch.randn(2, 8, DIM, generator=torch.Generator().manual_seed(5))
    record["stream_reloaded_output_equal"] = torch.equal(run(layers, x), run(other, x))
    bad = dict(whole)
    bad["1.fc1.weight"] = torch.zeros(3, 3)
    try:
        other.load_state_dict(bad)
        record["stream_bad_load"] = None
    except RuntimeError as e:
        record["stream_bad_load"] = str(e)
    layers.close()
    other.close()
    return record


def main():
    rank, world, init_file, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    global_batch, steps, out = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
    extra = sys.argv[8] if len(sys.argv) > 8 else ""
    die_at = int(extra) if extra.isdigit() else -1
    go_file = init_file + ".go"
    inside = threading.Event()
    if extra == "gil" and rank == 0:
        sys.setswitchinterval(100.0)  # the main thread yields the GIL only where it releases it

        def signal_when_inside():
            while not inside.is_set():
                time.sleep(0.001)
            with open(go_file, "w", encoding="utf-8"):
                pass

        threading.Thread(target=signal_when_inside, daemon=True).start()
    torch.set_num_threads(1)
    mode, gpu = mode.replace("-gpu", ""), mode.endswith("-gpu")
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    group = None
    if mode != "none":
        # The ranks start as separate interpreters, and under a loaded ctest -j one may import torch
        # many seconds after the other: the rendezvous waits up to a minute, not 20 s. A rank that
        # dies is seen at once (its sockets close), not at this timeout.
        dist.init_process_group("cpu:gloo,cuda:nccl" if gpu else "gloo", init_method="file://" + init_file,
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
        group = dist.group.WORLD
    torch.manual_seed(11)
    model = Model().to(device)
    model.streamed = sp.StreamedBlocks(model.blocks, streamed=["fc1.weight", "fc2.weight"], config=POLICY,
                                       device=device, process_group=group, shard_masters=mode == "sharded")
    optimizer = torch.optim.AdamW(model.streamed.optimizer_parameters(model), lr=1e-2)
    share = global_batch // world
    record = {"losses": [], "routes": [], "masters": len(model.streamed.master_parameters()),
              "owners": [model.streamed.owner(b) for b in range(BLOCKS)],
              "reduced_on": str(model.streamed.gradient_reduction_device)}
    try:
        for step in range(steps):
            generator = torch.Generator().manual_seed(100 + step)
            x = torch.randn(global_batch, 8, DIM, generator=generator).to(device)
            target = torch.randn(global_batch, 8, DIM, generator=generator).to(device)
            rows = slice(rank * share, (rank + 1) * share)
            with model.streamed.step(step, optimizer) as s:
                s.loss = torch.nn.functional.mse_loss(model(x[rows]), target[rows])
                if step == die_at:
                    os._exit(3)
                s.loss.backward()
                if extra == "gil" and step == steps - 1:
                    # torch's own calls release the GIL (loss.item() in step()): none may come
                    # between the signal and post_backward.
                    s.loss = s.loss.item()
                    if rank == 0:
                        inside.set()  # checked by the thread only once this one releases the GIL
                    else:
                        deadline = time.monotonic() + 20
                        while not os.path.exists(go_file) and time.monotonic() < deadline:
                            time.sleep(0.01)
                        record["rank0_thread_ran_during_post_backward"] = os.path.exists(go_file)
            record["losses"].append(s.loss_mean)
            record["routes"].append(s.report.routes)
    except sp.CollectiveError as e:
        record["error"] = str(e)
    record["head"] = model.head.weight.detach().cpu().flatten().tolist()
    if mode != "none" and not gpu and "error" not in record:
        record.update(stream_state_dicts(group, mode == "sharded", rank))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(record, f)
    model.streamed.close()


if __name__ == "__main__":
    main()
