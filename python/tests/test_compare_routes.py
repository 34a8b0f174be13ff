"""layers.compare_routes(closure, batches, routes_a, routes_b): an allocation measured forward only
on the user's batches through the user's closure, held against a model whose policy forces that
allocation, with the state left as it was."""

import math

import pytest
import torch

import selective_precision as sp

from test_stream import ALL_BF16, DIM, Model, bf16_rounded

FORCED_NF4_1 = {"mode": "static", "telemetry_enabled": False, "tiers": ["bf16", "int8", "nf4"],
                "force_nf4_blocks": [1]}


def streamed_model(config=ALL_BF16, seed=0, **options):
    torch.manual_seed(seed)
    model = bf16_rounded(Model(p=0.3))
    model.layers = sp.stream(model.layers, config=config, **options)
    return model


def per_example(model):
    """The closure: per example, the square of the head's output, and the hidden state's logits."""
    def closure(x):
        h = model.embed(x)
        pe = (torch.full((DIM,), 0.9), torch.full((DIM,), 0.01))
        for layer in model.layers:
            h, _ = layer(h, position_embeddings=pe, scale=0.5)
        return model.head(h).square().squeeze(-1), h
    return closure


def test_an_allocation_measures_what_a_model_forced_to_it_computes():
    measured, forced = streamed_model(), streamed_model(FORCED_NF4_1)
    measured.eval(), forced.eval()
    batches = [torch.randn(8, 8) for _ in range(3)]
    with torch.no_grad():
        loss_a = torch.cat([per_example(forced)(x)[0] for x in batches]).double()
        loss_b = torch.cat([per_example(measured)(x)[0] for x in batches]).double()
    c = measured.layers.compare_routes(per_example(measured), batches, ["bf16", "nf4", "bf16"])
    assert isinstance(c, sp.RouteComparison)
    assert c.routes_a == ["bf16", "nf4", "bf16"] and c.routes_b == ["bf16"] * 3
    assert c.paired_over == "examples" and c.loss_difference.n == 24
    assert c.loss_a == pytest.approx(loss_a.mean().item(), rel=1e-12)
    assert c.loss_b == pytest.approx(loss_b.mean().item(), rel=1e-12)
    d = loss_a - loss_b
    assert c.loss_difference.mean == pytest.approx(d.mean().item(), abs=1e-12)
    assert c.loss_difference.std_error == pytest.approx((d.std() / math.sqrt(24)).item(), rel=1e-9)
    assert c.loss_difference.low < c.loss_difference.mean < c.loss_difference.high
    assert c.relative_loss_difference.mean == pytest.approx(c.loss_difference.mean / c.loss_b)
    assert c.kl.n == 24 and c.kl.mean > 0 and len(c.batch_kl) == 3
    assert c.bytes_saved_b == 0.0
    assert 0.0 < c.bytes_saved_a < 1.0 / 3.0  # one unit of three in NF4: under a third of the bytes saved


def test_the_measurement_leaves_the_layer_as_it_found_it_and_counts_its_own_bytes():
    model = streamed_model()
    layers = model.layers
    x = torch.randn(4, 8)
    torch.manual_seed(1)
    with torch.no_grad():
        before = model(x)
    routes, masters = layers.routes(), [p.detach().clone() for p in layers.parameters()]
    extension = layers._layer().model
    evaluated = extension.evaluation_h2d_bytes()
    torch.manual_seed(5)
    c = layers.compare_routes(lambda b: model(b), [torch.randn(4, 8) for _ in range(2)], "int8", "nf4")
    assert c.paired_over == "batches" and c.kl is None
    drawn = torch.rand(3)
    torch.manual_seed(5)
    torch.randn(4, 8), torch.randn(4, 8)  # the batches above, drawn before the measurement
    assert torch.equal(drawn, torch.rand(3))  # dropout's draws inside it did not move the host's stream
    assert layers.routes() == routes
    assert all(torch.equal(p, q) for p, q in zip(layers.parameters(), masters))
    assert extension.evaluation_h2d_bytes() == evaluated
    assert c.h2d_bytes == extension.measurement_h2d_bytes() > 0
    torch.manual_seed(1)
    with torch.no_grad():
        assert torch.equal(model(x), before)
    model(x).backward()  # and it trains on
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert layers.last_report.training_passes == 1


def test_dropout_left_on_draws_the_same_masks_under_both_allocations():
    model = streamed_model()  # train mode: dropout 0.3 on
    c = model.layers.compare_routes(lambda x: model(x), [torch.randn(4, 8) for _ in range(4)], "nf4", "nf4")
    assert c.batch_loss_differences == [0.0] * 4


