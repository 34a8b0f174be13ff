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
    for name in ("default.yaml", "lora.yaml", os.path.join("policy", "dynamic_v2.yaml"), os.path.join("policy", "v3.yaml")):
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


def test_the_extensions_type_stub_declares_exactly_what_it_binds():
    """_selective_precision.pyi ships beside the extension (with py.typed) and names every
    method of _StreamedModel the binding defines, and no other."""
    import ast
    import pathlib

    from selective_precision import _selective_precision

    package = pathlib.Path(sp.__file__).parent
    assert (package / "py.typed").is_file()
    stub = ast.parse((package / "_selective_precision.pyi").read_text())
    declared = {
        node.name
        for cls in stub.body
        if isinstance(cls, ast.ClassDef) and cls.name == "_StreamedModel"
        for node in cls.body
        if isinstance(node, ast.FunctionDef) and node.name != "__init__"
    }
    bound = {name for name in vars(_selective_precision._StreamedModel) if not name.startswith("_")}
    assert declared == bound
    functions = {node.name for node in stub.body if isinstance(node, ast.FunctionDef)}
    assert functions == {name for name in vars(_selective_precision) if callable(getattr(_selective_precision, name))
                         and name.startswith("_") and not name.startswith("__") and name != "_StreamedModel"}
    exceptions = {cls.name for cls in stub.body if isinstance(cls, ast.ClassDef) and cls.name != "_StreamedModel"}
    assert exceptions == {"PluginError", "StateEntryError", "CollectiveError", "RankMismatchError"}
    for name in exceptions:
        assert issubclass(getattr(_selective_precision, name), Exception)


def test_every_public_name_has_a_docstring():
    import inspect

    for name in sp.__all__:
        obj = getattr(sp, name)
        # Its own, not one inherited (an exception class's) or made up (a dataclass's signature).
        own = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
        assert own and not own.startswith(name + "("), name
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    assert value.__doc__, "%s.%s" % (name, member)
