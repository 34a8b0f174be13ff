"""`selective_precision.stream()`: the blocks of a PyTorch or Hugging Face model streamed where
they are, called by the model's own loop, with their fp32 host masters as their parameters.

What it does to each block (as FSDP2's `fully_shard` does): the module stays the same object,
its class becomes a subclass of its own (`Streamed<Class>`) whose forward runs the block on the
weights the layer delivers, and each streamed parameter is replaced by its fp32 master on the
host (the same Parameter when it already was one). So the parent's `parameters()`,
`named_parameters()` and `state_dict()` keys do not change, and a stock optimizer, clipping,
schedulers and `torch.amp` see the real weights.

The step is found, not called: a grad-mode pass's first call opens it; the optimizer's step hooks
give the policy the gradient moments before the update and rebuild the transfer images after it.
"""

from __future__ import annotations

import collections.abc
import contextlib
import enum
import io
import logging
import math
import weakref

import torch
import torch.utils._pytree as pytree

from ._modules import _add_hook, _owner, _parameter_at, _streamed_names, _warn_trainable_streamed_in_frozen_blocks
from ._options import Budget, StreamOptions, _options, _streamed_model
from ._selective_precision import _QUANTIZED_ROUTES, _ROUTES
from ._measure import PolicyReport
from ._step import _Layer

_log = logging.getLogger("selective_precision")

# Non-tensor arguments the backward's recompute can be given again as they were: values, not
# objects that the forward may change (a key-value cache).
_REPLAYABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
               torch.memory_format, enum.Enum, slice, type(Ellipsis))

_NOT_PICKLABLE = (
    "selective_precision: a model whose blocks are streamed cannot be pickled whole (torch.save(model), "
    "copy.deepcopy): its blocks run through the streaming layer, which a pickle cannot carry. Save "
    "model.state_dict() (or save_pretrained) instead: it holds the fp32 masters under the usual keys"
)


@contextlib.contextmanager
def _weights_in(module, weights):
    """The block's streamed parameters are the delivered weights for the duration of a call."""
    saved = []
    try:
        for name, weight in weights.items():
            owner, leaf = _owner(module, name)
            saved.append((owner, leaf, owner._parameters[leaf]))
            owner._parameters[leaf] = weight
        yield
    finally:
        for owner, leaf, master in reversed(saved):
            owner._parameters[leaf] = master


_TENSOR = object()  # a tensor's place in a block's flattened arguments or results


def _argument_name(path):
    """`hidden_states`, `position_embeddings[0]` or `args[1]`: a pytree key path into (args, kwargs)."""
    if path[0].idx == 0:
        return "args" + pytree.keystr(path[1:])
    return str(path[1].key) + pytree.keystr(path[2:])


