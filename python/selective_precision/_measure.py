"""`StreamedLayers.compare_routes()`: what an allocation of routes costs, measured forward only
on the user's batches through the user's own closure, with a confidence interval. The measuring is
the extension's (StreamedModel::compare_routes); this module turns units' routes into the
modules' and the result into dataclasses."""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import logging
import math
import numbers
import re
import time

import torch

from ._selective_precision import _QUANTIZED_ROUTES, _ROUTES

_log = logging.getLogger("selective_precision")


def _quoted(routes) -> str:
    """"'int8', 'nf4'": routes named in a message."""
    return ", ".join(repr(route) for route in routes)


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
    # The values the intervals are taken over, in batch order: the loss difference per example
    # (empty when paired over batches) and the KL per example (empty without scores). Two
    # allocations measured against the same routes_b on the same batches pair up by index.
    example_loss_differences: list[float] = dataclasses.field(default_factory=list, repr=False)
    example_kl: list[float] = dataclasses.field(default_factory=list, repr=False)


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
        raise TypeError("compare_routes(): %s expected a format (%s), a list of one per unit, or a dict of unit name "
                        "to format; got %s" % (argument, _quoted(_ROUTES), type(routes).__name__))
    for name, route in zip(units, per_unit):
        if route not in _ROUTES:
            raise ValueError("compare_routes(): %s gives unit %s the route %r; expected one of %s"
                             % (argument, name, route, ", ".join(_ROUTES)))
    return per_unit


def _module_routes(layout, per_unit):
    routes = [None] * sum(len(modules) for modules in layout.unit_modules)
    for route, modules in zip(per_unit, layout.unit_modules):
        for m in modules:
            routes[m] = route
    return routes


def _closure_result(result, batch_index, caller="compare_routes()"):
    """A closure's return as (loss, scores or None)."""
    if isinstance(result, torch.Tensor):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor) and (
            result[1] is None or isinstance(result[1], torch.Tensor)):
        return result
    raise TypeError("%s: closure(batches[%d]) returned %s; expected the loss (a tensor: the batch's, or one per "
                    "example) or a tuple (loss, scores), scores holding logits over their last dimension"
                    % (caller, batch_index, type(result).__name__))


def _check_closure(caller, closure, confidence):
    if not callable(closure):
        raise TypeError("%s: closure expected a callable closure(batch) -> loss, got %s"
                        % (caller, type(closure).__name__))
    if not 0.0 < float(confidence) < 1.0:
        raise ValueError("%s: confidence=%r; expected a number in (0, 1), such as 0.95" % (caller, confidence))


def _measure(layer, caller, closure, batches, candidates, reference, confidence, first_batch=0):
    """Each allocation of `candidates` (one format per unit) against `reference` on `batches`:
    the reference runs once a batch (StreamedModel::compare_routes). `first_batch` is the index
    the caller's errors give batches[0]."""
    if layer.in_step:
        raise RuntimeError("selective_precision: %s: a training step is open (a grad-mode forward ran since the last "
                           "optimizer.step()); measure between steps" % caller)
    measured = layer.model.compare_routes(lambda i: _closure_result(closure(batches[i]), first_batch + i, caller),
                                          len(batches),
                                          [_module_routes(layer.layout, c) for c in candidates],
                                          _module_routes(layer.layout, reference), float(confidence))
    out = []
    for units, m in zip(candidates, measured):
        difference = Interval._of(m["loss_difference"])
        all_bf16 = m["bytes_all_bf16"]
        out.append(RouteComparison(
            routes_a=list(units),
            routes_b=list(reference),
            confidence=m["confidence"],
            paired_over="examples" if m["paired_over_examples"] else "batches",
            loss_a=m["loss_a"],
            loss_b=m["loss_b"],
            loss_difference=difference,
            relative_loss_difference=difference.scaled(1.0 / m["loss_b"]) if m["loss_b"] else difference.scaled(
                float("nan")),
            batch_loss_differences=list(m["batch_loss_differences"]),
            kl=Interval._of(m["kl"]) if m["kl"] is not None else None,
            batch_kl=list(m["batch_kl"]),
            bytes_saved_a=1.0 - m["bytes_a"] / all_bf16,
            bytes_saved_b=1.0 - m["bytes_b"] / all_bf16,
            h2d_bytes=m["h2d_bytes"],
            example_loss_differences=list(m["example_loss_differences"]),
            example_kl=list(m["example_kl"]),
        ))
    return out


