"""Selective Precision for PyTorch training scripts.

Wrap the blocks of a model (a ``torch.nn.ModuleList`` such as ``model.transformer.h``) and
their weights stream from host memory, one block at a time, in the precision a policy plugin
chooses per block: BF16, INT8 or NF4. The fp32 masters stay on the host; ``loss.backward()``
fetches the blocks again in reverse and puts the gradients in the masters' ``.grad``, so a
stock ``torch.optim`` optimizer steps them::

    import selective_precision as sp
    streamed = sp.StreamedBlocks(model.blocks, config="policy.yaml")
    optimizer = torch.optim.AdamW(streamed.optimizer_parameters(model), lr=3e-4)
    for step in range(steps):
        with streamed.step(step, optimizer) as s:
            s.loss = loss_fn(model(x), y)    # model.forward calls streamed(h)
            s.loss.backward()
        print(s.report.routes, s.report.saved_fraction)

Data parallelism: launch the script with torchrun, call
``torch.distributed.init_process_group("gloo")`` (on GPUs
``"cpu:gloo,cuda:nccl"``), give each rank its share of the batch and pass
``process_group=torch.distributed.group.WORLD``; every rank then takes the same decisions
(docs/integration.md, "Python").

Messages of the layer and of the policy plugin go to Python's ``logging``, logger
``selective_precision`` (with no handler configured, warnings and errors reach stderr).

This is a binding of the C++ LibTorch layer (``sp/torch_layer/streamed_model.h``): the rules,
errors and state are the same (docs/integration.md, "Python").
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref

import torch  # loads libtorch before the extension that links it

from . import _build_info


def _torch_build(version):
    """What a torch version fixes for an extension linked against it: the minor (its C++ ABI)
    and the local build tag (cu130, cpu: which CUDA runtime its libraries need).
    '2.15.1+cu130' -> ('2.15', 'cu130')."""
    public, _, local = version.partition("+")
    return ".".join(public.split(".")[:2]), local


def _check_torch():
    """The extension links the libtorch it was built against: under another torch minor (or
    another CUDA build of it) it would fail to load on a missing symbol, or load and misread
    torch's objects. Refuse it by name, before the extension is loaded. A patch release of the
    same minor and build is the torch the wheel's metadata admits (torch>=2.15,<2.16)."""
    found_abi = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    built = _torch_build(_build_info.torch_version)
    found = _torch_build(torch.__version__)
    if found != built or found_abi != _build_info.torch_cxx11_abi:
        raise ImportError(
            "selective_precision %s was built against torch %s (C++11 ABI %d), but this Python imports "
            "torch %s (C++11 ABI %d) from %s. Install the torch it was built for (pip install 'torch==%s.*'), "
            "or rebuild it against this torch, from the project's source: pip install --no-build-isolation "
            "--force-reinstall . (docs/packaging.md)"
            % (
                _build_info.version,
                _build_info.torch_version,
                _build_info.torch_cxx11_abi,
                torch.__version__,
                found_abi,
                os.path.dirname(torch.__file__),
                built[0],
            )
        )


_check_torch()

from . import _selective_precision as _extension  # noqa: E402
from ._selective_precision import (  # noqa: E402,F401  (re-exported)
    CalibrationErrors,
    CollectiveError,
    PluginError,
    PluginSwap,
    RankMismatchError,
    StateEntryError,
    StepReport,
)
from ._measure import Interval, PolicyReport, Remeasurement, RouteComparison, UnitCosts  # noqa: E402
from ._modules import _add_hook, _streamed_names, _warn_trainable_streamed_in_frozen_blocks  # noqa: E402
from ._options import Budget, StreamOptions, _options, _streamed_model  # noqa: E402
from ._paths import config_dir, default_plugin_dir  # noqa: E402
from ._step import _before_update  # noqa: E402
from ._stream import StreamedBlock, StreamedLayers, stream  # noqa: E402

__version__ = _build_info.version

