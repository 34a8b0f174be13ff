"""layers.calibrate(closure, batches): each unit's cost alone in each format, measured forward only
with compare_routes()'s yardstick, taken over batches until the units' ranking repeats."""

import pytest
import torch

import selective_precision as sp

from test_compare_routes import per_example, streamed_model


def alone(unit, fmt, n=3):
    return ["bf16" if u != unit else fmt for u in range(n)]


def test_each_cost_is_what_compare_routes_measures_for_that_unit_alone():
    model = streamed_model()
    model.eval()
    batches = [torch.randn(8, 8) for _ in range(4)]
    costs = model.layers.calibrate(per_example(model), batches, rho=None)
    assert isinstance(costs, sp.UnitCosts)
    assert costs.units == ["0", "1", "2"] and costs.formats == ["int8", "nf4"]
    assert costs.yardstick == "kl" and costs.paired_over == "examples"
    assert costs.batches == 4 and costs.examples == 32
    for fmt in ("int8", "nf4"):
        for unit in range(3):
            c = model.layers.compare_routes(per_example(model), batches, alone(unit, fmt))
            assert costs.costs[fmt][unit] == c.kl
            assert costs.upper[fmt][unit] == c.kl.high
            assert costs.loss_differences[fmt][unit] == c.loss_difference
            assert costs.batch_costs[fmt][unit] == c.batch_kl
    # NF4 moves each unit's outputs further than INT8 does.
    assert all(costs.costs["nf4"][u].mean > costs.costs["int8"][u].mean > 0 for u in range(3))
    assert set(costs.split_half_rho) == {"int8", "nf4"}
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
    assert costs.split_half_rho == {"int8": 1.0, "nf4": 1.0}
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
    (dict(max_batches=3, round_batches=2), ValueError, "max_batches >= 2 * round_batches"),
    (dict(batches=[]), ValueError, "batches is empty"),
    (dict(closure=3), TypeError, "closure expected a callable"),
    (dict(confidence=2), ValueError, "confidence=2"),
])
def test_what_it_cannot_measure_is_refused_by_name(call, error, says):
    model = streamed_model()
    model.eval()
    arguments = dict(closure=per_example(model), batches=[torch.randn(8, 8)] * 2)
    arguments.update(call)
    with pytest.raises(error, match=says.replace("[", r"\[").replace("]", r"\]").replace("*", r"\*")):
        model.layers.calibrate(**arguments)
    assert model.layers.routes() == ["bf16"] * 3


def test_a_closure_that_changes_what_it_returns_is_refused():
    model = streamed_model()
    model.eval()
    calls = []

    def closure(x):
        calls.append(x)
        loss, scores = per_example(model)(x)
        return (loss, scores) if len(calls) <= 7 else loss  # scores for the first batch's seven passes only

    with pytest.raises(ValueError, match="changed what it returns"):
        model.layers.calibrate(closure, [torch.randn(8, 8)] * 4, round_batches=1, rho=None)
