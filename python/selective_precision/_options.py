"""The options of `stream()` and `StreamedBlocks` (`StreamOptions`, `Budget`), the policy's config
merged with them, and the layer they build (`StreamedModelOptions`, bound from C++)."""

from __future__ import annotations

import collections.abc
import dataclasses
import errno
import json
import logging
import math
import os

import torch

from ._paths import default_plugin_dir
from ._selective_precision import _PolicyUnit, _StreamedModel, _StreamedModelOptions

_log = logging.getLogger("selective_precision")


def _policy_config(config):
    """(YAML text, source name) of `config`: None (the plugin's defaults), a path (str or
    os.PathLike) to a YAML file, YAML text (it has a newline or a "key: value"), or a mapping of
    the policy's keys (with or without the top-level `selective_precision`)."""
    if config is None:
        return "selective_precision: {}\n", "<defaults>"
    if isinstance(config, collections.abc.Mapping):
        section = config if "selective_precision" in config else {"selective_precision": dict(config)}
        try:
            return json.dumps(section), "<config mapping>"  # JSON is YAML
        except TypeError as error:
            raise TypeError("config: a mapping of the policy's keys to numbers, strings, booleans and lists "
                            "expected: %s" % error) from None
    if isinstance(config, os.PathLike) or (isinstance(config, str) and "\n" not in config and ": " not in config):
        path = os.fspath(config)
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, "config: a directory, where the policy's YAML file was expected "
                                    "(for the shipped ones: sp.config_dir() / 'policy' / '<name>.yaml')", path)
        if not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "config: the policy's YAML file was not found", path)
        with open(path, encoding="utf-8") as f:
            return f.read(), path
    if isinstance(config, str):
        return config, "<config text>"
    raise TypeError("config: a path, YAML text or a mapping expected, got %s" % type(config).__name__)