def test_routes_by_unit_name_and_units_of_part_of_a_block():
    """With units=, a unit's route pins its modules: measured, unit 1 in NF4 computes what a model
    whose policy forces unit 1 to NF4 computes."""
    measured = streamed_model(units={"fc": ["fc"]})
    forced = streamed_model(FORCED_NF4_1, units={"fc": ["fc"]})
    measured.eval(), forced.eval()
    names = [u["unit"] for u in measured.layers.policy_report()]
    assert names == ["0.fc", "1.fc", "2.fc"] and forced.layers.routes() == ["bf16", "nf4", "bf16"]
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = forced(x).item()
    by_name = measured.layers.compare_routes(lambda b: measured(b), [x], {"0.fc": "bf16", "1.fc": "nf4", "2.fc": "bf16"})
    by_list = measured.layers.compare_routes(lambda b: measured(b), [x], ["bf16", "nf4", "bf16"])
    assert by_name.routes_a == by_list.routes_a == ["bf16", "nf4", "bf16"]
    assert by_name.loss_a == by_list.loss_a == pytest.approx(expected, rel=1e-12)
    assert by_name.loss_difference.mean != 0.0


@pytest.mark.parametrize("arguments, error, says", [
    (dict(routes_a=["nf4"]), ValueError, "holds 1 routes; expected one per unit"),
    (dict(routes_a="fp8"), ValueError, "the route 'fp8'"),
    (dict(routes_a={"0": "nf4"}), ValueError, "no route for units ['1', '2']"),
    (dict(routes_a=7), TypeError, "routes_a expected a format"),
    (dict(batches=[]), ValueError, "batches is empty"),
    (dict(confidence=1.0), ValueError, "confidence=1.0"),
    (dict(closure=lambda x: "loss"), TypeError, "returned str"),
    (dict(closure=lambda x: torch.ones(())), ValueError, "called no streamed block"),
])
def test_what_it_cannot_measure_is_refused_by_name_and_nothing_changes(arguments, error, says):
    model = streamed_model()
    call = dict(closure=lambda x: model(x), batches=[torch.randn(4, 8)], routes_a="nf4")
    call.update(arguments)
    with pytest.raises(error, match=__import__("re").escape(says)):
        model.layers.compare_routes(**call)
    assert model.layers.routes() == ["bf16"] * 3
    c = model.layers.compare_routes(lambda x: model(x), [torch.randn(4, 8)], "nf4")
    assert c.loss_difference.n == 1


def test_a_closure_that_trains_or_fails_is_stopped_and_a_step_is_refused():
    model = streamed_model()

    def trains(x):
        with torch.enable_grad():
            return model(x)

    with pytest.raises(RuntimeError, match="forward only"):
        model.layers.compare_routes(trains, [torch.randn(4, 8)], "nf4")

    def fails(x):
        model(x)
        raise KeyError("the host's own failure")

    with pytest.raises(KeyError, match="the host's own failure"):
        model.layers.compare_routes(fails, [torch.randn(4, 8)], "nf4")
    model(torch.randn(4, 8)).backward()  # a step open
    with pytest.raises(RuntimeError, match="measure between steps"):
        model.layers.compare_routes(lambda x: model(x), [torch.randn(4, 8)], "nf4")
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert model.layers.compare_routes(lambda x: model(x), [torch.randn(4, 8)], "nf4").loss_difference.n == 1


def test_an_interval_of_any_values_is_the_t_interval_compare_routes_uses():
    i = sp.Interval.of([0.0, 1.0, 2.0, 3.0, 4.0])
    assert i.n == 5 and i.mean == 2.0 and i.std_error == pytest.approx(math.sqrt(0.5))
    assert i.high == pytest.approx(2.0 + 2.776445 * math.sqrt(0.5), rel=1e-6)  # t(0.975, 4)
    model = streamed_model()
    c = model.layers.compare_routes(lambda x: model(x), [torch.randn(4, 8) for _ in range(3)], "nf4")
    assert sp.Interval.of(c.batch_loss_differences) == c.loss_difference  # paired over batches
    with pytest.raises(ValueError, match="no values"):
        sp.Interval.of([])
    with pytest.raises(ValueError, match="is not finite"):
        sp.Interval.of([1.0, float("nan")])


def test_several_allocations_against_one_reference_are_each_what_it_measures_alone():
    model = streamed_model()
    model.train()  # dropout on: each allocation of a batch draws the reference's masks
    batches = [torch.randn(8, 8) for _ in range(3)]
    allocations = {"nf4 in the middle": ["bf16", "nf4", "bf16"], "all int8": "int8", "by name": {"0": "nf4", "1": "bf16", "2": "int8"}}
    together = model.layers.compare_allocations(per_example(model), batches, allocations)
    assert list(together) == list(allocations)
    for name, routes in allocations.items():
        alone = model.layers.compare_routes(per_example(model), batches, routes)
        assert together[name] == alone
        assert len(together[name].example_kl) == 24 and len(together[name].example_loss_differences) == 24
    assert together["all int8"].kl.mean < together["nf4 in the middle"].kl.mean
    with pytest.raises(TypeError, match="allocations expected a non-empty dict"):
        model.layers.compare_allocations(per_example(model), batches, [["nf4"] * 3])
    with pytest.raises(ValueError, match=r"allocations\['short'\] holds 1 routes"):
        model.layers.compare_allocations(per_example(model), batches, {"short": ["nf4"]})