PluginError.__doc__ = "The policy plugin could not be loaded, or it rejected its config or a call."
StateEntryError.__doc__ = "An entry of a state given to restore_state() is missing or wrong; the message names it."
CollectiveError.__doc__ = "A collective call across the ranks failed or timed out (a rank died, say)."
RankMismatchError.__doc__ = "The ranks disagree where they must agree (their plugins' hints, a restore)."

__all__ = [
    "stream",
    "StreamOptions",
    "Budget",
    "PolicyReport",
    "RouteComparison",
    "Interval",
    "UnitCosts",
    "Remeasurement",
    "StreamedLayers",
    "StreamedBlock",
    "StreamedBlocks",
    "StepContext",
    "StepReport",
    "PluginSwap",
    "CalibrationErrors",
    "quantize_nf4",
    "dequantize_nf4",
    "adamw_step_",
    "quantize_int8",
    "dequantize_int8",
    "default_plugin_dir",
    "config_dir",
    "cmake_prefix_path",
    "PluginError",
    "StateEntryError",
    "CollectiveError",
    "RankMismatchError",
]

def _installed_cmake_prefix() -> str | None:
    import glob

    here = os.path.dirname(os.path.abspath(__file__))
    # lib/, lib64/ or a multiarch lib/<triplet>/, as GNUInstallDirs named the build's libdir.
    for pattern in ("lib*", os.path.join("lib", "*")):
        if glob.glob(os.path.join(here, pattern, "cmake", "SelectivePrecision", "SelectivePrecisionConfig.cmake")):
            return here
    return None


#: The prefix of the C++ package installed with this one (its headers, archives and
#: ``lib/cmake/SelectivePrecision``), for ``CMAKE_PREFIX_PATH`` beside
#: ``torch.utils.cmake_prefix_path``; None for a package run from a build tree, whose C++
#: package is ``cmake --install``'s to make (docs/integration.md, "C++ from the wheel").
cmake_prefix_path: str | None = _installed_cmake_prefix()


