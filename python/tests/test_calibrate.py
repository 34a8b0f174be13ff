"""layers.calibrate(closure, batches): each unit's cost alone in each format, measured forward only
with compare_routes()'s yardstick, taken over batches until the units' ranking repeats."""

import math
import re

import pytest
import torch

import selective_precision as sp
from selective_precision._selective_precision import _QUANTIZED_ROUTES

from test_compare_routes import per_example, streamed_model


def alone(unit, fmt, n=3):
    return ["bf16" if u != unit else fmt for u in range(n)]


def test_each_cost_is_what_compare_routes_measures_for_that_unit_alone():
    model = streamed_model()
    model.eval()
    batches = [torch.randn(8, 8) for _ in range(4)]
    costs = model.layers.calibrate(per_example(model), batches, rho=None)
    assert isinstance(costs, sp.UnitCosts)
    assert costs.units == ["0", "1", "2"] and costs.formats == list(_QUANTIZED_ROUTES)  # by default, every one
    assert costs.yardstick == "kl" and costs.paired_over == "examples"
    assert costs.batches == 4 and costs.examples == 32
    for fmt in costs.formats:
        for unit in range(3):
            c = model.layers.compare_routes(per_example(model), batches, alone(unit, fmt))
            assert costs.costs[fmt][unit] == c.kl
            assert costs.upper[fmt][unit] == c.kl.high
            assert costs.loss_differences[fmt][unit] == c.loss_difference
            assert costs.batch_costs[fmt][unit] == c.batch_kl
    # NF4 moves each unit's outputs further than INT8 does.
    assert all(costs.costs["nf4"][u].mean > costs.costs["int8"][u].mean > 0 for u in range(3))
    assert set(costs.split_half_rho) == set(_QUANTIZED_ROUTES)
    assert all(-1.0 <= r <= 1.0 for r in costs.split_half_rho.values())
    assert "unit" in costs.table() and "nf4 kl" in costs.table()


def test_without_scores_the_cost_is_the_loss_difference_and_the_bytes_are_counted():
    model = streamed_model()
    model.eval()
    batches = [torch.randn(8, 8) for _ in range(2)]
    moved_before = model.layers._layer().model.measurement_h2d_bytes()
    costs = model.layers.calibrate(lambda x: per_example(model)(x)[0], batches, formats="nf4", rho=None)
    assert costs.yardstick == "loss" and costs.formats == ["nf4"]
    for unit in range(3):
        c = model.layers.compare_routes(lambda x: per_example(model)(x)[0], batches, alone(unit, "nf4"))
        assert costs.costs["nf4"][unit] == costs.loss_differences["nf4"][unit] == c.loss_difference
    # Per batch: all-BF16 once, then each unit alone in NF4.
    all_bf16 = sum(model.layers.image_bytes(u, "bf16") for u in range(3))
    alone_bytes = sum(all_bf16 - model.layers.image_bytes(u, "bf16") + model.layers.image_bytes(u, "nf4")
                      for u in range(3))
    assert costs.h2d_bytes == 2 * (all_bf16 + alone_bytes)
    assert costs.h2d_bytes <= model.layers._layer().model.measurement_h2d_bytes() - moved_before
    assert costs.all_bf16_fetches == pytest.approx(costs.h2d_bytes / all_bf16)
    assert model.layers.routes() == ["bf16"] * 3


def test_it_stops_when_the_ranking_repeats_and_takes_no_more_batches_than_that():
    model = streamed_model()
    model.eval()
    x = torch.randn(8, 8)
    taken = []

    def stream():
        for i in range(100):
            taken.append(i)
            yield x  # the same batch each time: the even and odd halves rank the units alike

    costs = model.layers.calibrate(per_example(model), stream(), rho=0.9, round_batches=2)
    assert costs.batches == 4 and len(taken) == 4  # the first test: two rounds, one per half
    assert costs.split_half_rho == {f: 1.0 for f in _QUANTIZED_ROUTES}
    assert "split-half rho reached 0.9" in costs.stopped_because
    assert costs.split_half_at(4) == costs.split_half_rho
    with pytest.raises(ValueError, match="expected 2 to 4"):
        costs.split_half_at(5)


