"""Makes a fresh virtual environment holding exactly what `pip install <requirements>` would put
there, taken from the project's .venv instead of the registry (scripts/check-wheel.sh).

The distributions that the requirements need, closed over their own requirements (markers
evaluated for this interpreter), are copied file by file from .venv's site-packages as hard
links, each with its dist-info, so that `pip check` in the new environment judges them as
installed packages. torch's wheel unpacks to about 5 GB: a second `pip install` of it cost 221 s
on the 2-core machine, the links cost about a second.

    python scripts/stranger_venv.py DEST REQUIREMENT...
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(requirements: list[str]) -> list[metadata.Distribution]:
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, str]] = set()  # (distribution, extra) pairs already followed
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        extras = [""] + sorted(requirement.extras)
        if all((name, extra) in seen for extra in extras):
            continue
        try:
            dist = found.get(name) or metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            sys.exit("stranger_venv: %s is required and not installed in %s" % (requirement, sys.prefix))
        if dist.version not in requirement.specifier:
            sys.exit("stranger_venv: %s is required, %s has %s" % (requirement, sys.prefix, dist.version))
        found[name] = dist
        for extra in extras:
            if (name, extra) in seen:
                continue
            seen.add((name, extra))
            for text in dist.requires or []:
                needed = Requirement(text)
                if needed.marker is None or needed.marker.evaluate({"extra": extra}):
                    pending.append(needed)
    return list(found.values())


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dest, requirements = sys.argv[1], sys.argv[2:]
    dists = closure(requirements)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", dest], check=True)
    source = sysconfig.get_paths()["purelib"]
    target = subprocess.run(
        [os.path.join(dest, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    linked = 0
    for dist in dists:
        for file in dist.files or []:
            relative = str(file)
            if relative.startswith(".."):  # console scripts and data outside site-packages
                continue
            origin = os.path.join(source, relative)
            if not os.path.isfile(origin):
                continue
            copy = os.path.join(target, relative)
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            try:
                os.link(origin, copy)
            except OSError:  # another file system
                shutil.copy2(origin, copy)
            linked += 1
    names = sorted(canonicalize_name(d.metadata["Name"]) for d in dists)
    print("stranger_venv: %s holds %d distributions (%d files): %s" % (dest, len(dists), linked, " ".join(names)))


if __name__ == "__main__":
    main()
