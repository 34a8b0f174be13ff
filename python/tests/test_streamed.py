"""The Python module over the LibTorch layer: the same decisions as the C++ layer, gradients
into the masters, a stock optimizer, and named errors instead of crashes."""

import copy
import json
import os
import subprocess

import pytest
import torch

import selective_precision as sp

DIM, HIDDEN, BLOCKS, STEPS, LR = 32, 64, 3, 12, 0.05
POLICY = (
    "selective_precision:\n  telemetry_enabled: false\n  mode: dynamic\n  warmup_steps: 2\n"
    "  update_interval_steps: 2\n  history_window: 2\n  min_steps_between_switches: 2\n"
    "  int8_threshold: 0.5\n  bf16_threshold: 0.7\n  quant_error_threshold: 1.0\n"
)


class ReferenceBlock(torch.nn.Module):
    """torch_layer/tests/reference_run.cpp's block: the same parameters from the same draws."""

    def __init__(self):
        super().__init__()
        self.register_parameter("ln_weight", torch.nn.Parameter(torch.ones(DIM)))
        self.register_parameter("ln_bias", torch.nn.Parameter(torch.zeros(DIM)))
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.randn(HIDDEN, DIM) * 0.1)
            self.fc1.bias.zero_()
            self.fc2.weight.copy_(torch.randn(DIM, HIDDEN) * 0.1)
            self.fc2.bias.zero_()

    def forward(self, x):
        h = torch.nn.functional.layer_norm(x, (DIM,), self.ln_weight, self.ln_bias)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def wrap(blocks, policy=POLICY, **options):
    return sp.StreamedBlocks(blocks, streamed=["fc1.weight", "fc2.weight"], config=policy, **options)


def test_the_python_run_takes_the_cpp_layers_decisions(tmp_path):
    reference = os.environ.get("SP_TORCH_LAYER_REFERENCE")
    if not reference:
        pytest.skip("needs the C++ layer's own run: SP_TORCH_LAYER_REFERENCE=<build>/bin/sp_torch_layer_reference "
                    "(ctest and scripts/test.sh set it)")
    out = tmp_path / "cpp.json"
    plugin = os.path.join(sp.default_plugin_dir(), "libsp_selective_precision.so")
    subprocess.run([reference, plugin, str(out)], check=True)
    cpp = json.loads(out.read_text())

    # Linear's own init draws first in Python; the block then draws the C++ run's numbers.
    torch.manual_seed(7)
    blocks = []
    state = torch.get_rng_state()
    for _ in range(BLOCKS):
        block = _draw_block_like_cpp(state)
        state = torch.get_rng_state()
        blocks.append(block)
    streamed = wrap(torch.nn.ModuleList(blocks))
    params = list(streamed.master_parameters()) + list(streamed.resident_parameters())
    losses, routes = [], []
    for step in range(STEPS):
        torch.manual_seed(1000 + step)
        x = torch.randn(4, 8, DIM)
        target = torch.randn(4, 8, DIM)
        streamed.begin_step(step)
        loss = torch.nn.functional.mse_loss(streamed(x), target)
        loss.backward()
        streamed.post_backward()
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
                    p.grad.zero_()
        report = streamed.end_step(loss.item())
        losses.append(loss.item())
        routes.append(report.routes)
    assert routes == cpp["routes"]
    assert any(r != "bf16" for step in routes for r in step), "the compared decisions never left BF16"
    assert losses == pytest.approx(cpp["losses"], rel=1e-6)


def _draw_block_like_cpp(state):
    """A block whose parameters are drawn exactly as the C++ module's constructor draws them,
    from generator state `state` (Linear's own initialization draws are overwritten)."""
    block = ReferenceBlock()
    torch.set_rng_state(state)
    w1 = torch.randn(HIDDEN, DIM) * 0.1
    w2 = torch.randn(DIM, HIDDEN) * 0.1
    with torch.no_grad():
        block.fc1.weight.copy_(w1)
        block.fc2.weight.copy_(w2)
    return block


