"""The installed package as pip leaves it: its version, its plugins and configs, its tools, and
its refusal of a torch other than the one it was built against."""

import os
import subprocess
import sys

import pytest
import torch

import selective_precision as sp


def test_the_package_has_a_version_its_plugin_and_its_configs():
    assert sp.__version__.count(".") == 2
    assert os.path.isfile(os.path.join(sp.default_plugin_dir(), "libsp_selective_precision.so"))
    for name in ("default.yaml", "lora.yaml", os.path.join("policy", "dynamic_v2.yaml"), os.path.join("policy", "v3.yaml")):
        assert os.path.isfile(os.path.join(sp.config_dir(), name)), name


def _import_as_if_built_against(torch_version, cxx11_abi):
    """Imports the package in a fresh interpreter whose build record is replaced, as if it had
    been built against another torch than this Python's; returns the finished process."""
    code = (
        "import sys, types\n"
        "info = types.ModuleType('selective_precision._build_info')\n"
        "info.version, info.torch_version, info.torch_cxx11_abi = '0.2.0', %r, %r\n"
        "info.source_configs = ''\n"
        "sys.modules['selective_precision._build_info'] = info\n"
        "import selective_precision\n" % (torch_version, cxx11_abi)
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_a_torch_of_another_minor_is_refused_at_import_naming_both_versions():
    result = _import_as_if_built_against("2.0.1+cu117", False)
    assert result.returncode != 0
    said = result.stderr.splitlines()[-1]
    assert said.startswith("ImportError: selective_precision 0.2.0 was built against torch 2.0.1+cu117 (C++11 ABI 0)")
    assert "imports torch %s (C++11 ABI %d)" % (torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI) in said
    assert "pip install 'torch==2.0.*'" in said
    assert "pip install --no-build-isolation --force-reinstall ." in said


def test_another_cuda_build_of_the_same_torch_is_refused_and_a_patch_release_is_taken():
    public, _, local = torch.__version__.partition("+")
    major, minor = public.split(".")[:2]
    abi = bool(torch._C._GLIBCXX_USE_CXX11_ABI)
    other_build = "%s.%s.0+%s" % (major, minor, "cpu" if local != "cpu" else "cu130")
    refused = _import_as_if_built_against(other_build, abi)
    assert refused.returncode != 0
    assert "was built against torch %s" % other_build in refused.stderr.splitlines()[-1]
    # The metadata admits every patch release of the minor (torch>=2.15,<2.16): so does the import.
    patch = "%s.%s.99%s" % (major, minor, "+" + local if local else "")
    taken = _import_as_if_built_against(patch, abi)
    assert taken.returncode == 0, taken.stderr


def test_the_extensions_type_stub_declares_exactly_what_it_binds():
    """_selective_precision.pyi ships beside the extension (with py.typed) and names every
    function, class, method of _StreamedModel and field of the bound options the binding
    defines, and no other."""
    import ast
    import pathlib

    from selective_precision import _selective_precision

    package = pathlib.Path(sp.__file__).parent
    assert (package / "py.typed").is_file()
    stub = ast.parse((package / "_selective_precision.pyi").read_text())
    classes = {cls.name: cls for cls in stub.body if isinstance(cls, ast.ClassDef)}

    def methods(name):
        return {node.name for node in classes[name].body if isinstance(node, ast.FunctionDef) and node.name != "__init__"}

    def fields(name):
        return {node.target.id for node in classes[name].body if isinstance(node, ast.AnnAssign)}

    def bound(cls):
        return {name for name in vars(cls) if not name.startswith("_")}

    assert methods("_StreamedModel") == bound(_selective_precision._StreamedModel)
    for options in ("_StreamedModelOptions", "_PolicyUnit"):
        assert fields(options) == bound(getattr(_selective_precision, options))
    names = {name for name in vars(_selective_precision) if not name.startswith("__")}
    assert classes.keys() == {name for name in names if isinstance(getattr(_selective_precision, name), type)}
    functions = {node.name for node in stub.body if isinstance(node, ast.FunctionDef)}
    assert functions == {name for name in names if callable(getattr(_selective_precision, name))
                         and not isinstance(getattr(_selective_precision, name), type)}
    constants = {node.target.id for node in stub.body if isinstance(node, ast.AnnAssign)}
    assert constants == {name for name in names if not callable(getattr(_selective_precision, name))
                         and not isinstance(getattr(_selective_precision, name), type(_selective_precision))}
    assert _selective_precision._ROUTES[0] == "bf16" and set(_selective_precision._QUANTIZED_ROUTES) < set(
        _selective_precision._ROUTES)
    exceptions = {name for name in classes if issubclass(getattr(_selective_precision, name), Exception)}
    assert exceptions == {"PluginError", "StateEntryError", "CollectiveError", "RankMismatchError"}


def test_the_bound_options_carry_each_value_as_the_layer_takes_it():
    """sp.StreamOptions reaches the layer through _StreamedModelOptions, the C++ struct bound
    field by field: each value set comes back as set, and a value of the wrong kind is refused."""
    import datetime

    from selective_precision import _selective_precision

    options = _selective_precision._StreamedModelOptions()
    assert options.host_name == "selective_precision (Python)"
    assert options.recompute is None and options.units == [] and options.nf4_group_size == 0
    options.plugin_file = "/plugins/libsp.so"
    options.output_dir = "out"
    options.device = torch.device("cpu")
    options.compute_dtype = torch.bfloat16
    options.recompute = True
    options.nf4_group_size = 128
    options.plugin_hook_deadline = datetime.timedelta(milliseconds=250)
    options.units = [_selective_precision._PolicyUnit("0.attn", 2)]
    assert str(options.plugin_file) == "/plugins/libsp.so" and str(options.output_dir) == "out"
    assert options.device == torch.device("cpu") and options.compute_dtype is torch.bfloat16
    assert options.recompute is True and options.nf4_group_size == 128
    assert options.plugin_hook_deadline == datetime.timedelta(milliseconds=250)
    assert [(u.name, u.blocks) for u in options.units] == [("0.attn", 2)]
    with pytest.raises(TypeError):
        options.prefetch_window = "two"
    with pytest.raises(TypeError):
        options.compute_dtype = "bfloat16"


def test_every_public_name_has_a_docstring():
    import inspect

    for name in sp.__all__:
        obj = getattr(sp, name)
        if not (inspect.isclass(obj) or callable(obj)):
            continue  # a data attribute (cmake_prefix_path): its `#:` comment documents it
        # Its own, not one inherited (an exception class's) or made up (a dataclass's signature).
        own = vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__
        assert own and not own.startswith(name + "("), name
        if inspect.isclass(obj):
            for member, value in vars(obj).items():
                if not member.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    assert value.__doc__, "%s.%s" % (name, member)


def test_the_wheel_pins_the_torch_minor_it_was_built_against():
    import importlib.metadata
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "build_support" / "sp_torch_pin.py"
    spec = importlib.util.spec_from_file_location("sp_torch_pin", path)
    pin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pin)
    assert pin.torch_requirement("2.15.0+cu130") == "torch>=2.15,<2.16"
    assert pin.torch_requirement("3.0.1") == "torch>=3.0,<3.1"
    given = pin.dynamic_metadata({"requires": ["pyyaml>=5.1", "numpy"]})
    assert given["dependencies"][1:] == ["pyyaml>=5.1", "numpy"]
    try:
        pin.dynamic_metadata({"require": []})
    except RuntimeError as error:
        assert "sp_torch_pin" in str(error)
    else:
        raise AssertionError("sp_torch_pin took an unknown setting")
    try:
        requires = importlib.metadata.requires("selective-precision")
    except importlib.metadata.PackageNotFoundError:
        return  # run from a build tree that pip never installed
    from packaging.requirements import Requirement

    pinned = [Requirement(r) for r in requires if Requirement(r).name == "torch"]
    assert [str(r.specifier) for r in pinned] == [str(Requirement(pin.torch_requirement(torch.__version__)).specifier)]
    assert torch.__version__.partition("+")[0] in pinned[0].specifier


def test_cmake_prefix_path_names_the_cpp_package_installed_with_the_wheel():
    package = os.path.dirname(os.path.abspath(sp.__file__))
    config = os.path.join(package, "lib", "cmake", "SelectivePrecision", "SelectivePrecisionConfig.cmake")
    if sp.cmake_prefix_path is None:
        # A build tree's package (PYTHONPATH=<build>/python): its C++ package is cmake --install's.
        assert not os.path.exists(config)
        return
    assert sp.cmake_prefix_path == package
    assert os.path.isfile(config)
    # What the config's consumers link: the layer's archive and the compiled dependencies, and
    # the plugin directory it names is the package's own.
    for archive in ("libselective_precision_torch.a", "libselective_precision_yaml_cpp.a", "libselective_precision_spdlog.a"):
        assert os.path.isfile(os.path.join(package, "lib", archive)), archive
    assert os.path.isfile(os.path.join(sp.default_plugin_dir(), "libsp_selective_precision.so"))
