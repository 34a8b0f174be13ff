"""Where the installed package keeps its policy plugins and its shipped configs."""

from __future__ import annotations

import importlib.resources
import os

from . import _build_info


def default_plugin_dir() -> str:
    """Where the policy plugins are: $SP_PLUGIN_DIR, else the installed package's plugins/
    (pip install), else the build tree's plugins/ (PYTHONPATH=<build>/python)."""
    if os.environ.get("SP_PLUGIN_DIR"):
        return os.environ["SP_PLUGIN_DIR"]
    installed = importlib.resources.files(__package__) / "plugins"
    if installed.is_dir():
        return str(installed)
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "plugins"))


def config_dir() -> str:
    """The shipped configs (default.yaml and lora.yaml for sp-train, policy/*.yaml for the
    plugin): the installed package's configs/, else the source tree's of a build-tree package."""
    installed = importlib.resources.files(__package__) / "configs"
    if installed.is_dir():
        return str(installed)
    return _build_info.source_configs