def test_gradients_reach_the_masters_and_a_stock_optimizer_trains(tmp_path):
    torch.manual_seed(3)
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(BLOCKS))
    streamed = wrap(model, policy="selective_precision:\n  telemetry_enabled: false\n  mode: off\n")
    optimizer = torch.optim.AdamW(streamed.optimizer_parameters(model), lr=1e-2)
    x, target = torch.randn(4, 8, DIM), torch.zeros(4, 8, DIM)
    first = last = None
    for step in range(8):
        with streamed.step(step, optimizer) as s:
            s.loss = torch.nn.functional.mse_loss(streamed(x), target)
            s.loss.backward()
            if step == 0:
                for master in streamed.master_parameters():
                    assert master.grad is not None and master.grad.abs().sum() > 0
                assert model[0].ln_weight.grad is not None, "resident parameters get theirs from autograd"
        first = first if first is not None else s.loss.item()
        last = s.loss.item()
        assert s.report.h2d_bytes_bf16 > 0
        assert (s.report.h2d_bytes, s.report.saved_fraction) == (s.report.h2d_bytes_all_bf16, 0.0)  # mode off
    assert last < 0.8 * first
    assert streamed.masters(0)["fc1.weight"].dtype == torch.float32


def test_step_and_the_optimizer_hooks_give_post_backward_the_steps_loss():
    """StreamedBlocks.step() and stream()'s optimizer hooks run one step sequence, sp-train's
    (StreamedModel::prepare_update): the loss's mean reaches post_backward (the policy's loss
    budget reads it there) and end_step alike."""

    class Recording:
        def __init__(self, model):
            self.model, self.calls = model, []

        def __getattr__(self, name):
            return getattr(self.model, name)

        def prepare_update(self, rest_to_average, loss):
            mean, moments = self.model.prepare_update(rest_to_average, loss)
            self.calls.append(("prepare_update", loss, mean))  # mean: what post_backward took
            return mean, moments

        def end_step(self, loss):
            self.calls.append(("end_step", loss))
            return self.model.end_step(loss)

    torch.manual_seed(3)
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(BLOCKS))
    streamed = wrap(model, policy="selective_precision:\n  telemetry_enabled: false\n  mode: off\n")
    recording = streamed._model = Recording(streamed._model)
    optimizer = torch.optim.SGD(streamed.optimizer_parameters(model), lr=1e-2)
    x, target = torch.randn(4, 8, DIM), torch.zeros(4, 8, DIM)
    with streamed.step(0, optimizer) as s:
        s.loss = torch.nn.functional.mse_loss(streamed(x), target)
        s.loss.backward()
    expected = pytest.approx(s.loss.item())
    assert recording.calls == [("prepare_update", expected, expected), ("end_step", expected)]

    torch.manual_seed(3)
    layers = sp.stream(torch.nn.ModuleList(ReferenceBlock() for _ in range(BLOCKS)), streamed=["fc1.weight"],
                       config="selective_precision:\n  telemetry_enabled: false\n  mode: off\n")
    recording = layers._layer().model = Recording(layers._layer().model)
    optimizer = torch.optim.SGD(layers.parameters(), lr=1e-2)
    h = x
    for block in layers:
        h = block(h)
    loss = torch.nn.functional.mse_loss(h, target)
    loss.backward()
    layers.report_loss(loss)
    optimizer.step()
    expected = pytest.approx(loss.item())
    assert recording.calls == [("prepare_update", expected, expected), ("end_step", expected)]