def compare_routes(layer, closure, batches, routes_a, routes_b, confidence):
    _check_closure("compare_routes()", closure, confidence)
    batches = list(batches)
    if not batches:
        raise ValueError("compare_routes(): batches is empty; give the batches to measure on")
    units_a = _unit_routes(layer.layout, routes_a, "routes_a")
    units_b = _unit_routes(layer.layout, routes_b, "routes_b")
    return _measure(layer, "compare_routes()", closure, batches, [units_a], units_b, confidence)[0]


class PolicyReport(list):
    """StreamedLayers.policy_report(): one dict per unit, and `budget`: a dict with `kind`
    ("bytes" or "loss"), `limit`, `planned_bytes_fraction`, `planned_cost`,
    `planned_loss_fraction`, `reference_loss`, `decided_at_step` (-1: none yet), `met` and
    `reads_step_signals` (whether the policy decides with the gradient signals each step
    measures: policy v3 does, v4 does not, and the layer then skips them); None for a policy
    without a budget. `fetches`: every byte the layer moved since stream(), apart and together:
    `training_h2d_bytes` (the steps ended) and `training_all_bf16` (what they would have moved
    as BF16), `evaluation_h2d_bytes` (no-grad forwards, and grad-mode ones no backward
    followed), `calibration_h2d_bytes` (calibration passes), `measurement_h2d_bytes`
    (compare_routes(), calibrate() and the re-measurements on drift), `total_h2d_bytes`, and
    `saved_fraction` (the training's) and `saved_fraction_with_measurement` (the training's with
    the calibrations' and measurements') against the training's all-BF16 bytes (None before a
    step)."""

    def __init__(self, units, budget, fetches):
        super().__init__(units)
        self.budget = budget
        self.fetches = fetches


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """What each unit costs alone in each cheaper format, measured (StreamedLayers.calibrate()).

    `costs[format][u]` is the interval of unit u's cost with u alone in `format` and every other
    unit BF16, against all-BF16: the KL per example where the closure returned scores
    (`yardstick` "kl"), else the loss difference (per example, or per batch: `paired_over`).
    `loss_differences` holds the loss difference in every case. `upper[format][u]` is the
    interval's upper bound: a cost a lucky draw cannot make small. `split_half_rho[format]` is
    Spearman's rho between the units' mean costs on the even and on the odd batches: how well
    the ranking of the units repeats; `batch_costs[format][u]` holds unit u's mean cost per batch,
    in order, the figures that rho is taken over. `h2d_bytes` is what the measurement moved,
    `all_bf16_fetches` the same in fetches of every unit in BF16 (a training step makes at least
    two: forward and backward). `sent_to_policy` says whether the policy plugin took the costs:
    policy v4 (mode measured) allocates by their upper bounds; other modes ignore them. Before the
    first step, policy v4 then proposes the swaps at its allocation's boundary, which are measured
    jointly on the same batches (`alternatives` of them; `swapped`: whether it moved to one that
    measured better beyond its interval); `h2d_bytes` and `seconds` count them too. After the first
    step the policy adopts the costs at its next step, and no swap is measured then. With
    `remeasure_on_drift` the layer keeps the closure and the batches measured: during training,
    when the policy asks (v4: some unit's gradients drifted beyond their noise), the boundary is
    measured again on them after the optimizer's step (`StreamedLayers.remeasurements`)."""

    units: list[str]
    formats: list[str]
    yardstick: str
    paired_over: str
    costs: dict
    loss_differences: dict
    split_half_rho: dict
    batch_costs: dict
    batches: int
    examples: int
    stopped_because: str
    confidence: float
    h2d_bytes: int
    all_bf16_fetches: float
    seconds: float

    sent_to_policy: bool = False
    alternatives: int = 0
    swapped: bool = False

    def signal_table(self) -> tuple[list[str], list[float], int]:
        """The costs as the policy plugin takes them (ABI 1.2's signal table, docs/policy.md
        "Policy v4"): columns measured_cost.<format>, measured_cost_se.<format> and
        measured_cost_upper.<format>, one row per unit, row-major; and the examples measured."""
        names, columns = [], []
        for f in self.formats:
            for column, value in (("measured_cost", lambda i: i.mean), ("measured_cost_se", lambda i: i.std_error),
                                  ("measured_cost_upper", lambda i: i.high)):
                names.append("%s.%s" % (column, f))
                # An interval of one draw is unbounded: not a measurement the policy can weigh (NaN).
                columns.append([float(v) if math.isfinite(v) else math.nan for v in map(value, self.costs[f])])
        return names, [row[u] for u in range(len(self.units)) for row in columns], int(self.examples)

    @property
    def upper(self) -> dict:
        """Per format, each unit's cost at the upper bound of its interval."""
        return {f: [i.high for i in self.costs[f]] for f in self.formats}

    def split_half_at(self, batches: int) -> dict:
        """`split_half_rho` as it stood after the first `batches` batches (at least 2)."""
        if not 2 <= int(batches) <= self.batches:
            raise ValueError("split_half_at(): batches=%r; expected 2 to %d" % (batches, self.batches))
        return _split_half(self.batch_costs, int(batches))

    def table(self) -> str:
        """The costs as a text table, one row per unit."""
        head = "%-12s" % "unit" + "".join("  %-34s" % ("%s %s [%d%%]" % (f, self.yardstick, round(100 * self.confidence)))
                                          for f in self.formats)
        rows = [head]
        for u, name in enumerate(self.units):
            rows.append("%-12s" % name + "".join("  %-34s" % ("%.3g [%.3g, %.3g]" % (
                self.costs[f][u].mean, self.costs[f][u].low, self.costs[f][u].high)) for f in self.formats))
        return "\n".join(rows)


