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
    """Each block's output error (relative L2 against BF16) with its weights in INT8 and in
    NF4, block by block."""

    int8: list[float]
    nf4: list[float]


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one training step moved and decided (`StreamedBlocks.end_step()`)."""

    step: int
    h2d_bytes_bf16: int  # host-to-device bytes of the training passes, by format
    h2d_bytes_int8: int
    h2d_bytes_nf4: int
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
        """The training passes' host-to-device bytes, all formats together."""
        return self.h2d_bytes_bf16 + self.h2d_bytes_int8 + self.h2d_bytes_nf4

    @property
    def saved_fraction(self) -> float:
        """The share of the all-BF16 bytes this step did not move (0 when nothing moved)."""
        return 1.0 - self.h2d_bytes / self.h2d_bytes_all_bf16 if self.h2d_bytes_all_bf16 else 0.0


def _swap(raw) -> PluginSwap | None:
    return None if raw is None else PluginSwap(**raw)


def _errors(raw) -> CalibrationErrors | None:
    return None if raw is None else CalibrationErrors(int8=list(raw["int8"]), nf4=list(raw["nf4"]))


def _report(raw) -> StepReport:
    raw["swap"], raw["calibration"] = _swap(raw["swap"]), _errors(raw["calibration"])
    return StepReport(**raw)