def test_the_report_and_the_errors_carry_every_route_the_binding_names():
    """The report and the calibration errors are the C++ API's own (bound once, no second
    declaration): their bytes and errors are per route of the build's route table, and each
    route has its named shortcut from that table, so a route added in C++ needs no edit here."""
    from selective_precision._selective_precision import _QUANTIZED_ROUTES, _ROUTES

    torch.manual_seed(3)
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(BLOCKS))
    streamed = wrap(model)
    optimizer = torch.optim.SGD(streamed.optimizer_parameters(model), lr=1e-2)
    with streamed.step(0, optimizer) as s:
        s.loss = streamed(torch.randn(4, 8, DIM)).square().mean()
        s.loss.backward()
    report = s.report
    assert isinstance(report, sp.StepReport) and report.step == 0
    assert list(report.h2d_bytes_by_route) == list(_ROUTES)
    assert all(getattr(report, "h2d_bytes_" + r) == report.h2d_bytes_by_route[r] for r in _ROUTES)
    assert report.h2d_bytes == sum(report.h2d_bytes_by_route.values()) > 0
    assert report.saved_fraction == pytest.approx(1 - report.h2d_bytes / report.h2d_bytes_all_bf16)
    assert report.routes == report.block_routes == streamed.routes()  # without units, one per block
    assert report.swap is None and report.calibration is None and report.updates_skipped == []
    assert "StepReport(step=0" in repr(report)
    with pytest.raises(AttributeError):
        report.step = 1  # read-only, as the frozen dataclass it replaces
    errors = streamed.calibrate([torch.randn(4, 8, DIM)])
    assert isinstance(errors, sp.CalibrationErrors) and list(errors.by_route) == list(_QUANTIZED_ROUTES)
    assert all(getattr(errors, r) == errors.by_route[r] and len(errors.by_route[r]) == BLOCKS for r in _QUANTIZED_ROUTES)


def test_a_replaced_parameter_is_refused_not_read():
    torch.manual_seed(4)
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(2))
    streamed = wrap(model)
    model[1].fc2.weight = torch.nn.Parameter(torch.randn(DIM, HIDDEN))
    with torch.no_grad(), pytest.raises(RuntimeError, match="fc2.weight' was replaced"):
        streamed(torch.randn(2, 4, DIM))


def test_bad_inputs_raise_named_exceptions(tmp_path):
    torch.manual_seed(5)
    with pytest.raises(ValueError, match="module list is empty"):
        sp.StreamedBlocks(torch.nn.ModuleList())
    with pytest.raises(ValueError, match="streams no parameter"):
        sp.StreamedBlocks([torch.nn.ReLU()], streamed=[])
    with pytest.raises(ValueError, match="has no parameter 'fc3.weight'"):
        sp.StreamedBlocks([ReferenceBlock()], streamed=["fc3.weight"])
    integer = torch.nn.Module()
    integer.register_buffer("unused", torch.zeros(1))
    integer.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int32), requires_grad=False)
    with pytest.raises(ValueError, match="floating-point"):
        sp.StreamedBlocks([integer], streamed=["weight"])
    with pytest.raises(sp.PluginError):
        sp.StreamedBlocks([ReferenceBlock()], plugin_dir=str(tmp_path))
    with pytest.raises(sp.PluginError, match="int8_threshold"):
        wrap([ReferenceBlock()], policy="selective_precision:\n  int8_threshold: high\n")
    streamed = wrap([ReferenceBlock()])
    with pytest.raises(ValueError, match="precision 'fp8'"):
        streamed.image_bytes(0, "fp8")
    with pytest.raises(RuntimeError, match="no step is active"):
        streamed(torch.randn(2, 4, DIM))
    streamed.close()
    assert streamed.closed
    with pytest.raises(RuntimeError, match="StreamedModel is closed"):
        streamed.routes()


def test_state_round_trips_through_torch_save(tmp_path):
    torch.manual_seed(6)
    policy = "selective_precision:\n  telemetry_enabled: false\n  mode: static\n  tiers: [bf16, int8, nf4]\n  force_nf4_blocks: [1]\n"
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(2))
    streamed = wrap(model, policy=policy)
    optimizer = torch.optim.SGD(streamed.optimizer_parameters(model), lr=0.1)
    for step in range(2):
        with streamed.step(step, optimizer) as s:
            s.loss = streamed(torch.randn(2, 4, DIM)).pow(2).mean()
            s.loss.backward()
    torch.save(streamed.export_state(), tmp_path / "state.pt")
    fresh = wrap(torch.nn.ModuleList(ReferenceBlock() for _ in range(2)), policy=policy)
    fresh.restore_state(torch.load(tmp_path / "state.pt"))
    assert fresh.routes() == streamed.routes() == ["bf16", "nf4"]
    assert torch.equal(fresh.masters(1)["fc2.weight"], streamed.masters(1)["fc2.weight"])
    broken = torch.load(tmp_path / "state.pt")
    del broken["policy/state"]
    with pytest.raises(sp.StateEntryError, match="policy/state"):
        fresh.restore_state(broken)


def test_an_exception_inside_a_step_leaves_the_model_usable():
    torch.manual_seed(8)
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(2))
    streamed = wrap(model, policy="selective_precision:\n  telemetry_enabled: false\n  mode: off\n")
    optimizer = torch.optim.SGD(streamed.optimizer_parameters(model), lr=0.1)
    with pytest.raises(KeyError):
        with streamed.step(0, optimizer) as s:
            s.loss = streamed(torch.randn(2, 4, DIM)).pow(2).mean()
            raise KeyError("the script failed mid-step")
    assert all(m.grad is None for m in streamed.master_parameters())
    with streamed.step(1, optimizer) as s:
        s.loss = streamed(torch.randn(2, 4, DIM)).pow(2).mean()
        s.loss.backward()
    assert s.report.training_passes == 1


def test_a_graph_that_outlives_its_model_is_refused():
    torch.manual_seed(9)
    streamed = wrap(torch.nn.ModuleList(ReferenceBlock() for _ in range(2)))
    streamed.begin_step(0)
    loss = streamed(torch.randn(2, 4, DIM)).pow(2).mean()
    streamed.close()
    with pytest.raises(RuntimeError, match="destroyed or closed"):
        loss.backward()


OFF = "selective_precision:\n  telemetry_enabled: false\n  mode: off\n"


def _train_step(streamed, step, x):
    with streamed.step(step) as s:
        s.loss = streamed(x).pow(2).mean()
        s.loss.backward()
    return s


def test_steps_that_do_not_increase_are_refused_by_name_across_a_resume():
    """A count restarted at 0 each epoch, or after a resume, is refused before the policy
    sees it (it used to be logged while the policy stopped deciding)."""
    torch.manual_seed(10)
    streamed = wrap(torch.nn.ModuleList(ReferenceBlock() for _ in range(2)), policy=OFF)
    x = torch.randn(2, 4, DIM)
    _train_step(streamed, 3, x)
    with pytest.raises(ValueError, match=r"begin_step\(0\): step 3 already began, and steps must increase"):
        _train_step(streamed, 0, x)
    _train_step(streamed, 4, x)  # the refusal left no step open
    resumed = wrap(torch.nn.ModuleList(ReferenceBlock() for _ in range(2)), policy=OFF)
    resumed.restore_state(streamed.export_state())
    with pytest.raises(ValueError, match="go on from step 5"):
        resumed.begin_step(4)
    _train_step(resumed, 5, x)


def test_a_step_without_a_backward_is_refused_and_dropped():
    torch.manual_seed(11)
    streamed = wrap(torch.nn.ModuleList(ReferenceBlock() for _ in range(2)), policy=OFF)
    with pytest.raises(RuntimeError, match="no block has a gradient in step 0: no backward ran"):
        with streamed.step(0) as s:
            s.loss = streamed(torch.randn(2, 4, DIM)).pow(2).mean()  # no backward
    assert _train_step(streamed, 1, torch.randn(2, 4, DIM)).report.training_passes == 1


def test_a_parameter_shared_by_two_blocks_is_refused_naming_both():
    torch.manual_seed(12)
    blocks = [ReferenceBlock(), ReferenceBlock()]
    blocks[1].ln_weight = blocks[0].ln_weight
    with pytest.raises(ValueError, match="block1's 'ln_weight' is block0's 'ln_weight' too"):
        wrap(torch.nn.ModuleList(blocks))