class StreamedBlock:
    """What a streamed block's class derives from, before its own class (stream() makes
    `Streamed<Class>` of each block's class). Its forward runs the block streamed: on the
    weights the layer delivers in the precision the policy chose, with a backward that fetches
    them again and recomputes the forward under the forward's random streams and autocast."""

    _sp_layer: _Layer
    _sp_index: int
    _sp_block_class: type

    def forward(self, *args, **kwargs):
        """The block's own forward on its streamed weights, with the same arguments and result.
        With recompute=True, under grad mode a non-tensor argument that cannot be given again as
        it was (a cache) is refused with a TypeError naming it."""
        layer, index = self._sp_layer, self._sp_index
        if layer.model.closed:
            raise RuntimeError("selective_precision: %s: the streamed layers were closed" % self._sp_name())
        leaves, spec = pytree.tree_flatten((args, kwargs))
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        training = torch.is_grad_enabled()
        if training and layer.recomputes and not all(isinstance(leaf, (torch.Tensor, *_REPLAYABLE)) for leaf in leaves):
            # The key paths only to name the argument refused.
            for path, leaf in pytree.tree_flatten_with_path((args, kwargs))[0]:
                if not isinstance(leaf, torch.Tensor) and not isinstance(leaf, _REPLAYABLE):
                    raise TypeError(
                        "selective_precision: %s was called with %s=%s, which its recompute in the backward cannot "
                        "be given again as it was (a cache the forward changes, say). Pass tensors and plain values; "
                        "a Hugging Face model trains with use_cache=False"
                        % (self._sp_name(), _argument_name(path), type(leaf).__name__)
                    )
        block_forward = self._sp_block_class.forward
        # The call keeps what its recompute needs and no tensor: the tensors come back as `inputs`
        # (autograd keeps them), so that a pass whose graph is dropped holds nothing alive.
        template = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        produced = {}

        def call(inputs, weights):
            values = list(template)
            for slot, tensor in zip(slots, inputs):
                values[slot] = tensor
            call_args, call_kwargs = pytree.tree_unflatten(values, spec)
            with _weights_in(self, weights):
                out = block_forward(self, *call_args, **call_kwargs)
            out_leaves, out_spec = pytree.tree_flatten(out)
            produced["leaves"] = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in out_leaves]
            produced["spec"] = out_spec
            return [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]

        if training and torch._C._current_graph_task_id() == -1 and layer.model.opens_training_pass(index):
            layer.refuse_master_hooks()
            layer.begin_if_needed()  # not for a checkpoint's recompute inside the backward
            layer.note_ddp_forward()
        outputs = iter(layer.model.forward_block(index, [leaves[i] for i in slots], call))
        out_leaves = [next(outputs) if leaf is _TENSOR else leaf for leaf in produced["leaves"]]
        return pytree.tree_unflatten(out_leaves, produced["spec"])

    def _sp_name(self):
        return "streamed block %s (%s)" % (self._sp_layer.layout.paths[self._sp_index], self._sp_block_class.__name__)

    def _apply(self, fn, recurse=True):
        # What the conversion does, seen on two probes (a float32 one alone cannot tell .float()
        # from a conversion that keeps the dtype).
        as_float32, as_bfloat16 = fn(torch.zeros((), dtype=torch.float32)), fn(torch.zeros((), dtype=torch.bfloat16))
        if as_float32.device.type != "cpu":
            raise RuntimeError(
                "selective_precision: %s: a conversion (.to(), .cuda(), ...) would move its streamed parameters, "
                "which are the fp32 host masters the layer streams from. Move the model before stream(): "
                "stream(device=...) says where the blocks compute" % self._sp_name())
        if as_float32.dtype == torch.float32 and as_bfloat16.dtype == torch.bfloat16:
            return super()._apply(fn, recurse)
        # A cast (.to(torch.bfloat16), .half(), .float()): the block's other parameters convert, the
        # masters stay fp32 on the host, and the layer computes in the new dtype from the next pass.
        self._sp_layer.model.set_compute_dtype(as_float32.dtype)
        masters = [(owner, leaf, owner._parameters[leaf])
                   for owner, leaf in (_owner(self, n) for n in self._sp_layer.streamed_names[self._sp_index])]
        for owner, leaf, _ in masters:
            owner._parameters[leaf] = None
        try:
            return super()._apply(fn, recurse)
        finally:
            for owner, leaf, master in masters:
                owner._parameters[leaf] = master

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLABLE)


_CLASSES: dict[type, type] = {}


def _streamed_class(cls):
    if cls not in _CLASSES:
        _CLASSES[cls] = type("Streamed" + cls.__name__, (StreamedBlock, cls), {"_sp_block_class": cls})
    return _CLASSES[cls]