def test_it_stops_at_max_batches_or_when_the_batches_run_out():
    model = streamed_model()
    model.eval()
    batches = [torch.randn(8, 8) for _ in range(5)]
    capped = model.layers.calibrate(per_example(model), iter(batches), rho=None, max_batches=4)
    assert capped.batches == 4 and "max_batches (4)" in capped.stopped_because
    ran_out = model.layers.calibrate(per_example(model), batches, rho=None, max_batches=32)
    assert ran_out.batches == 5 and ran_out.stopped_because == "the batches ran out"


@pytest.mark.parametrize("call, error, says", [
    (dict(formats=["fp8"]), ValueError, "formats=['fp8']"),
    (dict(formats=["nf4", "nf4"]), ValueError, "each once"),
    (dict(rho=0.0), ValueError, "rho=0.0"),
    (dict(max_batches=3, round_batches=2), ValueError, "max_batches=3; expected a whole number of at least 4 (2 * round_batches)"),
    (dict(batches=[]), ValueError, "batches is empty"),
    (dict(closure=3), TypeError, "closure expected a callable"),
    (dict(confidence=2), ValueError, "confidence=2"),
])
def test_what_it_cannot_measure_is_refused_by_name(call, error, says):
    model = streamed_model()
    model.eval()
    arguments = dict(closure=per_example(model), batches=[torch.randn(8, 8)] * 2)
    arguments.update(call)
    with pytest.raises(error, match=re.escape(says)):
        model.layers.calibrate(**arguments)
    assert model.layers.routes() == ["bf16"] * 3


def test_a_closure_that_gives_scores_for_some_rounds_only_is_refused():
    model = streamed_model()
    model.eval()
    calls = []

    def closure(x):
        calls.append(x)
        loss, scores = per_example(model)(x)
        return (loss, scores) if len(calls) <= 7 else loss  # scores for the first batch's seven passes only

    with pytest.raises(ValueError, match="scores for some batches and not for others"):
        model.layers.calibrate(closure, [torch.randn(8, 8)] * 4, formats=("int8", "nf4"), round_batches=1, rho=None)


def test_one_loss_per_batch_anywhere_pairs_every_batch_as_compare_routes_does():
    model = streamed_model()
    model.eval()
    batches = [torch.randn(8, 8) for _ in range(4)]

    def closure(x):
        loss = per_example(model)(x)[0]
        return loss if x is not batches[3] else loss.mean()

    costs = model.layers.calibrate(closure, batches, formats="nf4", rho=None, round_batches=2)
    c = model.layers.compare_routes(closure, batches, alone(0, "nf4"))
    assert costs.paired_over == c.paired_over == "batches" and costs.examples == 4
    assert costs.costs["nf4"][0] == c.loss_difference


def test_with_dropout_each_round_draws_on_as_one_measurement_over_every_batch_would():
    model = streamed_model()
    model.train()  # dropout left on: the allocations of a batch share its masks, batches do not
    batches = [torch.randn(8, 8) for _ in range(4)]
    state = torch.get_rng_state()
    costs = model.layers.calibrate(per_example(model), batches, formats="nf4", rho=None, round_batches=1)
    assert torch.equal(torch.get_rng_state(), state)
    c = model.layers.compare_routes(per_example(model), batches, alone(1, "nf4"))
    assert costs.costs["nf4"][1] == c.kl and costs.batch_costs["nf4"][1] == c.batch_kl
    assert len(set(costs.batch_costs["nf4"][1])) == 4