def test_the_config_is_a_path_yaml_text_or_a_mapping(tmp_path):
    torch.manual_seed(13)
    missing = tmp_path / "policy" / "dynamic_v3.yaml"
    for config in (str(missing), missing):
        with pytest.raises(FileNotFoundError, match="dynamic_v3.yaml"):
            sp.StreamedBlocks([ReferenceBlock()], config=config)
    static = {"telemetry_enabled": False, "mode": "static", "tiers": ["bf16", "int8"], "force_int8_blocks": [1]}
    as_file = tmp_path / "static.yaml"
    as_file.write_text("selective_precision:\n  telemetry_enabled: false\n  mode: static\n"
                       "  tiers: [bf16, int8]\n  force_int8_blocks: [1]\n")
    for config in (static, {"selective_precision": static}, as_file, str(as_file), as_file.read_text()):
        streamed = sp.StreamedBlocks([ReferenceBlock(), ReferenceBlock()], config=config)
        _train_step(streamed, 0, torch.randn(2, 4, DIM))  # the plugin's first hints
        assert streamed.routes() == ["bf16", "int8"], config
    with pytest.raises(TypeError, match="config: a mapping of the policy's keys"):
        sp.StreamedBlocks([ReferenceBlock()], config={"mode": object()})
    with pytest.raises(TypeError, match="config: a path, YAML text or a mapping expected, got int"):
        sp.StreamedBlocks([ReferenceBlock()], config=3)


def test_an_optimizer_stepped_after_the_step_ended_is_streamed_from_the_next_pass():
    """step() without the optimizer, then optimizer.step(): the images were rebuilt before the
    update, and the next pass notices the masters' new versions and rebuilds them again (it used
    to train on the old weights, then to refuse)."""
    torch.manual_seed(14)
    model = torch.nn.ModuleList(ReferenceBlock() for _ in range(2))
    streamed = wrap(model, policy=OFF)
    optimizer = torch.optim.SGD(streamed.optimizer_parameters(model), lr=0.5)
    x = torch.randn(2, 4, DIM)
    _train_step(streamed, 0, x)
    with torch.no_grad():
        before = streamed(x)
    optimizer.step()
    with torch.no_grad():
        after = streamed(x)
    assert not torch.equal(before, after)
    h = x
    with torch.no_grad():
        for b, block in enumerate(model):
            twin = ReferenceBlock()
            for name, p in twin.named_parameters():
                master = streamed.masters(b).get(name)
                p.copy_(master.bfloat16().float() if master is not None else block.get_parameter(name))
            h = twin(h)
    torch.testing.assert_close(after, h, rtol=1e-5, atol=1e-6)
    _train_step(streamed, 1, x)


def test_the_layers_and_the_plugins_messages_go_to_pythons_logging(caplog, capfd):
    import logging

    torch.manual_seed(15)
    with caplog.at_level(logging.INFO, logger="selective_precision"):
        streamed = wrap(torch.nn.ModuleList(ReferenceBlock() for _ in range(2)), policy=OFF)
        _train_step(streamed, 0, torch.randn(2, 4, DIM))
        streamed.close()
    import re

    created = [r for r in caplog.records if re.search(r"policy v\d+\.\d+\.\d+ created", r.getMessage())]
    assert created and created[0].name == "selective_precision" and created[0].levelno == logging.INFO
    assert " created from " not in capfd.readouterr().out, "the plugin's message also went to stdout"


class GatedBlock(ReferenceBlock):
    """A block that reads a tensor requiring a gradient without registering it."""

    def __init__(self, gate):
        super().__init__()
        self.gate = gate  # a plain attribute: not one of named_parameters()

    def forward(self, x):
        return super().forward(x) * self.gate


def test_a_tensor_a_block_reads_without_registering_it_gets_its_gradient_as_in_plain_pytorch():
    torch.manual_seed(16)
    gate = torch.full((DIM,), 0.9, requires_grad=True)
    blocks = torch.nn.ModuleList(GatedBlock(gate) for _ in range(2))
    plain = [GatedBlock(gate) for _ in range(2)]
    for twin, block in zip(plain, blocks):
        twin.load_state_dict(block.state_dict())
    streamed = wrap(blocks, policy=OFF)
    x = torch.randn(2, 4, DIM)
    _train_step(streamed, 0, x)
    assert gate.grad is not None, "the gate got no gradient"
    got, gate.grad = gate.grad.clone(), None
    with torch.no_grad():  # the BF16 weights the streamed blocks computed with
        for twin in plain:
            for name in ("fc1.weight", "fc2.weight"):
                twin.get_parameter(name).copy_(twin.get_parameter(name).to(torch.bfloat16).float())
    h = x
    for twin in plain:
        h = twin(h)
    h.pow(2).mean().backward()
    torch.testing.assert_close(got, gate.grad, rtol=1e-4, atol=1e-6)


class TwoBlockModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(ReferenceBlock() for _ in range(2))
        self.head = torch.nn.Linear(DIM, DIM)


def test_state_dicts_hold_the_masters_and_round_trip_with_a_plain_model(tmp_path):
    """The streamed weights' placeholders are empty; the model's state_dict() holds the fp32
    masters under the same keys, and load_state_dict() goes both ways."""
    torch.manual_seed(17)
    model = TwoBlockModel()
    keys = list(model.state_dict())
    streamed = wrap(model.blocks, policy=OFF)
    optimizer = torch.optim.SGD(streamed.optimizer_parameters(model), lr=0.1)
    for step in range(2):
        with streamed.step(step, optimizer) as s:
            s.loss = model.head(streamed(torch.randn(2, 4, DIM))).pow(2).mean()
            s.loss.backward()
    saved = model.state_dict()
    assert list(saved) == keys
    assert saved["blocks.1.fc2.weight"].shape == (DIM, HIDDEN)
    assert torch.equal(saved["blocks.1.fc2.weight"], streamed.masters(1)["fc2.weight"])
    torch.save(saved, tmp_path / "model.pt")

    plain = TwoBlockModel()
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))  # strict: every key, every shape
    assert torch.equal(plain.blocks[1].fc2.weight, streamed.masters(1)["fc2.weight"])

    # The other way: a plain model's weights into a streamed one, whose next pass streams them.
    other = TwoBlockModel()
    other_streamed = wrap(other.blocks, policy=OFF)
    other.load_state_dict(plain.state_dict())
    assert torch.equal(other_streamed.masters(0)["fc1.weight"], plain.blocks[0].fc1.weight)
    x = torch.randn(2, 4, DIM)
    with torch.no_grad():
        for name in ("fc1.weight", "fc2.weight"):  # the BF16 weights the streamed pass computes with
            for block in plain.blocks:
                block.get_parameter(name).copy_(block.get_parameter(name).to(torch.bfloat16).float())
        torch.testing.assert_close(other_streamed(x), plain.blocks[1](plain.blocks[0](x)))
    _train_step(other_streamed, 0, x)  # the load rebuilt the images: no stale-master refusal

    bad = plain.state_dict()
    bad["blocks.0.fc1.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks.0.fc1.weight: copying a param with shape \(3, 3\)"):
        other.load_state_dict(bad)


def test_a_state_dict_of_modules_whose_streamer_is_gone_is_refused():
    torch.manual_seed(18)
    model = TwoBlockModel()
    streamed = wrap(model.blocks, policy=OFF)
    streamed.close()
    with pytest.raises(RuntimeError, match="closed or gone, and its weights with it"):
        model.state_dict()


def test_a_model_converted_after_wrapping_is_refused_naming_the_parameter():
    torch.manual_seed(19)
    model = TwoBlockModel()
    streamed = wrap(model.blocks, policy=OFF)
    model.to(torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="block0: parameter 'fc1.weight' is now BFloat16 on cpu, "
                                                            "and was Float on cpu when the blocks were wrapped"):
        streamed(torch.randn(2, 4, DIM))


