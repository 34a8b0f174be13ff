"""Which parameters of a block stream by default, and hooks registered on a module."""

from __future__ import annotations

import warnings

from ._selective_precision import _QUANTIZED_ROUTES

# peft's adapter modules: trainable and small, they stay where they are, in their own dtype.
_ADAPTER_MODULES = frozenset(("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"))
# A trainable matrix under this fraction of the block's largest frozen one is an adapter too (of
# a library other than peft): streaming it would quantize what trains, to save next to nothing.
_ADAPTER_FRACTION = 1 / 16


def _streamed_names(block):
    """By default a block's matrices stream: every 2-D floating-point `*weight`, except adapters
    (peft's `lora_A`, `lora_B`, `lora_embedding_*`, and any trainable matrix under 1/16 of the
    block's largest frozen one). Biases and norms are 1-D, and stay too."""
    matrices = [(name, p) for name, p in block.named_parameters()
                if p.dim() == 2 and p.is_floating_point() and name.endswith("weight")]
    largest_frozen = max((p.numel() for _, p in matrices if not p.requires_grad), default=0)
    return [
        name for name, p in matrices
        if _ADAPTER_MODULES.isdisjoint(name.split("."))
        and not (p.requires_grad and p.numel() < _ADAPTER_FRACTION * largest_frozen)
    ]


def _warn_trainable_streamed_in_frozen_blocks(modules, names):
    """A streamed weight that trains while most of its block is frozen is probably an adapter named
    by hand: it would cross in the policy's precision, and compute in it."""
    block = modules[0]
    params = dict(block.named_parameters())
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    odd = [n for n in names if n in params and params[n].requires_grad and frozen > trainable]
    if odd:
        names = ", ".join(odd[:3]) + (" and %d more" % (len(odd) - 3) if len(odd) > 3 else "")
        verb, pronoun = ("s", "it") if len(odd) == 1 else ("", "them")
        warnings.warn(
            "selective_precision: %s stream%s and train%s while most of the block is frozen (%d of %d elements): "
            "the policy may send %s as %s, and the block computes with that. Adapters usually stay "
            "resident: leave %s out of streamed="
            % (names, verb, verb, frozen, frozen + trainable, pronoun, " or ".join(r.upper() for r in _QUANTIZED_ROUTES),
               pronoun),
            stacklevel=3)


def _add_hook(module, public, private, hook, **private_options):
    """Registers `hook` through the public method where this torch has it (2.5 and later for
    some), else through the private one that has long had the same signature."""
    register = getattr(module, public, None)
    return register(hook) if register is not None else getattr(module, private)(hook, **private_options)


def _parameter_at(module, name):
    owner, leaf = _owner(module, name)
    return owner._parameters[leaf]


def _owner(module, name):
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf
