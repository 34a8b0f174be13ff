"""The step as `stream()` finds it: the layer of one streamed model (`_Layer`: it opens the step
at a pass's first call, and ends it around the optimizer's step, which its own optimizer hooks
pass it)."""

from __future__ import annotations

import logging
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ._modules import _parameter_at
from ._selective_precision import _StepPhase

_log = logging.getLogger("selective_precision")


def _before_update(model, loss, rest_to_average=None):
    """The step sequence up to the optimizer's update, as both Python faces run it
    (`StreamedBlocks.step` and stream()'s optimizer hooks): the C++ one sp-train runs too
    (StreamedModel::prepare_update: the mean across ranks of the gradients no one else averages,
    `rest_to_average()`, called only with several ranks, None: there are none; the loss's mean
    across ranks; `post_backward` with it, the policy's moments and its loss budget's reading).
    Returns (the mean loss, NaN when unknown; the moments)."""
    rest = rest_to_average() if rest_to_average is not None and model.world_size() > 1 else []
    return model.prepare_update(rest, float("nan") if loss is None else float(loss))


class _Layer:
    """The streaming layer behind one stream() call: the extension's model and the step state
    found from the optimizer's hooks. Held by every streamed block and by the StreamedLayers."""

    def __init__(self, model, layout, full_shapes):
        self.model = model
        self.layout = layout
        self.full_shapes = full_shapes  # per module, each streamed weight's shape (sharded: even another rank's)
        self.gathering = False  # inside StreamedLayers.full_state_dict()
        self.blocks = [weakref.ref(b) for b in layout.modules]
        self.streamed_names = layout.names  # per streamed module
        self.calibrating = False  # inside StreamedLayers.calibrating()
        self.averaged = set()  # ids of the host parameters average_gradients() averaged this step
        self.reduced_by_ddp = set()  # ids of those a DistributedDataParallel around the blocks averages this step
        self.loss = None
        self.last_report = None
        self.training_h2d_bytes = 0  # over every step ended, and what they would have moved as BF16
        self.training_all_bf16 = 0
        self.last_moments = None
        self.masters = [_parameter_at(m, n) for m, names in zip(layout.modules, layout.names) for n in names]
        self.master_names = ["%s.%s" % (path, n) for path, names in zip(layout.paths, layout.names) for n in names]
        self.resident_ids = {id(p) for p in model.resident_parameters()}
        self.recomputes = model.recomputes()  # a recompute calls a block again with its arguments
        self.kept_measurement = None  # calibrate()'s closure and batches, to measure again when the policy asks
        self.remeasurements = []  # what they measured during training
        self.unhook_optimizers = self.hook_optimizers()

    # The step's phase is the extension's (StreamedModel::step_phase()), read, never kept here.
    @property
    def in_step(self) -> bool:
        return self.model.step_phase() != _StepPhase.between_steps

    @property
    def stepping(self) -> bool:
        """post_backward ran: an optimizer's step is under way."""
        return self.model.step_phase() == _StepPhase.after_backward

    def refuse_master_hooks(self):
        """The layer writes the masters' .grad itself, where autograd runs no hook of theirs."""
        for name, master in zip(self.master_names, self.masters):
            if master._backward_hooks or getattr(master, "_post_accumulate_grad_hooks", None):
                raise RuntimeError(
                    "selective_precision: streamed master %s has a gradient hook (register_hook, or "
                    "register_post_accumulate_grad_hook), which would never run: the layer writes the master's "
                    ".grad itself. Read the gradients in an optimizer step pre-hook instead" % name)

    def begin_if_needed(self):
        if self.stepping:
            # An optimizer step that raised between its hooks: its step is dropped.
            self.abort()
        self.end_step_if_updated()
        if not self.in_step:
            self.model.take_collective_failure()
            self.model.begin_step(self.model.next_step())

    def end_step_if_updated(self):
        """The blocks' parameters changed since the step's backward without torch.optim's step
        hooks (a hand-written update, another optimizer, a state dict loaded): that update ended
        the step."""
        if self.in_step and not self.stepping and not self.calibrating and self.model.trained_in_step():
            self.end_step()

    def end_step(self):
        """Ends the open step whose update ran: the policy takes the moments of its backward and
        decides, and the images of the updated weights are rebuilt."""
        loss, self.last_moments = _before_update(self.model, self.loss)
        self.forget_step()
        self.took(self.model.end_step(loss))

    def took(self, report):
        """A step ended with `report`: the run's training fetches count it."""
        self.last_report = report
        self.training_h2d_bytes += report.h2d_bytes
        self.training_all_bf16 += report.h2d_bytes_all_bf16

    def fetches(self) -> dict:
        """Every byte the layer moved, apart and together: the training steps' (those ended; an
        aborted step reports none), the evaluation passes', the calibration passes' and the
        measurements' (compare_routes(), calibrate(), the re-measurements on drift), and the
        savings against what the training steps would have moved as BF16 (None before a step)."""
        evaluation = self.model.evaluation_h2d_bytes()
        calibration = self.model.calibration_h2d_bytes()
        measurement = self.model.measurement_h2d_bytes()
        overhead = calibration + measurement
        total = self.training_h2d_bytes + evaluation + overhead
        all_bf16 = self.training_all_bf16
        return {"training_h2d_bytes": self.training_h2d_bytes, "training_all_bf16": all_bf16,
                "evaluation_h2d_bytes": evaluation, "calibration_h2d_bytes": calibration,
                "measurement_h2d_bytes": measurement, "total_h2d_bytes": total,
                "saved_fraction": 1.0 - self.training_h2d_bytes / all_bf16 if all_bf16 else None,
                "saved_fraction_with_measurement": (1.0 - (self.training_h2d_bytes + overhead) / all_bf16
                                                    if all_bf16 else None)}

    def abort(self):
        self.model.abort_step()
        self.forget_step()

    def forget_step(self):
        """What the hooks noted of the step that ends."""
        self.loss = None
        self.averaged.clear()
        self.reduced_by_ddp.clear()

    def note_ddp_forward(self):
        """A DistributedDataParallel whose forward runs the blocks with its gradient sync on
        averages its parameters in this backward: the optimizer's hook leaves them to it."""
        ddp = _active_ddp()
        if ddp is not None and ddp.require_backward_grad_sync:
            self.reduced_by_ddp.update(id(p) for p in getattr(ddp, "_module_parameters", ()))

    def rest_to_average(self, optimizer):
        """The optimizer's parameters whose gradients no one else averages across the ranks: not
        the layer's (masters, resident parameters), nor those average_gradients() or a DDP did."""
        done = {id(m) for m in self.masters} | self.resident_ids | self.averaged | self.reduced_by_ddp
        return [p for g in optimizer.param_groups for p in g["params"] if id(p) not in done and p.grad is not None]

    def hook_optimizers(self):
        """Registers this layer's own pair of torch.optim step hooks, so that every optimizer's
        step passes it (the optimizer may be built after stream(), and torch.optim hooks only
        such an optimizer process-wide). They hold the layer weakly, and go with it: at the call
        of what this returns (close()), or when the layer is collected."""
        layer = weakref.ref(self)

        def before(optimizer, args, kwargs):
            live = layer()
            if live is not None:
                live.before_optimizer_step(optimizer)

        def after(optimizer, args, kwargs):
            live = layer()
            if live is not None:
                live.after_optimizer_step(optimizer)

        handles = (register_optimizer_step_pre_hook(before), register_optimizer_step_post_hook(after))
        return weakref.finalize(self, _remove, handles)

    def trainable_masters(self):
        return [(name, m) for name, m in zip(self.master_names, self.masters) if m.requires_grad]

    def before_optimizer_step(self, optimizer):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = self.trainable_masters()
        missing = [name for name, m in trainable if id(m) not in stepped]
        # The blocks' optimizer steps their streamed weights, or, on a frozen base (LoRA), their
        # resident parameters; any other is another's (the embeddings', say).
        ours = len(missing) < len(trainable) or not self.resident_ids.isdisjoint(stepped)
        if not ours or self.stepping:
            return
        if self.calibrating:
            raise RuntimeError("selective_precision: optimizer.step() inside calibrating(): a calibration step "
                               "updates nothing; step the optimizer after the with-block")
        if missing:
            raise ValueError(
                "selective_precision: this optimizer steps %d of the %d trainable streamed weights; it leaves out "
                "%s%s, which would train on no step of theirs while the others do. Give it every streamed "
                "block's parameters (model.parameters() holds them)"
                % (len(trainable) - len(missing), len(trainable), ", ".join("layers." + n for n in missing[:3]),
                   " and %d more" % (len(missing) - 3) if len(missing) > 3 else "")
            )
        if not self.in_step:
            return
        # The ranks' mean loss, once: end_step takes it too.
        self.loss, self.last_moments = _before_update(self.model, self.loss, lambda: self.rest_to_average(optimizer))

    def after_optimizer_step(self, optimizer):
        if not self.stepping:
            return
        loss = float("nan") if self.loss is None else self.loss
        self.forget_step()
        self.took(self.model.end_step(loss))
        # Between steps, outside any call of the blocks: the one place the closure may run the model.
        if self.kept_measurement is not None:
            try:
                measured = self.kept_measurement.measure_if_asked(self, self.last_report.step)
            except BaseException:
                # The step and its update stand; a closure that fails would fail again at every
                # step the request stays open, so it is dropped (a later calibrate() keeps a new one).
                self.kept_measurement = None
                _log.warning("selective_precision: the re-measurement after step %d failed; the layer no longer "
                             "re-measures on drift (calibrate() again to resume)", self.last_report.step)
                raise
            if measured is not None:
                self.remeasurements.append(measured)


def _active_ddp():
    """The DistributedDataParallel whose forward is running, if any (torch's own record of it,
    which TorchDynamo reads too); None where this torch keeps none."""
    from torch.nn.parallel import DistributedDataParallel

    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return active() if active is not None else None


def _remove(handles):
    for handle in handles:
        handle.remove()
