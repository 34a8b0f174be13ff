"""The installed package as pip leaves it: its version, its plugins and configs, its tools, and
its refusal of a torch other than the one it was built against."""

import os
import subprocess
import sys

import torch

import selective_precision as sp


def test_the_package_has_a_version_its_plugin_and_its_configs():
    assert sp.__version__.count(".") == 2
    assert os.path.isfile(os.path.join(sp.default_plugin_dir(), "libsp_selective_precision.so"))
    for name in ("default.yaml", "lora.yaml", os.path.join("policy", "dynamic_v2.yaml")):
        assert os.path.isfile(os.path.join(sp.config_dir(), name)), name


def test_a_torch_other_than_the_one_built_against_is_refused_at_import_by_name():
    # The build's record is replaced before the package is imported, as if it had been built
    # against another torch than this Python's.
    code = (
        "import sys, types\n"
        "info = types.ModuleType('selective_precision._build_info')\n"
        "info.version, info.torch_version, info.torch_cxx11_abi = '0.2.0', '2.0.1+cu117', False\n"
        "info.source_configs = ''\n"
        "sys.modules['selective_precision._build_info'] = info\n"
        "import selective_precision\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    said = result.stderr.splitlines()[-1]
    assert said.startswith("ImportError: selective_precision 0.2.0 was built against torch 2.0.1+cu117 (C++11 ABI 0)")
    assert "imports torch %s (C++11 ABI %d)" % (torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI) in said
    assert "pip install --no-build-isolation --force-reinstall ." in said
