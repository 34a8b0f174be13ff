"""What a step, a calibration and a plugin swap report, as Python values of the binding's dicts."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PluginSwap:
    """A hot swap of the policy plugin: `outcome` is "swapped", "pending" (it happens at the
    next step boundary) or "failed" (the old plugin stays, `message` says why)."""

    outcome: str
    message: str
    old_version: str
    new_version: str


@dataclasses.dataclass(frozen=True)
class CalibrationErrors:
    """Each block's output error (relative L2 against BF16) with its weights on each quantized
    route, block by block: `by_route["int8"]`, `by_route["nf4"]` (one entry per quantized route
    this build streams)."""

    by_route: dict[str, list[float]]

    @property
    def int8(self) -> list[float]:
        """`by_route["int8"]`."""
        return self.by_route["int8"]

    @property
    def nf4(self) -> list[float]:
        """`by_route["nf4"]`."""
        return self.by_route["nf4"]


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one training step moved and decided (`StreamedBlocks.end_step()`)."""

    step: int
    # Host-to-device bytes of the training passes per route ("bf16", "int8", "nf4": one entry per
    # route this build streams).
    h2d_bytes_by_route: dict[str, int]
    h2d_bytes_all_bf16: int  # what the same fetches would have moved as BF16
    eval_h2d_bytes: int  # of the evaluation passes in the step (no grad, or no backward followed)
    training_passes: int
    # The training passes' fetches: issued ahead of their block's call (hits), only at it
    # (misses: prefetch_window=0), and issued ahead for a block the pass then called elsewhere
    # (unused: once per change of the order the blocks are called in, which the prefetch follows).
    prefetch_hits: int
    prefetch_misses: int
    prefetch_unused: int
    routes: list[str]  # each unit's (block's) format for the next step: "bf16", "int8" or "nf4"
    swap: PluginSwap | None  # a hot swap that took effect at this step's start
    calibration: CalibrationErrors | None  # an online re-calibration after this step

    @property
    def h2d_bytes(self) -> int:
        """The training passes' host-to-device bytes, all routes together."""
        return sum(self.h2d_bytes_by_route.values())

    @property
    def h2d_bytes_bf16(self) -> int:
        """`h2d_bytes_by_route["bf16"]`."""
        return self.h2d_bytes_by_route["bf16"]

    @property
    def h2d_bytes_int8(self) -> int:
        """`h2d_bytes_by_route["int8"]`."""
        return self.h2d_bytes_by_route["int8"]

    @property
    def h2d_bytes_nf4(self) -> int:
        """`h2d_bytes_by_route["nf4"]`."""
        return self.h2d_bytes_by_route["nf4"]

    @property
    def saved_fraction(self) -> float:
        """The share of the all-BF16 bytes this step did not move (0 when nothing moved)."""
        return 1.0 - self.h2d_bytes / self.h2d_bytes_all_bf16 if self.h2d_bytes_all_bf16 else 0.0


def _swap(raw) -> PluginSwap | None:
    return None if raw is None else PluginSwap(**raw)


def _errors(raw) -> CalibrationErrors | None:
    return None if raw is None else CalibrationErrors(by_route={route: list(e) for route, e in raw.items()})


def _report(raw) -> StepReport:
    raw["swap"], raw["calibration"] = _swap(raw["swap"]), _errors(raw["calibration"])
    return StepReport(**raw)