class StreamedLayers(torch.nn.ModuleList):
    """What stream() returns: a ModuleList of the same blocks, each now streamed. Index, slice
    and iterate it as the original; the model's own loop calls its elements.

    The policy's state (its decisions, windows and counters) rides in `state_dict()` as this
    module's extra state, so a checkpoint of the model resumes the same decisions."""

    def __init__(self, modules=None, layer=None):
        super().__init__(modules)
        self._sp = layer  # None for a slice of it, whose blocks keep their own layer

    def _layer(self) -> _Layer:
        if self._sp is None:
            raise RuntimeError("selective_precision: this is a slice of the streamed layers; ask the whole list")
        return self._sp

    def report_loss(self, loss) -> None:
        """The step's training loss (a tensor or a float), for the policy's loss guard; optional
        (without it the policy sees the loss as unknown). Call it before optimizer.step()."""
        self._layer().loss = loss.item() if isinstance(loss, torch.Tensor) else float(loss)

    @property
    def last_report(self):
        """The StepReport of the last step that ended (at optimizer.step()), or None."""
        return self._layer().last_report

    @property
    def last_moments(self):
        """Each block's gradient moments of the last step, as the policy got them."""
        return self._layer().last_moments

    def average_gradients(self, parameters) -> None:
        """With a process group: replaces each parameter's .grad by its mean across ranks, for
        the model's own parameters outside the streamed blocks (embeddings, head), whose
        gradients the layer does not average in the backward. Call it before clipping by the
        gradient norm, so that every rank clips alike; otherwise the optimizer step averages
        them itself. Every rank passes the same parameters in the same order. One process:
        nothing to do."""
        layer = self._layer()
        parameters = [p for p in parameters if p.grad is not None]
        layer.model.average_gradients(parameters)
        layer.averaged.update(id(p) for p in parameters)

    @property
    def rank(self) -> int:
        """This process's rank in the process group (0 without one)."""
        return self._layer().model.rank()

    @property
    def world_size(self) -> int:
        """The ranks in the process group (1 without one)."""
        return self._layer().model.world_size()

    def routes(self) -> list[str]:
        """Each unit's format for its next fetch: "bf16", "int8" or "nf4" (a unit is a block, or
        with units= a part of one). A transfer policy that gates one module of a unit and not
        another gives both, "int8/bf16"."""
        return self._layer().model.unit_routes()

    def image_bytes(self, unit: int, precision: str) -> int:
        """The bytes unit `unit` moves per fetch in `precision` ("bf16", "int8" or "nf4")."""
        layer = self._layer()
        modules = layer.layout.unit_modules
        if not 0 <= int(unit) < len(modules):
            raise IndexError("image_bytes(): unit %d is out of range (there are %d)" % (int(unit), len(modules)))
        return sum(layer.model.image_bytes(m, precision) for m in modules[int(unit)])

    @contextlib.contextmanager
    def calibrating(self, model: torch.nn.Module | None = None):
        """A calibration step, before training: `with layers.calibrating(): model(**batch).loss.backward()`.
        The forward and backward run as in training, on real batches (several backwards
        accumulate: divide each loss by their number, as gradient accumulation does); no
        optimizer steps. At the end the policy takes the step's gradients (policy v3: the
        signal table, docs/policy.md) and allocates, so the first training step already moves
        the chosen routes. It is a step of the policy (its own step number), ended with the loss
        given to report_loss() inside it, if any.

        The gradients it made are dropped and those before it restored: the streamed blocks'
        parameters always, and with `model` every parameter of it (the embeddings and head the
        same backward reached); without `model`, zero those before the first step."""
        layer = self._layer()
        if layer.in_step:
            raise RuntimeError("selective_precision: calibrating(): a training step is open (a grad-mode forward ran "
                               "since the last optimizer.step()); call it between steps")
        parameters = {id(p): p for p in self.parameters()}
        if model is not None:
            if not isinstance(model, torch.nn.Module):
                raise TypeError("calibrating(): model= expected the torch.nn.Module whose gradients to restore, got %s"
                                % type(model).__name__)
            parameters.update((id(p), p) for p in model.parameters())
        saved = [(p, p.grad) for p in parameters.values()]
        for p, _ in saved:
            p.grad = None
        completed = False
        layer.calibrating = True
        try:
            yield self
            completed = True
        finally:
            layer.calibrating = False
            try:
                if completed and layer.in_step:
                    layer.end_step()
                elif layer.in_step:
                    layer.abort()
                elif completed:
                    raise RuntimeError("selective_precision: calibrating(): no grad-mode forward of the streamed blocks "
                                       "ran inside it; run the model and loss.backward() within the with-block")
            finally:
                for p, grad in saved:
                    p.grad = grad

    def compare_routes(self, closure, batches, routes_a, routes_b="bf16", *, confidence: float = 0.95):
        """What running on `routes_a` instead of `routes_b` costs, measured: for each batch,
        `closure(batch)` runs the model forward under each allocation (no_grad, the same random
        state for both) and returns its loss, the batch's or one per example, or a tuple
        (loss, scores) whose scores hold logits over their last dimension (then KL(b || a) of
        their softmax is measured too, each leading index of the scores one example). A route is one format for every unit, a
        list of one per unit (as routes() gives them), or a dict of unit name to format.

        Forward only, between steps: the masters, images, routes, policy state and the random
        streams of the CPU and the model's device are left as they were. Returns a RouteComparison: the paired loss difference a - b with
        its `confidence` interval (over examples when the closure gives one loss per example, else
        over batches), the KL where scores were given, and each allocation's bytes saved. Call it
        on every rank with sharded masters."""
        from ._measure import compare_routes

        return compare_routes(self._layer(), closure, batches, routes_a, routes_b, confidence)

    def compare_allocations(self, closure, batches, allocations, reference="bf16", *,
                            confidence: float = 0.95) -> dict:
        """compare_routes() of several allocations against one reference on the same batches:
        `allocations` maps a name to routes (as compare_routes' routes_a). Per batch the
        reference runs once, then each allocation from the same random state; returns a dict of
        name to RouteComparison, each what compare_routes() gives that allocation alone, so
        two of them pair up example by example (`example_kl`, `example_loss_differences`)."""
        from ._measure import compare_allocations

        return compare_allocations(self._layer(), closure, batches, allocations, reference, confidence)

    def calibrate(self, closure, batches, *, formats=_QUANTIZED_ROUTES, confidence: float = 0.95,
                  rho: float | None = 0.9, max_batches: int = 32, round_batches: int = 2,
                  remeasure_on_drift: bool = True) -> "UnitCosts":
        """What each unit costs alone in each format, measured forward only (compare_routes()'s
        yardstick, with `closure` as there): per unit and format, that unit alone in the format
        against all-BF16, the KL per example where the closure returns scores, else the loss
        difference, each with its `confidence` interval. `batches` may be a list or an iterator (a
        DataLoader): they are taken `round_batches` at a time until the units' ranking repeats,
        Spearman's rho between the even and the odd batches' costs at least `rho` for every
        format (tested from the second round on; rho=None: never), or `max_batches` were measured, or the batches ran out
        (`stopped_because` says which). Each batch runs 1 + units x formats passes. Returns a UnitCosts; the layer's
        state is left as compare_routes() leaves it. With `remeasure_on_drift` the layer keeps
        `closure` and the batches measured, and when the policy asks during training (v4: a unit's
        gradients drifted beyond their noise) measures its boundary again on them, after a
        torch.optim step (`remeasurements`), in the mode the model is in then (training: put
        the model in eval mode inside the closure for a measurement without dropout); a later
        calibrate() whose costs the policy takes replaces them, and close() drops them."""
        from ._measure import calibrate

        return calibrate(self._layer(), closure, batches, formats, confidence, rho, max_batches, round_batches,
                         remeasure_on_drift)

    @property
    def remeasurements(self) -> "list[Remeasurement]":
        """The measurements of its boundary that the policy asked for during training, in order."""
        return list(self._layer().remeasurements)

    def policy_report(self) -> "PolicyReport":
        """Where each unit stands (a streamed block, "3", or with units= a part of one, "3.mlp"):
        one dict per unit with `unit`, `route` (its next fetch's format), `bytes` and
        `predicted_cost` per tier (the cost the plugin decides with: v3's smoothed predicted loss
        cost, v4's measured upper bound; None where there is none), as a
        list whose `budget` says the budget, the allocation's fraction of all-BF16's bytes and
        predicted loss, and whether it is met (None without a budget)."""
        layer = self._layer()
        costs = {p: layer.model.unit_costs(p) for p in _ROUTES}
        units = []
        for u, route in enumerate(self.routes()):
            units.append({
                "unit": layer.layout.unit_names[u],
                "route": route,
                "bytes": {p: self.image_bytes(u, p) for p in _ROUTES},
                "predicted_cost": {p: None if c is None or math.isnan(c[u]) else c[u] for p, c in costs.items()},
            })
        return PolicyReport(units, layer.model.budget_status(), layer.fetches())

    def plugin_version(self) -> str:
        """The loaded policy plugin's version."""
        return self._layer().model.plugin_version()

    def poll_plugin(self, force: bool = False):
        """Hot-swaps the policy plugin if its file changed (or `force`), at the next step's start:
        a PluginSwap, or None when nothing happened."""

        return self._layer().model.poll_plugin(bool(force))

    def close(self) -> None:
        """Releases the engines and the plugin; a streamed block called after it raises."""
        layer = self._layer()
        layer.model.close()
        layer.unhook_optimizers()
        layer.kept_measurement = None

    def export_state(self) -> dict:
        """This rank's masters ("master/block<i>.<name>"; with shard_masters, those of its own
        blocks), the policy's state, routes and counters, as named CPU tensors for torch.save: the
        state a sharded run saves per rank. Between steps."""
        return self._layer().model.export_state()

    def restore_state(self, state: dict) -> None:
        """Restores what export_state() returned on this rank (collective with shard_masters);
        a bad entry raises StateEntryError naming it, and nothing changes."""
        layer = self._layer()
        layer.model.restore_state(dict(state))

    @contextlib.contextmanager
    def full_state_dict(self):
        """`with layers.full_state_dict(): state = model.state_dict()`: with shard_masters, the state
        dict holds every streamed block's weights in full, each sent by the rank that keeps it, as
        FSDP's full state dict does. Collective: every rank takes its state dict inside it, at the
        same point. Loading one needs no context (each rank keeps its own blocks' masters, and
        checks the shapes of the others'), but every rank loads it. Without shard_masters the state
        dict is whole already; the context changes nothing."""
        layer = self._layer()
        layer.gathering = True
        try:
            yield self
        finally:
            layer.gathering = False

    def get_extra_state(self):
        """The policy's state, hints and counters (not the masters: they are the parameters), as
        one uint8 tensor, so that safetensors and save_pretrained can store it."""
        layer = self._layer()
        layer.end_step_if_updated()
        if layer.in_step:
            raise RuntimeError("selective_precision: state_dict() inside a step (after a grad-mode forward, before "
                               "the update): the policy's state is mid-step. Take it after optimizer.step() or your "
                               "own update of the weights")
        state = {k: v for k, v in layer.model.export_state().items() if not k.startswith("master/")}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)

    def set_extra_state(self, state):
        """Restores what get_extra_state() returned (load_state_dict calls it): the policy resumes
        with the same decisions. A bad entry raises StateEntryError naming it."""
        layer = self._layer()
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
            raise ValueError("selective_precision: the streamed layers' _extra_state: a uint8 tensor expected, got %r"
                             % type(state).__name__)
        entries = torch.load(io.BytesIO(state.numpy().tobytes()), weights_only=True)
        for b, block in enumerate(layer.blocks):
            for name in layer.streamed_names[b]:
                entries["master/%s.%s" % (layer.layout.block_name(b), name)] = _parameter_at(block(), name).detach()
        layer.model.restore_state(entries)

    def __reduce_ex__(self, protocol):
        raise TypeError(_NOT_PICKLABLE)


def _tolerate_missing_extra_state(module, incompatible_keys):
    """A state dict of the unwrapped model has no policy state: the policy goes on with its own."""
    missing = [k for k in incompatible_keys.missing_keys if k.endswith("_extra_state")]
    for key in missing:
        incompatible_keys.missing_keys.remove(key)
        _log.info("selective_precision: %s not in the state dict loaded; the policy keeps its state", key)


def stream(blocks: torch.nn.ModuleList, config=None, *, streamed=None, units=None,
           options: StreamOptions | None = None, **keywords) -> StreamedLayers:
    """Streams the blocks of a model: returns a ModuleList of the same blocks, each run through
    the layer, to be assigned back, `model.model.layers = sp.stream(model.model.layers, config=...)`.

    The model's own loop then calls the blocks as before, with any arguments: tensors, None,
    numbers, tuples of tensors such as (cos, sin); a block returns a tensor, or a tuple or list
    whose tensors are all differentiable. Every pass calls each block once, in any order (the
    streaming engine fetches them ahead in the order the passes last called them in); several
    may come before their backwards (a contrastive loss), and torch.utils.checkpoint
    (use_reentrant=False) or Hugging Face's gradient_checkpointing_enable() may wrap the blocks.
    Under torch.no_grad() a pass is an evaluation.

    Each streamed parameter (default: every 2-D floating-point `*weight` of block 0's names but
    adapters: peft's `lora_A`/`lora_B`/`lora_embedding_*`, and any trainable matrix under 1/16 of
    the block's largest frozen one) is now its fp32 master on the host, the module's own
    Parameter under its own name; the rest (adapters, biases, norms) stay where they are, in
    their own dtype. The plain loop is the whole protocol: `loss.backward()`, optionally
    `clip_grad_norm_`, `optimizer.step()`, `scheduler.step()`, `optimizer.zero_grad()`; the
    first grad-mode call of a pass opens a step, and the optimizer step that updates the
    streamed weights gives the policy their gradient moments before it and rebuilds the images
    after it. `layers.report_loss(loss)` before it feeds the policy's loss guard. An update
    without torch.optim (by hand, another optimizer, load_state_dict, an edit in place) is seen
    by the weights' version counters: the next grad-mode pass ends the step it
    closed, and streams the new weights (writes through `.data` bypass the counters: avoid them).

    config: the policy's settings (a YAML path, YAML text or a mapping; None: defaults).
    streamed: the parameter names, within a block, that stream (default above).
    units: the policy's units within each block, each with its own route, as {unit name: [prefix,
        ...]}: each prefix names a submodule of the block ("self_attn." for Llama's attention;
        BERT's MLP is ["intermediate.", "output."]), which then streams as a module of its own.
        The block's forward may call them in any order, and every streamed weight must lie in
        one. Unit i.name is the policy's unit (routes(), policy_report(), a static policy's
        force_*_blocks count units); the rest of the block (norms) stays resident. None: a block is a unit. A checkpoint (torch.utils.checkpoint,
        gradient_checkpointing_enable()) cannot wrap a block of several units.
    options: a StreamOptions, or its fields as keyword arguments (device, compute_dtype,
        recompute, budget, ...). budget=Budget(...) is for policy v3: the config's mode becomes
        budget with this budget (`sp.config_dir()/policy/v3.yaml` holds v3's other settings).
    """

    options = _options("stream()", options, keywords)
    modules = list(blocks)
    if not modules:
        raise ValueError("stream(): the module list is empty")
    for i, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise TypeError("stream(): blocks[%d] is a %s, not a torch.nn.Module" % (i, type(module).__name__))
        if isinstance(module, StreamedBlock):
            raise ValueError("stream(): blocks[%d] is streamed already" % i)
    if options.recalibrate_every:
        raise ValueError("stream(): recalibrate_every needs blocks of one tensor in and out; use StreamedBlocks")
    names = list(streamed) if streamed is not None else _streamed_names(modules[0])
    layout = _Layout(modules, names, units, options.moments_from)
    _warn_trainable_streamed_in_frozen_blocks(modules, names)
    for module in modules:
        _masters_in_place(module, names)
    full_shapes = [{n: tuple(_parameter_at(m, n).shape) for n in names}
                   for m, names in zip(layout.modules, layout.names)]
    # The extension holds the modules weakly: they hold the layer (module._sp_layer), which holds
    # it, and a strong hold from C++ would be a cycle the collector cannot see, keeping a dropped
    # model's masters, pinned buffers and engines for the life of the process.
    model = _streamed_model([weakref.proxy(m) for m in layout.modules], layout.names, config, options,
                            calls=[_default_call(m) for m in layout.modules], moments_from=layout.moments_from,
                            block_names=layout.block_names(), units=layout.units())
    layer = _Layer(model, layout, full_shapes)
    for index, module in enumerate(layout.modules):
        module.__class__ = _streamed_class(type(module))
        module._sp_layer = layer
        module._sp_index = index
    out = StreamedLayers(modules, layer)
    if model.sharded():
        for module in layout.modules:
            _add_hook(module, "register_state_dict_post_hook", "_register_state_dict_hook", _gathered_state_dict)
            _add_hook(module, "register_load_state_dict_pre_hook", "_register_load_state_dict_pre_hook",
                      _load_owned_masters_only, with_module=True)
        out.register_load_state_dict_post_hook(_share_loaded_masters)
    # The layer holds the modules weakly (layer.blocks), as they hold it: its layout lets go too,
    # so that a dropped model is freed without waiting for the cycle collector.
    layout.modules = ()
    out.register_load_state_dict_post_hook(_tolerate_missing_extra_state)
    return out