def _spearman(x, y):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(x), ranks(y)
    n = len(x)
    mx, my = sum(rx) / n, sum(ry) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else float("nan")


def _split_half(batch_costs, n):
    """Per format: Spearman's rho between the units' mean costs over the even and the odd
    batches of the first n (NaN with fewer than three units)."""
    out = {}
    for fmt, units in batch_costs.items():
        even = [sum(b[:n][0::2]) / len(b[:n][0::2]) for b in units]
        odd = [sum(b[:n][1::2]) / len(b[:n][1::2]) for b in units]
        out[fmt] = _spearman(even, odd) if len(units) >= 3 else float("nan")
    return out


def compare_allocations(layer, closure, batches, allocations, reference, confidence):
    caller = "compare_allocations()"
    _check_closure(caller, closure, confidence)
    batches = list(batches)
    if not batches:
        raise ValueError("compare_allocations(): batches is empty; give the batches to measure on")
    if not isinstance(allocations, collections.abc.Mapping) or not allocations:
        raise TypeError("compare_allocations(): allocations expected a non-empty dict of name to routes (a format, a "
                        "list of one per unit, or a dict of unit name to format), got %r" % (allocations,))
    names = list(allocations)
    units = [_unit_routes(layer.layout, allocations[n], "allocations[%r]" % (n,)) for n in names]
    measured = _measure(layer, caller, closure, batches, units, _unit_routes(layer.layout, reference, "reference"),
                        confidence)
    return dict(zip(names, measured))


def _count(caller, name, value, least, least_is=""):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError("%s: %s=%r; expected a whole number of at least %d%s" % (caller, name, value, least, least_is))
    return value


class _RandomStreams:
    """The CPU's and every initialised CUDA device's random state: where a round of batches ends,
    so that the next round draws on from there (dropout draws new masks), as one compare_routes
    over all the batches would; and the caller's, put back at the end."""

    def __init__(self):
        self.saved = self.capture()

    @staticmethod
    def capture():
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        return torch.get_rng_state(), cuda

    @staticmethod
    def put(state):
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)

    def restore(self):
        self.put(self.saved)


@dataclasses.dataclass(frozen=True)
class Remeasurement:
    """A measurement of its boundary that the policy asked for during training, because the
    evidence said the costs it allocated by moved (policy v4: a unit's gradients drifted beyond
    their noise, drift_sigmas), run after the optimizer's step of `step` on calibrate()'s closure
    and batches: `routes` (the allocation in force) and `alternatives` swaps of it, measured
    jointly against all-BF16 as calibrate() measures them. The policy moves to a swap, at the next
    step, only where it measured better beyond its interval. `h2d_bytes` is what the measurement
    moved, `all_bf16_fetches` the same in fetches of every unit in BF16, `seconds` its time."""

    step: int
    routes: list[str]
    alternatives: int
    h2d_bytes: int
    all_bf16_fetches: float
    seconds: float


class _KeptMeasurement:
    """calibrate()'s closure and batches, kept to measure the boundary again when the policy asks
    during training; the dropout streams start where calibrate()'s swaps started theirs, so that
    every measurement draws the same masks."""

    def __init__(self, closure, batches, confidence, yardstick, random_state):
        self.closure, self.batches, self.confidence = closure, batches, confidence
        self.yardstick, self.random_state = yardstick, random_state

    def measure_if_asked(self, layer, step):
        """Between steps: measures what the policy proposes, if anything. A Remeasurement, or None."""
        started = time.perf_counter()
        bytes_before = layer.model.measurement_h2d_bytes()
        alternatives, _, routes = _measure_alternatives(layer, "the re-measurement on drift", self.closure,
                                                        self.batches, self.confidence, self.yardstick,
                                                        self.random_state)
        if not alternatives:
            return None
        h2d_bytes = layer.model.measurement_h2d_bytes() - bytes_before
        return Remeasurement(step=step, routes=routes, alternatives=alternatives, h2d_bytes=h2d_bytes,
                             all_bf16_fetches=h2d_bytes / _all_bf16_bytes(layer),
                             seconds=time.perf_counter() - started)


