"""Data parallelism from Python: torch.distributed's own Gloo group handed to the layer. Each
rank is a process of its own (data_parallel_worker.py), meeting the others through a file."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import selective_precision as sp

WORKER = os.path.join(os.path.dirname(__file__), "data_parallel_worker.py")
STEPS = 10


def run_ranks(tmp_path, mode, world, global_batch=8, extras=None):
    """Starts `world` ranks at once and returns each one's record; extras[rank]: the worker's
    last argument for that rank."""
    init = tmp_path / ("rendezvous-%s-%d" % (mode, world))
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / ("%s-%d-of-%d.json" % (mode, rank, world))
        args = [sys.executable, WORKER, str(rank), str(world), str(init), mode, str(global_batch), str(STEPS), str(out)]
        if extras and rank in extras:
            args.append(str(extras[rank]))
        procs.append(subprocess.Popen(args))
        outs.append(out)
    codes = [p.wait(timeout=120) for p in procs]
    return codes, [json.loads(o.read_text()) if o.exists() else None for o in outs]


def test_two_ranks_on_half_the_batch_decide_and_train_as_one_rank_on_all_of_it(tmp_path):
    codes, [one] = run_ranks(tmp_path, "none", 1)
    assert codes == [0]
    codes, (r0, r1) = run_ranks(tmp_path, "replicated", 2)
    assert codes == [0, 0]
    assert r0["losses"] == r1["losses"] and r0["routes"] == r1["routes"] and r0["head"] == r1["head"]
    assert r0["reduced_on"] == "cpu"
    assert r0["routes"] == one["routes"]
    assert any(route != "bf16" for step in one["routes"] for route in step), "no decision left BF16"
    # Rounding differs (a mean of two half-batch means, AdamW then amplifies it): equal to 1e-4.
    assert r0["losses"] == pytest.approx(one["losses"], rel=1e-4)
    # The host's own parameters were averaged: the head trained as one rank's did.
    assert r0["head"] == pytest.approx(one["head"], abs=1e-4)  # lr 1e-2: unaveraged, they differ by ~1e-2


def test_sharded_masters_train_exactly_as_replicated_ones(tmp_path):
    codes, replicated = run_ranks(tmp_path, "replicated", 2)
    assert codes == [0, 0]
    codes, sharded = run_ranks(tmp_path, "sharded", 2)
    assert codes == [0, 0]
    for rank in (0, 1):
        assert sharded[rank]["losses"] == replicated[rank]["losses"]
        assert sharded[rank]["routes"] == replicated[rank]["routes"]
        assert sharded[rank]["head"] == replicated[rank]["head"]
        assert sharded[rank]["owners"] == [0, 1, 0, 1]
        # Two masters per block (fc1, fc2); a sharded rank holds those of its two blocks.
        assert (replicated[rank]["masters"], sharded[rank]["masters"]) == (8, 4)
        # sp.stream(): a state dict of whole weights, or none at all (never empty tensors).
        assert (0,) not in [tuple(shape) for shape in replicated[rank]["stream_state_dict"]]
        assert sharded[rank]["stream_state_dict"].startswith(
            "selective_precision: streamed block 0 (Block): with shard_masters each rank holds only its own blocks'")
        assert (replicated[rank]["stream_exported_masters"], sharded[rank]["stream_exported_masters"]) == (8, 4)
        # Inside full_state_dict() the owners send their blocks: the same weights as replicated.
        assert sharded[rank]["stream_full_state_dict"] == replicated[rank]["stream_full_state_dict"]
        assert (0,) not in [tuple(shape) for shape in sharded[rank]["stream_full_state_dict"]]
        assert sharded[rank]["stream_full_checksum"] == replicated[rank]["stream_full_checksum"]
        for record in (replicated[rank], sharded[rank]):
            assert record["stream_reloaded_equal"] and record["stream_reloaded_output_equal"]
            assert "size mismatch for 1.fc1.weight" in record["stream_bad_load"]


def test_a_rank_that_dies_mid_step_stops_the_other_with_a_named_error(tmp_path):
    start = time.monotonic()
    codes, (survivor, _) = run_ranks(tmp_path, "replicated", 2, extras={1: 3})
    assert codes[1] == 3
    assert codes[0] == 0 and "error" in survivor, "the surviving rank did not see the collective fail"
    assert "rank 0 of 2" in survivor["error"]
    assert len(survivor["losses"]) == 3
    assert time.monotonic() - start < 60


def test_the_binding_lets_other_python_threads_run_while_it_waits_on_the_other_ranks(tmp_path):
    codes, (_, waiting) = run_ranks(tmp_path, "replicated", 2, extras={0: "gil", 1: "gil"})
    assert codes == [0, 0]
    assert waiting["rank0_thread_ran_during_post_backward"], "rank 0 held the GIL inside post_backward"


def test_a_process_group_that_is_not_one_is_refused_by_name():
    with pytest.raises(TypeError, match="process_group: expected a torch.distributed process group"):
        sp.StreamedBlocks([torch.nn.Linear(4, 4)], streamed=["weight"], process_group=object())


def test_on_a_gpu_a_group_with_nccl_reduces_the_gradients_there(tmp_path):
    """A group with a backend per device: the layer's own collectives take Gloo, the
    gradients NCCL on the GPU. One rank (a lent test machine has one GPU, and NCCL takes one
    rank per GPU): the same steps as without a group."""
    if not torch.cuda.is_available():
        if os.environ.get("SP_REQUIRE_GPU") == "1":
            pytest.fail("SP_REQUIRE_GPU=1, but torch sees no CUDA device")
        pytest.skip("torch sees no CUDA device")
    codes, [alone] = run_ranks(tmp_path, "none-gpu", 1)
    assert codes == [0]
    codes, [grouped] = run_ranks(tmp_path, "replicated-gpu", 1)
    assert codes == [0]
    assert (alone["reduced_on"], grouped["reduced_on"]) == ("cpu", "cuda:0")
    assert grouped["routes"] == alone["routes"]
    assert grouped["losses"] == pytest.approx(alone["losses"], rel=1e-5)