def test_a_tensor_computed_outside_the_blocks_that_needs_a_gradient_trains_as_in_plain_pytorch():
    torch.manual_seed(20)
    theta = torch.zeros(DIM, requires_grad=True)
    blocks = torch.nn.ModuleList(GatedBlock(None) for _ in range(2))
    plain = copy.deepcopy(blocks)
    for block in blocks:
        block.gate = theta.exp() * 2
    with torch.no_grad():
        for block in plain:
            for name in ("fc1", "fc2"):
                getattr(block, name).weight.copy_(getattr(block, name).weight.to(torch.bfloat16).float())
    streamed = wrap(blocks, policy=OFF)
    x = torch.randn(2, 4, DIM)
    _train_step(streamed, 0, x)
    got, theta.grad = theta.grad, None
    gate = theta.exp() * 2
    h = x
    for block in plain:
        block.gate = gate
        h = block(h)
    h.square().mean().backward()
    torch.testing.assert_close(got, theta.grad, rtol=1e-4, atol=1e-6)


def test_a_tensor_computed_outside_the_blocks_is_refused_by_name_when_recomputing():
    torch.manual_seed(20)
    theta = torch.zeros(DIM, requires_grad=True)
    gate = theta.exp() * 2  # a gradient would have to run back through this graph, not the block's
    streamed = wrap(torch.nn.ModuleList(GatedBlock(gate) for _ in range(2)), policy=OFF, recompute=True)
    with pytest.raises(RuntimeError, match="block1 reads a tensor computed outside it that requires a gradient"):
        _train_step(streamed, 0, torch.randn(2, 4, DIM))
    assert theta.grad is None


def test_one_blocks_state_dict_loads_alone_and_with_assign():
    torch.manual_seed(21)
    model = TwoBlockModel()
    streamed = wrap(model.blocks, policy=OFF)
    plain = TwoBlockModel()
    model.blocks[1].load_state_dict(plain.blocks[1].state_dict())  # no container hook runs
    assert torch.equal(streamed.masters(1)["fc2.weight"], plain.blocks[1].fc2.weight)
    _train_step(streamed, 0, torch.randn(2, 4, DIM))  # its images were rebuilt before the pass
    model.load_state_dict(plain.state_dict(), assign=True)  # the placeholders stay the layer's
    assert torch.equal(streamed.masters(0)["fc1.weight"], plain.blocks[0].fc1.weight)
    assert model.blocks[0].fc1.weight.numel() == 0  # still the placeholder the layer owns
    _train_step(streamed, 1, torch.randn(2, 4, DIM))


def test_pickling_a_streamed_model_is_refused_with_what_to_save_instead(tmp_path):
    torch.manual_seed(22)
    model = TwoBlockModel()
    streamed = model.streamed = wrap(model.blocks, policy=OFF)
    with pytest.raises(TypeError, match=r"cannot be pickled whole \(torch.save\(model\)\).*state_dict\(\)"):
        torch.save(model, tmp_path / "model.pt")
    del model.streamed  # the blocks' own hooks refuse too
    with pytest.raises(TypeError, match="cannot be pickled whole"):
        torch.save(model, tmp_path / "model.pt")
    torch.save(model.state_dict(), tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt")["blocks.0.fc1.weight"].shape == (HIDDEN, DIM)
    streamed.close()


def test_an_optimizer_that_leaves_out_masters_is_refused_before_the_step():
    """torch.optim.AdamW(model.parameters()) gets the placeholders, not the masters: the blocks
    would never train while the loss still fell through the rest of the model."""
    torch.manual_seed(23)
    model = TwoBlockModel()
    streamed = wrap(model.blocks, policy=OFF)
    for params in (model.parameters(), list(streamed.master_parameters())[:2] + list(model.head.parameters())):
        optimizer = torch.optim.AdamW(params, lr=1e-3)
        with pytest.raises(ValueError, match=r"the optimizer steps (0|2) of the 4 trainable masters"):
            with streamed.step(0, optimizer) as s:
                s.loss = streamed(torch.randn(2, 4, DIM)).pow(2).mean()
    optimizer = torch.optim.AdamW(streamed.optimizer_parameters(model), lr=1e-3)
    with streamed.step(0, optimizer) as s:  # nothing began before: step 0 is still free
        s.loss = model.head(streamed(torch.randn(2, 4, DIM))).pow(2).mean()
        s.loss.backward()
    assert s.report.training_passes == 1