class _Layout:
    """What stream() hands the extension: the modules it streams (the blocks, or with units=
    their parts, in the order units= lists them), each one's path in the block list and streamed names, and the
    policy's units over them. Checked before anything changes."""

    def __init__(self, blocks, names, units, moments_from):
        self.units_given = units is not None
        if units is None:
            self.modules = list(blocks)
            self.paths = [str(i) for i in range(len(blocks))]
            self.names = [list(names)] * len(blocks)
            self.moments_from = [list(moments_from)] * len(blocks)
            self.unit_names = list(self.paths)
            self.unit_modules = [[i] for i in range(len(blocks))]
            return
        parts = _unit_parts(blocks[0], units)
        prefixes = [path for _, paths in parts for path in paths]
        by_path = _split_by_prefix(names, prefixes, "streamed")
        moments_by_path = _split_by_prefix(moments_from, prefixes, "moments_from")
        for unit, paths in parts:
            for path in paths:
                if not by_path[path]:
                    raise ValueError("stream(): units[%r]: %s. streams no weight of blocks[0] (streamed: %s)"
                                     % (unit, path, ", ".join(names)))
        self.modules, self.paths, self.names, self.moments_from = [], [], [], []
        self.unit_names, self.unit_modules = [], []
        for i, block in enumerate(blocks):
            for unit, paths in parts:
                self.unit_names.append("%d.%s" % (i, unit))
                self.unit_modules.append(list(range(len(self.modules), len(self.modules) + len(paths))))
                for path in paths:
                    self.modules.append(_submodule(block, path, i, unit))
                    self.paths.append("%d.%s" % (i, path))
                    self.names.append(by_path[path])
                    self.moments_from.append(moments_by_path[path])

    def block_name(self, index):
        """The extension's name of streamed module `index` (its state's "master/<name>.<param>")."""
        return "block" + self.paths[index]

    def block_names(self):
        return [self.block_name(i) for i in range(len(self.modules))] if self.units_given else []

    def units(self):
        return [(name, len(m)) for name, m in zip(self.unit_names, self.unit_modules)] if self.units_given else []


def _unit_parts(block, units):
    """units= checked against a block: [(unit name, [submodule path, ...])]."""
    if not isinstance(units, collections.abc.Mapping) or not units:
        raise TypeError("stream(): units= expected a non-empty mapping {unit name: [prefix, ...]}, got %r" % (units,))
    parts = []
    for unit, prefixes in units.items():
        if not isinstance(unit, str) or not unit or "." in unit:
            raise ValueError("stream(): units: a unit's name is a non-empty string without dots, got %r" % (unit,))
        if isinstance(prefixes, str) or not isinstance(prefixes, collections.abc.Sequence) or not prefixes:
            raise TypeError("stream(): units[%r] expected a non-empty list of prefixes, got %r" % (unit, prefixes))
        paths = []
        for prefix in prefixes:
            path = prefix[:-1] if isinstance(prefix, str) and prefix.endswith(".") else prefix
            if not isinstance(path, str) or not path:
                raise ValueError("stream(): units[%r]: %r is not a submodule prefix such as \"mlp.\"" % (unit, prefix))
            paths.append(path)
        parts.append((unit, paths))
    every = [(unit, path) for unit, paths in parts for path in paths]
    for unit, path in every:
        _submodule(block, path, 0, unit)
        for other_unit, other in every:
            if other != path and (other + ".").startswith(path + "."):
                raise ValueError("stream(): units[%r]'s %s. holds units[%r]'s %s.: each weight lies in one unit"
                                 % (unit, path, other_unit, other))
        if sum(p == path for _, p in every) > 1:
            raise ValueError("stream(): units: %s. is named twice" % path)
    return parts


def _submodule(block, path, index, unit):
    try:
        return block.get_submodule(path)
    except AttributeError:
        children = ", ".join(name for name, _ in block.named_children())
        raise ValueError("stream(): units[%r] names %s., which blocks[%d] (%s) has no submodule of (its children: %s)"
                         % (unit, path, index, type(block).__name__, children)) from None


def _split_by_prefix(names, paths, what):
    """Block-relative parameter names, by the submodule path each lies under, made relative to it."""
    out = {path: [] for path in paths}
    for name in names:
        path = next((p for p in paths if name.startswith(p + ".")), None)
        if path is None:
            raise ValueError("stream(): %s names %s, which lies in no unit (units: %s): add its submodule to a unit, "
                             "or leave it out of %s" % (what, name, ", ".join(p + "." for p in paths), what))
        out[path].append(name[len(path) + 1:])
    return out


def _gathered_state_dict(module, state_dict, prefix, local_metadata):
    """With shard_masters a block's masters live on its owner alone: elsewhere its parameters are
    empty. Inside StreamedLayers.full_state_dict() each owner sends them to every rank; outside it
    a state dict would hold empty tensors as if they were the weights, and is refused."""
    layer = module._sp_layer
    if not layer.gathering:
        raise RuntimeError(
            "selective_precision: %s: with shard_masters each rank holds only its own blocks' masters, so this state "
            "dict would hold empty tensors for the other ranks' blocks. Take it on every rank inside "
            "`with layers.full_state_dict():` (each block's owner sends it whole), or save each rank's "
            "StreamedLayers.export_state()" % module._sp_name())
    gathered = layer.model.gather_masters(module._sp_index)
    for name in layer.streamed_names[module._sp_index]:
        state_dict[prefix + name] = gathered[name].detach()