def _all_bf16_bytes(layer):
    return sum(layer.model.image_bytes(m, "bf16") for modules in layer.layout.unit_modules for m in modules)


def calibrate(layer, closure, batches, formats, confidence, rho, max_batches, round_batches, remeasure_on_drift):
    caller = "calibrate()"
    _check_closure(caller, closure, confidence)
    if not isinstance(remeasure_on_drift, bool):
        raise TypeError("calibrate(): remeasure_on_drift=%r; expected True or False" % (remeasure_on_drift,))
    if isinstance(formats, str):
        formats = [formats]
    if not isinstance(formats, collections.abc.Iterable):
        raise TypeError("calibrate(): formats=%r; expected some of %s" % (formats, _quoted(_QUANTIZED_ROUTES)))
    formats = list(formats)
    if not formats or any(f not in _QUANTIZED_ROUTES for f in formats) or len(set(formats)) != len(formats):
        raise ValueError("calibrate(): formats=%r; expected some of %s, each once" % (formats, _quoted(_QUANTIZED_ROUTES)))
    if rho is not None and (isinstance(rho, bool) or not isinstance(rho, numbers.Real) or not 0.0 < rho <= 1.0):
        raise ValueError("calibrate(): rho=%r; expected the split-half rank correlation to stop at, in (0, 1], or "
                         "None to measure every batch up to max_batches" % (rho,))
    round_batches = _count(caller, "round_batches", round_batches, 1)
    max_batches = _count(caller, "max_batches", max_batches, 2 * round_batches, " (2 * round_batches)")
    if not isinstance(batches, collections.abc.Iterable) or isinstance(batches, (str, bytes)):
        raise TypeError("calibrate(): batches expected a list or an iterator of batches, got %s" % type(batches).__name__)
    if layer.in_step:
        raise RuntimeError("selective_precision: calibrate(): a training step is open (a grad-mode forward ran since "
                           "the last optimizer.step()); calibrate between steps")
    units = list(layer.layout.unit_names)
    reference = ["bf16"] * len(units)
    candidates = [(f, u) for f in formats for u in range(len(units))]
    routes = [[f if v == u else "bf16" for v in range(len(units))] for f, u in candidates]
    names = ["unit %s in %s" % (units[u], f) for f, u in candidates]
    source = iter(batches)
    measured_batches = []  # kept for the swaps the policy may propose once it has the costs
    started = time.perf_counter()
    # Per candidate: its KL per example, its loss difference per example and per batch, and its
    # cost per batch (what the split-half rho is taken over).
    kl = [[] for _ in candidates]
    example_differences = [[] for _ in candidates]
    batch_differences = [[] for _ in candidates]
    batch_costs = [[] for _ in candidates]
    with_scores, per_example, used, rounds = None, True, 0, 0
    bytes_before = layer.model.measurement_h2d_bytes()
    split_half = {}
    stopped = None
    random = _RandomStreams()
    after_last_pass = [random.saved]

    def drawing_on(batch):
        result = closure(batch)
        after_last_pass[0] = _RandomStreams.capture()
        return result

    try:
        while stopped is None:
            chunk = list(itertools.islice(source, min(round_batches, max_batches - used)))
            if not chunk:
                stopped = "the batches ran out"
                break
            _RandomStreams.put(after_last_pass[0])
            try:
                measured = _measure(layer, caller, drawing_on, chunk, routes, reference, confidence, first_batch=used)
            except (ValueError, TypeError, RuntimeError) as e:
                # The extension's own refusals name a round's batch and a candidate's index: said
                # as the caller knows them. What the closure raised passes through as it was.
                message = re.sub(r"candidates\[(\d+)\]", lambda m: names[int(m.group(1))], str(e))
                message = re.sub(r"compare_routes: batch (\d+):",
                                 lambda m: "calibrate: batch %d:" % (used + int(m.group(1))), message)
                if message == str(e):
                    raise
                raise type(e)(message) from e
            used += len(chunk)
            measured_batches += chunk
            rounds += 1
            for k, c in enumerate(measured):
                if with_scores is None:
                    with_scores = c.kl is not None
                elif with_scores != (c.kl is not None):
                    raise ValueError("calibrate(): the closure returned scores for some batches and not for others "
                                     "(by batch %d); return them for every batch or for none" % used)
                per_example = per_example and c.paired_over == "examples"
                example_differences[k] += c.example_loss_differences
                batch_differences[k] += c.batch_loss_differences
                kl[k] += c.example_kl
                batch_costs[k] += c.batch_kl if with_scores else c.batch_loss_differences
            if rounds >= 2:  # from the second round on: a first round alone may split one batch against one
                split_half = _split_half({f: [batch_costs[k] for k, (g, _) in enumerate(candidates) if g == f]
                                          for f in formats}, used)
                if rho is not None and all(r >= rho for r in split_half.values()):
                    stopped = "the split-half rho reached %g" % rho
            if stopped is None and used >= max_batches:
                stopped = "max_batches (%d) was reached" % max_batches
    finally:
        random.restore()
    if not used:
        raise ValueError("calibrate(): batches is empty; give the batches to measure on")
    all_bf16 = _all_bf16_bytes(layer)
    costs = {f: [] for f in formats}
    losses = {f: [] for f in formats}
    per_batch = {f: [] for f in formats}
    for k, (f, _) in enumerate(candidates):
        differences = example_differences[k] if per_example else batch_differences[k]
        costs[f].append(Interval.of(kl[k] if with_scores else differences, confidence))
        losses[f].append(Interval.of(differences, confidence))
        per_batch[f].append(list(batch_costs[k]))
    result = UnitCosts(units=units, formats=formats, yardstick="kl" if with_scores else "loss",
                     paired_over="examples" if per_example else "batches", costs=costs, loss_differences=losses,
                     split_half_rho=split_half, batch_costs=per_batch, batches=used,
                     examples=len(kl[0]) if with_scores else len(example_differences[0] if per_example
                                                                  else batch_differences[0]),
                     stopped_because=stopped, confidence=float(confidence), h2d_bytes=0, all_bf16_fetches=0.0,
                     seconds=0.0)
    sent = _send_to_policy(layer, result)
    alternatives, swapped = 0, False
    if sent:
        layer.kept_measurement = None
        yardstick = "kl" if with_scores else "example" if per_example else "batch"
        alternatives, swapped, _ = _measure_alternatives(layer, caller, closure, measured_batches, confidence,
                                                         yardstick, after_last_pass[0])
        if remeasure_on_drift:
            layer.kept_measurement = _KeptMeasurement(closure, measured_batches, confidence, yardstick,
                                                      after_last_pass[0])
    h2d_bytes = layer.model.measurement_h2d_bytes() - bytes_before
    return dataclasses.replace(result, sent_to_policy=sent, alternatives=alternatives, swapped=swapped,
                               h2d_bytes=h2d_bytes, all_bf16_fetches=h2d_bytes / all_bf16,
                               seconds=time.perf_counter() - started)


