"""Policy v3 through sp.stream(): a budget given as an option, a calibration step that decides
the routes before the first training step, and the policy report (docs/policy.md, "Policy v3")."""

import logging
import math
import os

import pytest
import torch

import selective_precision as sp
from selective_precision._selective_precision import _ROUTES

DIM = 64
QUIET = {"telemetry_enabled": False, "tiers": ["bf16", "int8", "nf4"]}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class Model(torch.nn.Module):
    def __init__(self, blocks=4):
        super().__init__()
        self.embed = torch.nn.Linear(8, DIM)
        self.layers = torch.nn.ModuleList(Block() for _ in range(blocks))
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).square().mean()


def streamed_model(config=QUIET, budget=sp.Budget(bytes=0.5), seed=0, frozen_base=False):
    torch.manual_seed(seed)
    model = Model()
    for block in model.layers if frozen_base else ():
        block.up.weight.requires_grad_(False)
        block.down.weight.requires_grad_(False)
    model.layers = sp.stream(model.layers, config=config, budget=budget)
    return model


def planned_fraction(layers):
    bytes_ = sum(layers.image_bytes(b, route) for b, route in enumerate(layers.routes()))
    return bytes_ / sum(layers.image_bytes(b, "bf16") for b in range(len(layers)))


def test_a_calibration_step_decides_the_routes_the_first_training_step_moves():
    model = streamed_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(6, 8)
    with model.layers.calibrating(model):
        loss = model(x)
        loss.backward()
        model.layers.report_loss(loss)
    assert all(p.grad is None for p in model.parameters())  # the calibration's gradients are gone
    report = model.layers.policy_report()
    assert report.budget["kind"] == "bytes" and report.budget["limit"] == 0.5
    assert report.budget["met"] and report.budget["decided_at_step"] == 0 and report.budget["reads_step_signals"]
    assert report.budget["planned_bytes_fraction"] <= 0.5
    assert [u["unit"] for u in report] == ["0", "1", "2", "3"]
    assert [u["route"] for u in report] == model.layers.routes()
    for unit in report:
        assert unit["bytes"]["nf4"] < unit["bytes"]["int8"] < unit["bytes"]["bf16"]
        assert unit["predicted_cost"]["nf4"] is not None and unit["predicted_cost"]["int8"] is not None
        assert unit["predicted_cost"]["bf16"] is None  # the reference tier is not measured
    assert model.layers.last_report.step == 0 and model.layers.last_report.training_passes == 1
    chosen = model.layers.routes()
    assert set(chosen) != {"bf16"}

    model(x).backward()
    optimizer.step()
    optimizer.zero_grad()
    step = model.layers.last_report
    assert step.step == 1
    moved = {"bf16": step.h2d_bytes_bf16, "int8": step.h2d_bytes_int8, "nf4": step.h2d_bytes_nf4}
    # The training step's forward and backward fetched the calibrated routes, and only those.
    assert {p for p, bytes_ in moved.items() if bytes_ > 0} == set(chosen)
    assert step.h2d_bytes <= 0.5 * step.h2d_bytes_all_bf16
    assert planned_fraction(model.layers) <= 0.5


def test_without_model_the_blocks_gradients_are_restored_and_the_rest_kept():
    model = streamed_model()
    x = torch.randn(6, 8)
    model(x).backward()  # a step the user began before calibrating: refused
    with pytest.raises(RuntimeError, match="calibrating\\(\\): a training step is open"):
        with model.layers.calibrating():
            pass
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    optimizer.step()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    with model.layers.calibrating():
        model(x).backward()
    for name, p in model.layers.named_parameters():
        torch.testing.assert_close(p.grad, before["layers." + name], msg=name)
    assert not torch.equal(model.head.weight.grad, before["head.weight"])  # not restored without model=


def test_calibrating_refuses_an_optimizer_step_and_an_empty_block():
    model = streamed_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(RuntimeError, match="no grad-mode forward"):
        with model.layers.calibrating(model):
            pass
    with pytest.raises(RuntimeError, match="optimizer.step\\(\\) inside calibrating"):
        with model.layers.calibrating(model):
            model(torch.randn(2, 8)).backward()
            optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    with model.layers.calibrating(model):  # the aborted step left the layer usable
        model(torch.randn(2, 8)).backward()
    assert model.layers.policy_report().budget["met"]


