"""The wheel's dependencies, pinned to the torch minor it is built against (pyproject.toml's
[tool.scikit-build.metadata.dependencies]).

The extension, the plugin and the tools link LibTorch's C++ ABI, which changes between torch
minors: a wheel built against 2.15 is for torch 2.15.*, as torchao's and flash-attn's wheels
are for one torch minor each. The build imports the torch it builds against (pip install
--no-build-isolation, into the venv that holds it), so the pin is read from that torch, the
same one CMake builds against (SpTorch.cmake, SP_PYTHON), and never written by hand. Loaded by
scikit-build-core from pyproject.toml's [[tool.dynamic-metadata]] (dynamic-metadata 0.3)."""

from __future__ import annotations

import re

KEYS = {"requires"}


def torch_requirement(version: str) -> str:
    """'2.15.0+cu130' -> 'torch>=2.15,<2.16'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise RuntimeError("cannot read a torch minor from torch.__version__ %r" % version)
    major, minor = int(match.group(1)), int(match.group(2))
    return "torch>=%d.%d,<%d.%d" % (major, minor, major, minor + 1)


def dynamic_metadata(settings, project=None):
    """The [[tool.dynamic-metadata]] hook: the 'dependencies' field, the pin first."""
    unknown = set(settings) - KEYS
    if unknown:
        raise RuntimeError("sp_torch_pin takes only %s, not %s" % (sorted(KEYS), sorted(unknown)))
    import torch

    return {"dependencies": [torch_requirement(torch.__version__), *settings.get("requires", [])]}