def test_a_refusal_names_the_batch_and_the_unit_as_the_caller_knows_them():
    model = streamed_model()
    model.eval()
    passes = []  # 7 a batch: all-BF16, then each of 3 units in INT8 and in NF4

    def closure(x):
        passes.append(x)
        loss, scores = per_example(model)(x)
        candidate_of_batch_3 = len(passes) > 3 * 7 + 1
        return loss, scores.new_full(scores.shape, float("nan")) if candidate_of_batch_3 else scores

    with pytest.raises(ValueError, match=r"calibrate: batch 3: the KL .* unit 0 in int8 gives no probability"):
        model.layers.calibrate(closure, [torch.randn(8, 8)] * 6, formats=("int8", "nf4"), round_batches=1, rho=None)
    passes.clear()

    def returns_a_number_at_batch_2(x):
        passes.append(x)
        return 3 if len(passes) == 2 * 7 + 1 else per_example(model)(x)

    with pytest.raises(TypeError, match=re.escape("calibrate(): closure(batches[2]) returned int")):
        model.layers.calibrate(returns_a_number_at_batch_2, [torch.randn(8, 8)] * 6, formats=("int8", "nf4"),
                               round_batches=1, rho=None)
    assert model.layers.routes() == ["bf16"] * 3


@pytest.mark.parametrize("call, error, says", [
    (dict(formats=None), TypeError, "formats=None"),
    (dict(batches=None), TypeError, "batches expected a list or an iterator"),
    (dict(max_batches=None), ValueError, "max_batches=None"),
    (dict(round_batches=1.5), ValueError, "round_batches=1.5"),
    (dict(round_batches=True), ValueError, "round_batches=True"),
    (dict(rho="high"), ValueError, "rho='high'"),
])
def test_arguments_of_the_wrong_kind_are_refused_by_name(call, error, says):
    model = streamed_model()
    model.eval()
    arguments = dict(closure=per_example(model), batches=[torch.randn(8, 8)] * 2)
    arguments.update(call)
    with pytest.raises(error, match=says):
        model.layers.calibrate(**arguments)


def v4_model(budget):
    import os
    return streamed_model(os.path.join(sp.config_dir(), "policy", "v4.yaml"), budget=sp.Budget(bytes=budget))


def test_policy_v4_routes_by_the_prior_then_by_the_upper_bounds_calibrate_measured():
    import itertools

    model = v4_model(0.8)
    model.eval()
    layers = model.layers
    all_bf16 = sum(layers.image_bytes(u, "bf16") for u in range(3))

    def bytes_of(routes):
        return sum(layers.image_bytes(u, f) for u, f in enumerate(routes))

    prior = layers.routes()
    assert prior != ["bf16"] * 3 and bytes_of(prior) <= 0.8 * all_bf16  # the budget holds from the first fetch
    assert prior[2] != "nf4"  # use_more_bits keeps the last unit wider
    costs = layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(4)], rho=None)
    assert costs.sent_to_policy
    # The allocation is the one of least summed upper bound within the budget, found here by trying all.
    cost = {"bf16": [0.0] * 3, **costs.upper}
    feasible = [r for r in itertools.product(("bf16", "int8", "nf4"), repeat=3) if bytes_of(r) <= 0.8 * all_bf16]
    best = min(feasible, key=lambda r: sum(cost[f][u] for u, f in enumerate(r)))
    assert layers.routes() == list(best)
    assert layers._layer().model.unit_costs("nf4") == costs.upper["nf4"]
    status = layers.policy_report().budget
    assert status["met"] and status["planned_cost"] == pytest.approx(sum(cost[f][u] for u, f in enumerate(best)))
    assert not status["reads_step_signals"]  # v4 decides by the measurement: the steps skip the Taylor table


def test_policy_v4_keeps_the_measured_routes_through_training():
    model = v4_model(0.8)
    model.layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(2)], rho=None)
    measured = model.layers.routes()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(3):
        per_example(model)(torch.randn(8, 8))[0].mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert model.layers.routes() == measured


def test_policy_v4_measures_the_swaps_at_its_boundary_and_takes_one_only_beyond_its_interval():
    model = v4_model(0.8)
    model.eval()
    layers = model.layers
    model_link = layers._layer().model
    costs = layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(4)], formats="nf4", rho=None)
    routes = layers.routes()
    # What calibrate measured beside the allocation: the proposal the allocation in force gives.
    proposal = model_link.propose_allocations()
    assert len(proposal) >= 2 and proposal[0] == routes
    assert costs.alternatives == len(proposal) - 1
    assert all(sum(r == "nf4" for r in alternative) == sum(r == "nf4" for r in routes) for alternative in proposal)

    # Lower on average, within the noise: the allocation stays.
    base = [0.1 + 0.01 * math.sin(i) for i in range(64)]
    noisy = [b - 0.001 + (0.05 if i % 2 else -0.05) for i, b in enumerate(base)]
    assert model_link.set_allocation_measurements(proposal, [base] + [noisy] * (len(proposal) - 1), 0.95)
    assert layers.routes() == routes
    # Lower beyond it: the policy moves there, from the first fetch.
    proposal = model_link.propose_allocations()
    better = [b - 0.01 for b in base]
    assert model_link.set_allocation_measurements(proposal, [base, better] + [base] * (len(proposal) - 2), 0.95)
    assert layers.routes() == proposal[1]
    # A measurement of no open proposal is refused by the policy (logged), and changes nothing.
    assert not model_link.set_allocation_measurements(proposal, [base, better] + [base] * (len(proposal) - 2), 0.95)
    with pytest.raises(ValueError, match="allocation 1 has 3 costs and allocation 0 has 64"):
        model_link.set_allocation_measurements(proposal, [base, base[:3]] + [base] * (len(proposal) - 2), 0.95)


def train_with_gradients_scaled(model, steps, scale_from_step_16):
    """SGD at lr 0 on one batch: every step's gradients are the same, until step 16 scales them."""
    x = torch.randn(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    asked, reports = [], []
    for step in range(steps):
        scale = 1.0 if step < 16 else scale_from_step_16
        (per_example(model)(x)[0].mean() * scale).backward()
        optimizer.step()
        optimizer.zero_grad()
        reports.append(model.layers.last_report)
        if model.layers._layer().model.propose_allocations():
            asked.append(step)
    return asked, reports


def test_policy_v4_measures_its_boundary_again_when_the_gradients_drift_and_only_then():
    model = v4_model(0.8)
    model.eval()
    layers = model.layers
    costs = layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(4)], formats="nf4", rho=None)
    assert costs.alternatives > 0
    measured_routes = layers.routes()
    moved_before = layers._layer().model.measurement_h2d_bytes()
    assert layers.policy_report().fetches == {
        "training_h2d_bytes": 0, "training_all_bf16": 0, "evaluation_h2d_bytes": 0, "calibration_h2d_bytes": 0,
        "measurement_h2d_bytes": moved_before, "total_h2d_bytes": moved_before, "saved_fraction": None,
        "saved_fraction_with_measurement": None}
    # Steady gradients: steps 0-7 are the reference, 8-15 the first window tested, and nothing is
    # asked. 1000 times larger from step 16: the window of steps 16-23 drifts beyond drift_sigmas,
    # and the optimizer's step of step 23 measures the boundary again at once (nothing is left to ask).
    asked, reports = train_with_gradients_scaled(model, 24, 1000.0)
    assert asked == []
    [again] = layers.remeasurements
    assert isinstance(again, sp.Remeasurement)
    assert again.step == 23 and again.routes == measured_routes
    assert again.alternatives == costs.alternatives  # the same boundary, the same swaps
    assert again.h2d_bytes == layers._layer().model.measurement_h2d_bytes() - moved_before > 0
    assert again.all_bf16_fetches == pytest.approx(
        again.h2d_bytes / sum(layers.image_bytes(u, "bf16") for u in range(3)))
    assert again.seconds > 0
    # Every fetch counted, apart and together: the steps', calibrate()'s and the re-measurement's.
    fetches = layers.policy_report().fetches
    training, all_bf16 = sum(r.h2d_bytes for r in reports), sum(r.h2d_bytes_all_bf16 for r in reports)
    assert (fetches["training_h2d_bytes"], fetches["training_all_bf16"]) == (training, all_bf16)
    assert fetches["measurement_h2d_bytes"] == moved_before + again.h2d_bytes
    assert fetches["evaluation_h2d_bytes"] == fetches["calibration_h2d_bytes"] == 0
    assert fetches["total_h2d_bytes"] == training + moved_before + again.h2d_bytes
    assert fetches["saved_fraction"] == pytest.approx(1 - training / all_bf16) and fetches["saved_fraction"] > 0
    assert fetches["saved_fraction_with_measurement"] == pytest.approx(
        1 - fetches["total_h2d_bytes"] / all_bf16)


def test_without_remeasure_on_drift_the_policy_asks_and_nothing_measures():
    model = v4_model(0.8)
    model.eval()
    model.layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(4)], formats="nf4", rho=None,
                           remeasure_on_drift=False)
    assert train_with_gradients_scaled(model, 24, 1000.0)[0] == [23]
    assert model.layers.remeasurements == []
    # An evaluation pass counts apart.
    with torch.no_grad():
        per_example(model)(torch.randn(8, 8))
    fetches = model.layers.policy_report().fetches
    assert fetches["evaluation_h2d_bytes"] == sum(model.layers.image_bytes(u, r)
                                                  for u, r in enumerate(model.layers.routes())) > 0
    assert fetches["total_h2d_bytes"] == (fetches["training_h2d_bytes"] + fetches["evaluation_h2d_bytes"]
                                          + fetches["measurement_h2d_bytes"])
    with pytest.raises(TypeError, match="remeasure_on_drift=1; expected True or False"):
        model.layers.calibrate(per_example(model), [torch.randn(8, 8)], remeasure_on_drift=1)


def test_a_closure_that_fails_when_measuring_again_raises_from_that_step_once_and_training_goes_on(caplog):
    model = v4_model(0.8)
    model.eval()
    closure, failing = per_example(model), []

    def measure(x):
        if failing:
            raise RuntimeError("the closure's own error")
        return closure(x)

    model.layers.calibrate(measure, [torch.randn(8, 8) for _ in range(4)], formats="nf4", rho=None)
    failing.append(True)
    with pytest.raises(RuntimeError, match="the closure's own error"):
        train_with_gradients_scaled(model, 24, 1000.0)
    assert model.layers.last_report.step == 23  # the step ended before the measurement
    assert "re-measurement after step 23 failed" in caplog.text
    asked, _ = train_with_gradients_scaled(model, 4, 1.0)  # on, without raising: nothing measures
    assert asked == [0, 1, 2, 3] and model.layers.remeasurements == []


def test_other_policies_take_the_costs_and_decide_as_before():
    model = streamed_model()  # all BF16 (mode off)
    model.eval()
    costs = model.layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(2)], rho=None)
    assert costs.sent_to_policy and model.layers.routes() == ["bf16"] * 3
    assert costs.alternatives == 0 and not costs.swapped  # only v4 proposes swaps


def test_a_plugin_before_policy_v4_is_not_given_the_costs():
    """selective_precision 3.x counted any table as its own signals: in mode budget the measured
    costs would have sent every unit to BF16."""
    from selective_precision import _measure

    model = streamed_model()
    model.eval()
    costs = model.layers.calibrate(per_example(model), [torch.randn(8, 8) for _ in range(2)], formats=("int8", "nf4"),
                                   rho=None)

    class Plugin:
        def __init__(self, version):
            self.version, self.tables = version, []

        def plugin_version(self):
            return self.version

        def set_unit_signals(self, names, values, samples):
            self.tables.append((names, values, samples))
            return True

    class Layer:
        def __init__(self, version):
            self.model = Plugin(version)

    old, new = Layer("3.1.0"), Layer("4.0.0")
    assert not _measure._send_to_policy(old, costs) and old.model.tables == []
    assert _measure._send_to_policy(new, costs)
    (names, values, samples), = new.model.tables
    assert names[:3] == ["measured_cost.int8", "measured_cost_se.int8", "measured_cost_upper.int8"]
    assert len(values) == 3 * len(names) and samples == costs.examples
    assert values[2] == costs.upper["int8"][0] and values[len(names) + 5] == costs.upper["nf4"][1]