def test_a_loss_budget_and_a_budget_merged_into_a_yaml_file(tmp_path):
    config = tmp_path / "policy.yaml"
    config.write_text("selective_precision:\n  telemetry_enabled: false\n  tiers: [bf16, int8, nf4]\n")
    model = streamed_model(config=str(config), budget=sp.Budget(loss=0.01))
    x = torch.randn(6, 8)
    with model.layers.calibrating(model):
        loss = model(x)
        loss.backward()
        model.layers.report_loss(loss)
    budget = model.layers.policy_report().budget
    assert budget["kind"] == "loss" and budget["limit"] == 0.01
    assert budget["met"] and budget["planned_loss_fraction"] <= 0.01
    assert math.isclose(budget["reference_loss"], loss.item(), rel_tol=1e-6)


def test_a_budget_is_refused_by_name_when_it_cannot_be_right():
    for bad, message in [({}, "exactly one"), ({"bytes": 0.5, "loss": 0.1}, "exactly one"),
                         ({"bytes": 1.5}, "bytes= expected a fraction in \\(0, 1\\]"),
                         ({"loss": -1.0}, "loss= expected a fraction > 0"), ({"bytes": "0.5"}, "finite number")]:
        with pytest.raises(ValueError, match=message):
            sp.Budget(**bad)
    with pytest.raises(ValueError, match="sets selective_precision.mode to 'dynamic'"):
        streamed_model(config=dict(QUIET, mode="dynamic"))
    with pytest.raises(TypeError, match="budget= expected selective_precision.Budget"):
        streamed_model(budget=0.5)
    model = streamed_model(config=dict(QUIET, budget={"bytes": 0.5}))  # the same budget twice is one budget
    assert model.layers.policy_report().budget["limit"] == 0.5


def test_the_budget_argument_overrides_the_configs_and_says_so(caplog):
    """A shipped config (configs/policy/v3.yaml) carries a default budget; stream(budget=) is the
    run's, as a keyword argument overrides a config file's value."""
    with caplog.at_level(logging.INFO, logger="selective_precision"):
        model = streamed_model(config=dict(QUIET, budget={"bytes": 0.45}), budget=sp.Budget(bytes=0.6))
    assert model.layers.policy_report().budget["limit"] == 0.6
    assert any("overrides" in r.getMessage() and "{'bytes': 0.45}" in r.getMessage() for r in caplog.records)
    shipped = sp.stream(Model().layers, config=os.path.join(sp.config_dir(), "policy", "v3.yaml"),
                        budget=sp.Budget(bytes=0.346))
    assert shipped.policy_report().budget["limit"] == 0.346


def test_without_a_budget_the_report_has_none_and_no_costs():
    torch.manual_seed(0)
    model = Model()
    model.layers = sp.stream(model.layers, config=dict(QUIET, mode="dynamic"))
    with model.layers.calibrating(model):
        model(torch.randn(6, 8)).backward()
    report = model.layers.policy_report()
    assert report.budget is None
    assert all(u["predicted_cost"] == {r: None for r in _ROUTES} for u in report)


def test_a_frozen_base_is_measured_as_the_same_weights_trained():
    """LoRA's case: the streamed weights are frozen, only resident parameters train. The table
    still measures them, from weight gradients taken for it alone, equal to a trained base's."""
    costs = []
    for frozen in (False, True):
        model = streamed_model(seed=3, frozen_base=frozen)
        with model.layers.calibrating(model):
            model(torch.randn(6, 8, generator=torch.Generator().manual_seed(4))).backward()
        if frozen:
            assert all(b.up.weight.grad is None and b.down.weight.grad is None for b in model.layers)
        costs.append([u["predicted_cost"] for u in model.layers.policy_report()])
    for trained, frozen in zip(*costs):
        for tier in ("int8", "nf4"):
            assert frozen[tier] == pytest.approx(trained[tier], rel=1e-5, abs=1e-12)


def test_the_shipped_v3_config_keeps_its_budget_on_every_step(tmp_path):
    torch.manual_seed(5)
    model = Model()
    model.layers = sp.stream(model.layers, config=os.path.join(sp.config_dir(), "policy", "v3.yaml"),
                             output_dir=str(tmp_path))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with model.layers.calibrating(model):
        model(torch.randn(6, 8)).backward()
    for _ in range(3):
        loss = model(torch.randn(6, 8))
        loss.backward()
        model.layers.report_loss(loss)
        optimizer.step()
        optimizer.zero_grad()
        report = model.layers.last_report
        assert report.h2d_bytes <= 0.45 * report.h2d_bytes_all_bf16
    assert model.layers.policy_report().budget["met"]
    assert (tmp_path / "selective_precision_telemetry.jsonl").is_file()  # under output_dir, not the cwd