def _load_owned_masters_only(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    """A whole state dict loaded with shard_masters: each rank takes its own blocks' masters; for
    another rank's block it checks the entry's shape and keeps its empty placeholder."""
    layer = module._sp_layer
    if layer.model.owner(module._sp_index) == layer.model.rank():
        return
    for name in layer.streamed_names[module._sp_index]:
        key = prefix + name
        if key not in state_dict:
            continue
        shape = layer.full_shapes[module._sp_index][name]
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
            errors.append("size mismatch for %s: copying %s from the checkpoint, the streamed master is %s (kept by "
                          "rank %d)" % (key, tuple(value.shape) if isinstance(value, torch.Tensor) else
                                        type(value).__name__, shape, layer.model.owner(module._sp_index)))
        state_dict[key] = _parameter_at(module, name).detach()


def _share_loaded_masters(module, incompatible_keys):
    """Every rank loaded (load_state_dict is collective with shard_masters): each owner rebuilds the
    images of the masters it loaded and sends them to the others."""
    module._layer().model.refresh_images()


def _masters_in_place(module, names):
    """Each streamed parameter becomes its fp32 master on the host, the module's own Parameter:
    kept when it is one already (an optimizer made before stream() still holds it)."""
    for name in names:
        owner, leaf = _owner(module, name)
        param = owner._parameters.get(leaf)
        if param is None:
            known = ", ".join(n for n, _ in module.named_parameters())
            raise ValueError("stream(): %s has no parameter '%s' (it has: %s)" % (type(module).__name__, name, known))
        if param.device.type == "cpu" and param.dtype == torch.float32 and param.is_contiguous():
            continue
        with torch.no_grad():
            master = param.detach().to("cpu", torch.float32, copy=True).contiguous()
        owner._parameters[leaf] = torch.nn.Parameter(master, requires_grad=param.requires_grad)


def _default_call(module):
    """A block's call with positional tensors alone (the layer's own passes). It holds the module
    weakly, as the extension does (stream())."""
    cls = type(module)
    held = weakref.ref(module)

    def call(inputs, weights):
        module = held()
        if module is None:
            raise RuntimeError("selective_precision: a streamed block was called after its module was freed")
        with _weights_in(module, weights):
            out = cls.forward(module, *inputs)
        return [out] if isinstance(out, torch.Tensor) else [o for o in pytree.tree_leaves(out)
                                                            if isinstance(o, torch.Tensor)]

    return call


__all__ = ["stream", "Budget", "StreamedLayers", "StreamedBlock"]
