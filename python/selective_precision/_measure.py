"""`StreamedLayers.compare_routes()`: what an allocation of routes costs, measured forward only
on the user's batches through the user's own closure, with a confidence interval. The measuring is
the extension's (StreamedModel::compare_routes); this module turns units' routes into the
modules' and the result into dataclasses."""

from __future__ import annotations

import collections.abc
import dataclasses

import torch

_FORMATS = ("bf16", "int8", "nf4")


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean over `n` paired draws, its standard error, and its two-sided confidence interval
    from Student's t (infinite with fewer than two draws)."""

    mean: float
    low: float
    high: float
    std_error: float
    n: int

    @classmethod
    def _of(cls, d: dict) -> "Interval":
        return cls(mean=d["mean"], low=d["low"], high=d["high"], std_error=d["std_error"], n=d["n"])

    @classmethod
    def of(cls, values, confidence: float = 0.95) -> "Interval":
        """The interval of the mean of `values` (paired differences, or per-batch figures such as
        a RouteComparison's `batch_kl`), as compare_routes computes its own."""
        from . import _selective_precision

        values = [float(v) for v in values]
        if not values:
            raise ValueError("Interval.of(): no values")
        if not 0.0 < float(confidence) < 1.0:
            raise ValueError("Interval.of(): confidence=%r; expected a number in (0, 1), such as 0.95" % (confidence,))
        return cls._of(_selective_precision._paired_interval(values, float(confidence)))

    def scaled(self, factor: float) -> "Interval":
        """The same interval in other units: every value times `factor` (bounds kept in order)."""
        low, high = sorted((self.low * factor, self.high * factor))
        return Interval(self.mean * factor, low, high, self.std_error * abs(factor), self.n)


@dataclasses.dataclass(frozen=True)
class RouteComparison:
    """What running on `routes_a` instead of `routes_b` cost on the measured batches.

    `loss_difference` is loss_a - loss_b, paired over examples when the closure returned one loss
    per example, else over batches (`paired_over`); `relative_loss_difference` is the same divided
    by loss_b (its interval scaled, loss_b taken as exact). `kl` is the mean per example of
    KL(b || a) between the softmax of the scores under each allocation, where the closure returned
    scores. `bytes_saved_*` are each allocation's savings against all-BF16, per fetch of every
    unit; `h2d_bytes` what the measurement itself moved."""

    routes_a: list[str]
    routes_b: list[str]
    confidence: float
    paired_over: str
    loss_a: float
    loss_b: float
    loss_difference: Interval
    relative_loss_difference: Interval
    batch_loss_differences: list[float]
    kl: Interval | None
    batch_kl: list[float]
    bytes_saved_a: float
    bytes_saved_b: float
    h2d_bytes: int


def _unit_routes(layout, routes, argument):
    """`routes` (one format, one per unit, or {unit name: format} naming every unit) as one
    format per unit."""
    units = layout.unit_names
    if isinstance(routes, str):
        per_unit = [routes] * len(units)
    elif isinstance(routes, collections.abc.Mapping):
        unknown = [name for name in routes if name not in units]
        missing = [name for name in units if name not in routes]
        if unknown or missing:
            raise ValueError("compare_routes(): %s names %s; expected every unit once (%s)"
                             % (argument, "unknown units %s" % unknown if unknown else "no route for units %s" % missing,
                                ", ".join(units)))
        per_unit = [routes[name] for name in units]
    elif isinstance(routes, collections.abc.Sequence):
        per_unit = list(routes)
        if len(per_unit) != len(units):
            raise ValueError("compare_routes(): %s holds %d routes; expected one per unit (%d: %s)"
                             % (argument, len(per_unit), len(units), ", ".join(units)))
    else:
        raise TypeError("compare_routes(): %s expected a format ('bf16', 'int8', 'nf4'), a list of one per unit, or "
                        "a dict of unit name to format; got %s" % (argument, type(routes).__name__))
    for name, route in zip(units, per_unit):
        if route not in _FORMATS:
            raise ValueError("compare_routes(): %s gives unit %s the route %r; expected one of %s"
                             % (argument, name, route, ", ".join(_FORMATS)))
    return per_unit


def _module_routes(layout, per_unit):
    routes = [None] * sum(len(modules) for modules in layout.unit_modules)
    for route, modules in zip(per_unit, layout.unit_modules):
        for m in modules:
            routes[m] = route
    return routes


def _closure_result(result, batch_index):
    """A closure's return as (loss, scores or None)."""
    if isinstance(result, torch.Tensor):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor) and (
            result[1] is None or isinstance(result[1], torch.Tensor)):
        return result
    raise TypeError("compare_routes(): closure(batches[%d]) returned %s; expected the loss (a tensor: the batch's, "
                    "or one per example) or a tuple (loss, scores), scores holding logits over their last dimension"
                    % (batch_index, type(result).__name__))


def compare_routes(layer, closure, batches, routes_a, routes_b, confidence):
    if not callable(closure):
        raise TypeError("compare_routes(): closure expected a callable closure(batch) -> loss, got %s"
                        % type(closure).__name__)
    batches = list(batches)
    if not batches:
        raise ValueError("compare_routes(): batches is empty; give the batches to measure on")
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError("compare_routes(): confidence=%r; expected a number in (0, 1), such as 0.95" % (confidence,))
    if layer.in_step:
        raise RuntimeError("selective_precision: compare_routes(): a training step is open (a grad-mode forward ran "
                           "since the last optimizer.step()); measure between steps")
    units_a = _unit_routes(layer.layout, routes_a, "routes_a")
    units_b = _unit_routes(layer.layout, routes_b, "routes_b")
    measured = layer.model.compare_routes(lambda i: _closure_result(closure(batches[i]), i), len(batches),
                                          _module_routes(layer.layout, units_a),
                                          _module_routes(layer.layout, units_b), float(confidence))
    difference = Interval._of(measured["loss_difference"])
    all_bf16 = measured["bytes_all_bf16"]
    return RouteComparison(
        routes_a=units_a,
        routes_b=units_b,
        confidence=measured["confidence"],
        paired_over="examples" if measured["paired_over_examples"] else "batches",
        loss_a=measured["loss_a"],
        loss_b=measured["loss_b"],
        loss_difference=difference,
        relative_loss_difference=difference.scaled(1.0 / measured["loss_b"]) if measured["loss_b"] else difference.scaled(
            float("nan")),
        batch_loss_differences=list(measured["batch_loss_differences"]),
        kl=Interval._of(measured["kl"]) if measured["kl"] is not None else None,
        batch_kl=list(measured["batch_kl"]),
        bytes_saved_a=1.0 - measured["bytes_a"] / all_bf16,
        bytes_saved_b=1.0 - measured["bytes_b"] / all_bf16,
        h2d_bytes=measured["h2d_bytes"],
    )