@dataclasses.dataclass(frozen=True)
class Budget:
    """The one budget of policies v3 and v4, `stream(..., budget=Budget(bytes=0.45))` or
    `Budget(loss=0.005)` (v3 only): bytes: a step moves at most this fraction of all-BF16's bytes,
    with the least cost (v3: predicted loss; v4: the measured costs' upper bounds);
    loss: the predicted loss increase stays at most this fraction of the current loss, with the
    fewest bytes. Exactly one is given (docs/policy.md, "Policy v3")."""

    bytes: float | None = None
    loss: float | None = None

    def __post_init__(self):
        given = {k: v for k, v in (("bytes", self.bytes), ("loss", self.loss)) if v is not None}
        if len(given) != 1:
            raise ValueError("Budget: give exactly one of bytes= (a fraction of all-BF16's bytes, in (0, 1]) and "
                             "loss= (a fraction of the current loss, > 0); got %s" % (given or "neither"))
        (key, value), = given.items()
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError("Budget: %s= expected a finite number, got %r" % (key, value))
        if key == "bytes" and not 0 < value <= 1:
            raise ValueError("Budget: bytes= expected a fraction in (0, 1] of all-BF16's bytes, got %r" % value)
        if key == "loss" and not value > 0:
            raise ValueError("Budget: loss= expected a fraction > 0 of the current loss, got %r" % value)

    def as_config(self) -> dict:
        """The budget as the policy's YAML key holds it: {"bytes": F} or {"loss": F}."""
        return {"bytes": float(self.bytes)} if self.bytes is not None else {"loss": float(self.loss)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """How stream() and StreamedBlocks stream, every option with its default in this one place:
    `stream(blocks, config, options=StreamOptions(device="cuda"))`, or the same fields as keyword
    arguments, `stream(blocks, config, device="cuda")`.

    device, compute_dtype: where and in what dtype the blocks compute.
    plugin, plugin_dir: the policy plugin, <plugin_dir>/lib<plugin>.so (plugin_dir None:
        default_plugin_dir()).
    output_dir: where the policy writes its telemetry (its config's telemetry_file); None: the
        policy writes nothing, whatever its config says (a library writes only where asked).
    moments_from: parameter names whose gradients describe a block to the policy (e.g. LoRA
        adapters); default: the streamed ones when they train.
    prefetch_window, spare_slabs: the streaming engine's fetches in flight ahead, and its spare
        host slabs.
    int8_group_size, nf4_group_size: elements per scale of the INT8 (0: one per row) and NF4
        images; nf4_group_size None: the config's nf4_group_size, else 64 (both given must agree).
    metrics_path: a JSONL of the training passes' transfers ("": none).
    recalibrate_every: StreamedBlocks only: every this many steps (0: never) the blocks' INT8 and
        NF4 output errors are measured again for the policy.
    host_bandwidth_cap_gbps: on the CPU, a cap that emulates a link (0: memcpy speed).
    process_group, shard_masters: data parallelism over a torch.distributed process group
        (StreamedBlocks' docstring), and sharded masters (ZeRO-1/2 on the host).
    transfer_policy: sp-bench's transfer policy for this machine (a JSON path); None: the
        plugin's hints stand.
    recompute: what a training pass keeps for its backward. False: the activations, as plain
        autograd keeps them, and each block's weights are fetched again when the backward reaches
        it. True: each block's inputs only, and the backward recomputes the block's forward
        (under the forward's random streams and autocast) before differentiating it: less
        memory, a third more compute. None: False in one process, True with a process_group
        (where False is refused). A host's own torch.utils.checkpoint works either way.
    budget: stream() only: a Budget, for policy v3 (the config's mode becomes budget).
    """

    device: str | torch.device = "cpu"
    compute_dtype: torch.dtype = torch.float32
    plugin: str = "sp_selective_precision"
    plugin_dir: str | None = None
    output_dir: str | os.PathLike | None = None
    moments_from: tuple[str, ...] | list[str] = ()
    prefetch_window: int = 1
    spare_slabs: int = 2
    int8_group_size: int = 0
    nf4_group_size: int | None = None
    metrics_path: str = ""
    recalibrate_every: int = 0
    host_bandwidth_cap_gbps: float = 0.0
    process_group: object = None
    shard_masters: bool = False
    transfer_policy: str | None = None
    recompute: bool | None = None
    budget: Budget | None = None

    def __post_init__(self):
        if self.recompute is not None and not isinstance(self.recompute, bool):
            raise TypeError("StreamOptions: recompute= expected True, False or None, got %s"
                            % type(self.recompute).__name__)
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise TypeError("StreamOptions: budget= expected selective_precision.Budget(bytes=...) or "
                            "Budget(loss=...), got %s" % type(self.budget).__name__)


def _options(caller: str, options, keywords: dict) -> StreamOptions:
    """The options of a call that takes `options=StreamOptions(...)` or its fields as keywords."""
    if options is not None:
        if keywords:
            raise TypeError("%s: give the options once, as options=StreamOptions(...) or as keyword arguments, "
                            "not both (got options= and %s)" % (caller, sorted(keywords)))
        if not isinstance(options, StreamOptions):
            raise TypeError("%s: options= expected a selective_precision.StreamOptions, got %s"
                            % (caller, type(options).__name__))
        return options
    known = {f.name for f in dataclasses.fields(StreamOptions)}
    unknown = set(keywords) - known
    if unknown:
        raise TypeError("%s: unknown option(s) %s; known: %s" % (caller, sorted(unknown), sorted(known)))
    return StreamOptions(**keywords)


def _streamed_model(modules, names, config, options: StreamOptions, calls=None, moments_from=None,
                    block_names=(), units=()):
    """The extension's model of `modules`, with `config` read and merged as `options` say. Per
    module: `names` its streamed parameters, `moments_from` those its moments come from (None:
    options.moments_from for each), `block_names` its name (empty: "block<i>"); `units`: the
    policy's units as (name, number of modules), empty for one per module."""
    config_yaml, config_source = _policy_config(config)
    if options.budget is not None:
        config_yaml, config_source = _with_budget(config_yaml, config_source, options.budget)
    if options.output_dir is None:
        config_yaml, config_source = _without_telemetry(config_yaml, config_source)
    if moments_from is None:
        moments_from = [list(options.moments_from)] * len(modules)
    # sp.StreamOptions onto the layer's own options (StreamedModelOptions), the one place they map.
    bound = _StreamedModelOptions()
    bound.plugin_file = os.path.join(options.plugin_dir or default_plugin_dir(), "lib%s.so" % options.plugin)
    bound.config_yaml = config_yaml
    bound.config_source = config_source
    bound.output_dir = str(options.output_dir or ".")
    bound.device = torch.device(options.device)
    bound.compute_dtype = options.compute_dtype
    bound.host_bandwidth_cap_gbps = float(options.host_bandwidth_cap_gbps)
    bound.prefetch_window = int(options.prefetch_window)
    bound.spare_slabs = int(options.spare_slabs)
    bound.int8_group_size = int(options.int8_group_size)
    bound.nf4_group_size = int(options.nf4_group_size or 0)
    bound.metrics_path = str(options.metrics_path)
    bound.recalibrate_every = int(options.recalibrate_every)
    bound.shard_masters = bool(options.shard_masters)
    bound.transfer_policy = str(options.transfer_policy or "")
    bound.recompute = options.recompute
    bound.units = [_PolicyUnit(name, int(blocks)) for name, blocks in units]
    return _StreamedModel(modules, [list(n) for n in names], [list(m) for m in moments_from], bound,
                          process_group=options.process_group, calls=calls, names=list(block_names))


def _policy_document(config_yaml: str):
    """(document, its policy section's parent, the section's key, its path, the section as a
    mapping) of the policy's YAML,
    or None where the parser here cannot find one section: such YAML goes to the plugin as it
    is, which names the error by line."""
    import yaml  # PyYAML: only here, to merge stream()'s options into the policy's YAML

    try:
        document = yaml.safe_load(config_yaml)
    except yaml.YAMLError:
        return None
    if not isinstance(document, dict):
        return None
    stagehand = document.get("memory", {}).get("stagehand", {}) if isinstance(document.get("memory"), dict) else {}
    sections = [(d, "selective_precision") for d in (document, stagehand if isinstance(stagehand, dict) else {})
                if "selective_precision" in d]
    if len(sections) != 1:
        return None  # the plugin names what is missing or doubled
    parent, key = sections[0]
    path = "selective_precision" if parent is document else "memory.stagehand.selective_precision"
    return document, parent, key, path, parent[key] if isinstance(parent[key], dict) else {}


def _with_budget(config_yaml: str, source: str, budget: Budget) -> tuple[str, str]:
    """The policy's YAML with `budget`, and `mode: budget` where it names no mode, for
    stream(budget=...)."""
    found = _policy_document(config_yaml)
    if found is None:
        return config_yaml, source
    document, parent, key, path, section = found
    wanted = budget.as_config()
    if "budget" in section and section["budget"] != wanted:
        # A shipped config carries a default budget; the caller's argument is the run's, as a
        # keyword overrides a config file's value.
        _log.info("selective_precision: stream(budget=%r) overrides %s's %s.budget %r", budget, source, path,
                  section["budget"])
    mode = section.get("mode", "budget")
    if mode not in ("budget", "measured"):
        raise ValueError("stream(): budget= needs policy v3 (mode budget) or v4 (mode measured), but %s sets %s.mode "
                         "to %r; leave mode out (v3) or set it to budget or measured" % (source, path, mode))
    parent[key] = dict(section, mode=mode, budget=wanted)
    return json.dumps(document), "%s with stream(budget=%r)" % (source, budget)


def _without_telemetry(config_yaml: str, source: str) -> tuple[str, str]:
    """The policy's YAML with its telemetry off, for a caller that named no output_dir: a library
    writes files only where it is asked to (the shipped configs turn telemetry on)."""
    found = _policy_document(config_yaml)
    if found is None:
        return config_yaml, source
    document, parent, key, _, section = found
    if section.get("telemetry_enabled", True) is False:
        return config_yaml, source
    _log.info("selective_precision: %s turns the policy's telemetry on, but no output_dir was given: it stays off "
              "(give output_dir= to write it there)", source)
    parent[key] = dict(section, telemetry_enabled=False)
    return json.dumps(document), source