def _measure_alternatives(layer, caller, closure, batches, confidence, yardstick, random_state):
    """The allocations the policy proposes once it has the costs (policy v4: its own and the swaps
    at its boundary), measured jointly against all-BF16 on `batches`, the dropout streams going on
    from `random_state`; the policy takes their costs per example (or per batch) and keeps a swap
    only where it measured better beyond its interval. Returns how many alternatives were measured,
    whether the routes moved, and the allocation they were measured against (None: none)."""
    proposed = layer.model.propose_allocations()
    if len(proposed) < 2:
        return 0, False, None
    before = layer.model.routes()
    random = _RandomStreams()
    try:
        _RandomStreams.put(random_state)
        measured = _measure(layer, caller, closure, batches, proposed, ["bf16"] * len(proposed[0]), confidence)
    finally:
        random.restore()
    costs = [list(m.example_kl if yardstick == "kl" else m.example_loss_differences if yardstick == "example"
                  else m.batch_loss_differences) for m in measured]
    layer.model.set_allocation_measurements(proposed, costs, float(confidence))
    return len(proposed) - 1, layer.model.routes() != before, proposed[0]


def _send_to_policy(layer, costs):
    """Gives the policy calibrate's costs; whether it took them. The selective_precision plugin
    reads them from 4.0.0 on (mode measured); one before 4.0.0 counted any table as its own
    signals and, in mode budget, would have sent every unit to BF16, so it is not given them."""
    version = layer.model.plugin_version()
    major = version.split(".", 1)[0]
    if major.isdigit() and int(major) < 4:
        _log.info("selective_precision: calibrate(): plugin %s predates policy v4; the costs are not sent", version)
        return False
    return layer.model.set_unit_signals(*costs.signal_table())