def quantize_nf4(x: torch.Tensor, group_size: int = 64, *, scale_dtype: torch.dtype = torch.float32,
                 threads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """QLoRA's NF4 of a 2-D float32 or bfloat16 CPU tensor with an even number of columns, bit
    for bit as bitsandbytes computes it: `(codes, scales)`. `codes` is uint8 of shape
    (rows, cols // 2), two 4-bit codes a byte, the first of a pair in the high nibble; for
    rows whose length is a multiple of `group_size` they are the bytes of
    `bitsandbytes.functional.quantize_4bit(x, blocksize=group_size, quant_type="nf4")`.
    `scales` has shape (rows, ceil(cols / group_size)), each group's absmax: float32 as
    bitsandbytes stores it, or, with `scale_dtype=torch.bfloat16`, rounded to nearest as the
    layer's images store it (docs/kernels.md, "NF4"). A group holding NaN or Inf gets scale NaN
    and dequantizes to NaN. `threads`: 0 for torch's own intra-op threads (as many as
    torch.get_num_threads()), else that many threads of the kernels' own; the result does not
    depend on it."""
    return tuple(_extension._quantize_nf4(x, int(group_size), scale_dtype, int(threads)))


def dequantize_nf4(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 64,
                   dtype: torch.dtype = torch.bfloat16, *, threads: int = 0,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The weights an NF4 image stands for (what quantize_nf4 returned), in `dtype`
    (bfloat16, as the layer computes with them, or float32): level * scale in float32, then
    rounded to `dtype`. With float32 scales this equals bitsandbytes' dequantize_4bit exactly;
    with bfloat16 scales it is within one bfloat16 ulp of it. Written into `out` when given (a
    contiguous CPU tensor of that shape and dtype), as the layer writes into its slots."""
    return _extension._dequantize_nf4(codes, scales, int(group_size), dtype, int(threads), out)


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], *, lr: float, step: int, betas: tuple[float, float] = (0.9, 0.999),
                eps: float = 1e-8, weight_decay: float = 0.0, image: str | None = None,
                group_size: int | None = None, threads: int = 0,
                out: torch.Tensor | None = None) -> torch.Tensor | None:
    """One AdamW step on float32 CPU tensors (1-D or 2-D, contiguous), in place, with the
    layer's host optimizer (docs/kernels.md, "The fused host optimizer"): decoupled weight
    decay as torch.optim.AdamW, `step` counting from 1. With `image` ('bf16', 'int8' or
    'nf4') the same sweep writes the transfer image of the updated weights, as the layer's
    fused update does, and returns it (a uint8 tensor: the slab, docs/kernels.md, "The slab");
    `group_size` defaults to 0 (one scale per row) for INT8 and 64 for NF4; `out`, an image
    returned before for the same shapes and format, is written again instead of a new one, as
    the layer reuses its pinned slabs. Returns None without an image. `threads` as for
    quantize_nf4."""
    return _extension._adamw_step(list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), float(lr), int(step),
                                  float(betas[0]), float(betas[1]), float(eps), float(weight_decay), image,
                                  None if group_size is None else int(group_size), int(threads), out)


def quantize_int8(x: torch.Tensor, group_size: int = 0, *, threads: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The INT8 image the layer streams, of a 2-D float32 or bfloat16 CPU tensor: `(codes,
    scales)`, int8 codes of x's shape and float32 scales of shape (rows, groups): one per row
    for group_size 0, else one per group of 32, 64, 128 or 256 along a row (absmax / 127,
    round to nearest even; docs/kernels.md)."""
    return tuple(_extension._quantize_int8(x, int(group_size), int(threads)))


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, group_size: int = 0,
                    dtype: torch.dtype = torch.bfloat16, *, threads: int = 0,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The weights an INT8 image stands for (what quantize_int8 returned), in `dtype`;
    written into `out` when given, as for dequantize_nf4."""
    return _extension._dequantize_int8(codes, scales, int(group_size), dtype, int(threads), out)


_NOT_PICKLABLE = (
    "selective_precision: a model whose blocks are streamed cannot be pickled whole (torch.save(model)): its "
    "weights live in the StreamedBlocks' host masters, not in the modules. Save model.state_dict() instead, which "
    "holds them"
)


class _MasterHooks:
    """A streamed weight is an empty tensor in its module: the module's state_dict() holds the
    fp32 master in its place (under the same key), and load_state_dict() copies into the master
    (the images are rebuilt before the next pass), so that a state dict round-trips between a
    streamed model and a plain one. Holds the StreamedBlocks weakly: once it is gone (or
    closed), the hooks raise rather than save or load empty weights."""

    def __init__(self, streamed, index):
        self._owner = weakref.ref(streamed)
        self._index = index

    def __reduce__(self):
        raise TypeError(_NOT_PICKLABLE)

    def _live(self):
        blocks = self._owner()
        if blocks is None or blocks.closed:
            raise RuntimeError(
                "selective_precision: the StreamedBlocks that streamed this module is closed or gone, and its "
                "weights with it; the module's streamed parameters are empty placeholders"
            )
        if blocks.sharded:
            raise RuntimeError(
                "selective_precision: with shard_masters each rank holds only its own blocks' masters; save and "
                "restore StreamedBlocks.export_state() on every rank instead of the modules' state_dict()"
            )
        return blocks

    def put_masters(self, module, state_dict, prefix, local_metadata):
        blocks = self._live()
        masters = blocks.masters(self._index)
        for name in blocks._streamed_names:
            key = prefix + name
            if key in state_dict:
                keep_vars = isinstance(state_dict[key], torch.nn.Parameter)
                state_dict[key] = masters[name] if keep_vars else masters[name].detach()

    def take_masters(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        blocks = self._live()
        masters = blocks.masters(self._index)
        for name in blocks._streamed_names:
            key = prefix + name
            if key not in state_dict:
                continue
            value, master = state_dict[key], masters[name]
            # The placeholder loads (or, with assign=True, is assigned) itself; the weight goes to
            # the master.
            state_dict[key] = module.get_parameter(name)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                errors.append("expected a floating-point tensor for %s, got %r" % (key, type(value).__name__))
            elif value.shape != master.shape:
                errors.append(
                    "size mismatch for %s: copying a param with shape %s from checkpoint, the shape in current "
                    "model is %s." % (key, tuple(value.shape), tuple(master.shape))
                )
            else:
                with torch.no_grad():
                    master.copy_(value)
                blocks._loaded_masters = True


def _keep_weights_in_state_dicts(streamed, modules):
    for index, module in enumerate(modules):
        hooks = _MasterHooks(streamed, index)
        # Wrapped, since torch marks a hook registered publicly with an attribute, which a bound
        # method cannot take.
        _add_hook(module, "register_state_dict_post_hook", "_register_state_dict_hook",
                  functools.partial(hooks.put_masters))
        _add_hook(module, "register_load_state_dict_pre_hook", "_register_load_state_dict_pre_hook",
                  functools.partial(hooks.take_masters), with_module=True)


class StepContext:
    """What `StreamedBlocks.step()` yields: set `loss` (a tensor or a float) inside the block;
    after it, `report` holds what the step moved and decided (a StepReport), `moments` each
    block's gradient moments, and `loss_mean` the loss's mean across ranks (the loss itself in
    one process)."""

    def __init__(self):
        self.loss: torch.Tensor | float | None = None
        self.loss_mean: float | None = None
        self.report: StepReport | None = None
        self.moments: list[dict] | None = None


class StreamedBlocks:
    """The streamed blocks of a model. Call it on the first block's input, as the ModuleList
    would be called; the blocks' matrices are no longer the module's to read or replace.

    blocks: a torch.nn.ModuleList (or any list of modules taking and returning one tensor).
    streamed: the parameter names, relative to a block, that stream (default: its 2-D weights);
        every other parameter stays resident and trains the usual way.
    config: the policy's settings (its section `selective_precision`): a path to a YAML file
        (FileNotFoundError names it when there is none), YAML text, or a mapping of the
        policy's keys; None: the plugin's defaults.
    options: a StreamOptions, or its fields as keyword arguments (device, compute_dtype,
        output_dir, recompute, ...; StreamOptions says what each does). With these blocks:
    process_group: data parallelism over a torch.distributed process group whose collectives
        take CPU tensors (Gloo; NCCL alone is refused with a ValueError, while with
        "cpu:gloo,cuda:nccl" NCCL reduces the gradients on the GPU:
        `gradient_reduction_device`); None: one process. Every rank wraps the same blocks and runs
        the same steps on its own share of the batch. The layer averages the streamed and
        resident parameters' gradients during the backward and keeps every rank's policy on
        the same numbers; the host's own parameters (embeddings, head) are averaged by
        `step()` before the optimizer steps (or by `average_gradients()`), and the step's loss
        is the mean across ranks.
    shard_masters: with a process group, block b's fp32 masters and optimizer state live on
        rank b % world_size alone (ZeRO-1/2 on the host): `master_parameters()` lists this
        rank's, and the owner sends the others each updated block's transfer image.
    """

    def __init__(self, blocks, streamed=None, config=None, *, options: StreamOptions | None = None, **keywords):
        options = _options("StreamedBlocks", options, keywords)
        modules = list(blocks)
        if not modules:
            raise ValueError("StreamedBlocks: the module list is empty")
        if streamed is None:
            streamed = _streamed_names(modules[0])
        _warn_trainable_streamed_in_frozen_blocks(modules, streamed)
        self._streamed_names = list(streamed)
        self._model = _streamed_model(modules, [self._streamed_names] * len(modules), config, options)
        self._placeholders = {id(p) for m in modules for n, p in m.named_parameters() if n in self._streamed_names}
        self._averaged = set()  # ids of the host parameters whose gradients this step averaged
        self._loaded_masters = False
        self._optimizers_checked = weakref.WeakSet()
        _keep_weights_in_state_dicts(self, modules)

    # ---- the model -------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Runs the blocks in order on `x`, streaming each: under grad mode a training pass
        (inside a step), else an evaluation pass (at any time)."""
        self._rebuild_loaded_masters()
        return self._model.forward(x)

    def __reduce__(self):
        raise TypeError(_NOT_PICKLABLE)

    def _rebuild_loaded_masters(self):
        """Masters a load_state_dict() wrote get their images before the next pass."""
        if self._loaded_masters:
            self._loaded_masters = False
            self.refresh_images()

    forward = __call__

    def master_parameters(self) -> list[torch.Tensor]:
        """The fp32 host masters of the streamed parameters: give them to the optimizer."""
        return self._model.master_parameters()

    def masters(self, block: int) -> dict[str, torch.Tensor]:
        """Block `block`'s fp32 masters by parameter name (this rank's blocks when sharded)."""
        return self._model.masters(block)

    def resident_parameters(self) -> list[torch.Tensor]:
        """The blocks' parameters that do not stream (norms, biases): they stay where they
        are and train the usual way."""
        return self._model.resident_parameters()

    # ---- data parallelism ------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This process's rank in the process group (0 without one)."""
        return self._model.rank()

    @property
    def world_size(self) -> int:
        """The ranks in the process group (1 without one)."""
        return self._model.world_size()

    @property
    def sharded(self) -> bool:
        """True when each block's masters live on one rank (shard_masters on > 1 rank)."""
        return self._model.sharded()

    @property
    def gradient_reduction_device(self) -> torch.device:
        """Where the streamed masters' gradients are reduced across ranks: the GPU when the
        group reduces them there with NCCL (then only the reduced gradient crosses to the host),
        else "cpu"."""
        return torch.device(self._model.gradient_reduction_device())

    def owner(self, block: int) -> int:
        """The rank that keeps block `block`'s masters (this rank for every block unsharded)."""
        return self._model.owner(int(block))

    def average_gradients(self, parameters) -> None:
        """Replaces each parameter's .grad by its mean across ranks, in one all-reduce; for the
        host's own parameters, after the backward and before clipping by a gradient norm
        (which then is the same on every rank). Every rank must pass the same parameters in the
        same order. `step()` averages the rest of its optimizer's parameters itself. A no-op in
        one process."""
        parameters = list(parameters)
        self._model.average_gradients(parameters)
        self._averaged.update(id(p) for p in parameters)

    def average(self, value: float) -> float:
        """The mean of a float across ranks; the float itself in one process."""
        return self._model.average(float(value))

    def _host_parameters(self, optimizer):
        """The optimizer's parameters that are neither masters nor blocks' resident
        parameters (the layer averages those), nor averaged already this step."""
        layer_own = {id(p) for p in self.master_parameters()} | {id(p) for p in self.resident_parameters()}
        return [
            p
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) not in layer_own and id(p) not in self._averaged
        ]

    def optimizer_parameters(self, model: torch.nn.Module) -> list[torch.Tensor]:
        """The masters, and every parameter of `model` that is not a streamed placeholder."""
        own = [p for p in model.parameters() if id(p) not in self._placeholders]
        return list(self.master_parameters()) + own

    # ---- the step --------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Opens step `step`. Steps increase over the whole run, across epochs and resumes
        (a ValueError names one that does not)."""
        self._averaged.clear()
        self._rebuild_loaded_masters()
        self._model.take_collective_failure()  # one of an earlier step is that step's
        self._model.begin_step(int(step))

    def post_backward(self, loss: float = float("nan")) -> list[dict]:
        """After the step's last backward: gives the blocks' gradient moments to the policy (and
        to policy v3 the signal table, with `loss` when known) and its hints to the engines;
        returns the moments (sum_sq, sum, max_abs, count, nonfinite per block). A step where no
        block has a gradient is refused (RuntimeError)."""
        return self._model.post_backward(float(loss))

    def end_step(self, loss: float) -> StepReport:
        """After the optimizer stepped the masters: rebuilds their transfer images and ends the
        step with its loss (the policy's loss guard reads it)."""
        return self._model.end_step(float(loss))

    @contextlib.contextmanager
    def step(self, step: int, optimizer: torch.optim.Optimizer | None = None):
        """begin_step on entry; on a normal exit post_backward, optimizer.step() and
        optimizer.zero_grad() (when given) and end_step with the loss set on the context.
        With a process group the host parameters' gradients are averaged before
        optimizer.step() and end_step takes the loss's mean across ranks (also in
        `context.loss_mean`). An optimizer that leaves out some of the trainable masters (it was
        given model.parameters(), whose streamed weights are empty placeholders) is refused
        with a ValueError before the step begins."""
        if optimizer is not None and optimizer not in self._optimizers_checked:
            self._check_optimizer(optimizer)
            self._optimizers_checked.add(optimizer)
        self.begin_step(step)
        context = StepContext()
        try:
            yield context
        except BaseException as error:
            self._drop_step()
            # A collective that failed in loss.backward() reaches here as autograd's
            # RuntimeError: raise it as what it is.
            failure = self._model.take_collective_failure()
            if failure is not None and not isinstance(error, CollectiveError):
                raise CollectiveError(failure) from error
            raise
        if context.loss is None:
            self._drop_step()
            raise ValueError("StreamedBlocks.step(): set .loss on the step context before leaving it")
        loss = context.loss.item() if isinstance(context.loss, torch.Tensor) else float(context.loss)
        try:
            rest = (lambda: self._host_parameters(optimizer)) if optimizer is not None else None
            loss, context.moments = _before_update(self._model, loss, rest)
            context.loss_mean = loss
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
            context.report = self.end_step(loss)
        except BaseException:
            self._drop_step()  # refused (no backward in the step, say), or failed
            raise

    def _check_optimizer(self, optimizer):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        trainable = [m for m in self.master_parameters() if m.requires_grad]
        left_out = sum(id(m) not in stepped for m in trainable)
        if left_out:
            raise ValueError(
                "StreamedBlocks.step(): the optimizer steps %d of the %d trainable masters of the streamed "
                "weights, so the rest would never train. Give it optimizer_parameters(model): model.parameters() "
                "lists the streamed weights' empty placeholders, not their masters"
                % (len(trainable) - left_out, len(trainable))
            )

    def _drop_step(self):
        """Ends the open step as failed (the plugin sees a failed step), so that the next one can
        begin, and clears the masters' gradients of the dropped step."""
        self._model.abort_step()
        for master in self.master_parameters():
            master.grad = None

    def abort_step(self) -> None:
        """Ends a step an exception cut short; zero the masters' gradients afterwards."""
        self._model.abort_step()

    def refresh_images(self) -> None:
        """Rebuilds the transfer images from the masters: after changing them outside a step
        (loading weights, an edit)."""
        self._model.refresh_images()

    # ---- policy ----------------------------------------------------------------------------

    def calibrate(self, samples) -> CalibrationErrors:
        """Measures each block's INT8 and NF4 output error on first-block inputs `samples`
        and gives them to the plugin."""
        return self._model.calibrate(list(samples))

    def poll_plugin(self, force: bool = False) -> PluginSwap | None:
        """Hot-swaps the plugin if its file changed (or `force`): None when nothing happened."""
        return self._model.poll_plugin(bool(force))

    def routes(self) -> list[str]:
        """Each block's current format: "bf16", "int8" or "nf4"."""
        return self._model.routes()

    def plugin_version(self) -> str:
        """The loaded policy plugin's version."""
        return self._model.plugin_version()

    def image_bytes(self, block: int, precision: str) -> int:
        """The bytes block `block` moves per fetch in `precision` ("bf16", "int8" or "nf4")."""
        return self._model.image_bytes(int(block), precision)

    # ---- state -----------------------------------------------------------------------------

    def export_state(self) -> dict[str, torch.Tensor]:
        """Named CPU tensors (masters, plugin state, routes, counters) for torch.save."""
        return self._model.export_state()

    def restore_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restores what export_state() returned; a bad entry raises StateEntryError naming it,
        and nothing changes."""
        self._model.restore_state(dict(state))

    def close(self) -> None:
        """Releases the engines and the plugin; any later call raises RuntimeError."""
        self._model.close()

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._model.closed
