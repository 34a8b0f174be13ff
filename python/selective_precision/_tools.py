"""The console entry points sp-train, sp-replay and sp-bench of an installed package: each
runs the binary of that name in the package's bin/ (built with the package), with the
arguments it was given."""

import importlib.resources
import os
import sys


def _run(name):
    binary = importlib.resources.files(__package__) / "bin" / name
    if not binary.is_file():
        sys.exit(
            "%s: not in this installation of selective_precision (%s); it is installed by `pip install "
            "--no-build-isolation .`, and a CMake build has it in <build>/bin" % (name, binary)
        )
    os.execv(str(binary), [name] + sys.argv[1:])


def sp_train():
    _run("sp-train")


def sp_replay():
    _run("sp-replay")


def sp_bench():
    _run("sp-bench")
