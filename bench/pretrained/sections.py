"""A third task, of another kind than retrieval (issue 50, section 6): classify a Debian package
by its one-line description into its archive section (`python`, `libdevel`, `doc`, `games`,
...). From `apt-cache dumpavail` on this machine (Debian's package lists, every package apt
knows, installed or not): the description is the text, the section with its area prefix removed
(`contrib/games` is `games`) the label. Only the SECTIONS most frequent sections are kept.

Split as pairs.py splits (split_of: train 70%, tune 10%, test 20%) by the SOURCE package, so that
a source's binaries (`0ad`, `0ad-data`, `0ad-data-common`) are all in one split; within a split
in a fixed order (a hash of the text), duplicate descriptions dropped (pairs.split_pairs), and the first KEEP of each kept. The
examples are pairs.Pair with the description as `query`, the section as `document` and kind
"section", frozen by finetune.cached_pairs the first time, as the other tasks' are.

    .venv/bin/python bench/pretrained/sections.py   # the split sizes, the sections and three examples
"""

import collections
import re
import subprocess

from pairs import Pair, split_pairs

SECTIONS = 16
MIN_DESCRIPTION = 12
# A fixed sample of each split (its order is a hash of the text): enough for the head and the
# measurements, and a cache of 1.3 MB rather than 5.
KEEP = {"train": 8192, "tune": 1024, "test": 2048}


def available() -> list[Pair]:
    """Every package apt knows with a section and a description of at least MIN_DESCRIPTION
    characters, as Pair(description, section, source, "section")."""
    text = subprocess.run(["apt-cache", "dumpavail"], check=True, capture_output=True, text=True).stdout
    out = []
    for stanza in text.split("\n\n"):
        package = re.search(r"^Package: (\S+)", stanza, re.M)
        section = re.search(r"^Section: (\S+)", stanza, re.M)
        description = re.search(r"^Description: (.+)$", stanza, re.M)
        if not (package and section and description) or len(description.group(1).strip()) < MIN_DESCRIPTION:
            continue
        source = re.search(r"^Source: (\S+)", stanza, re.M)
        out.append(Pair(query=description.group(1).strip(), document=section.group(1).split("/")[-1],
                        source=source.group(1) if source else package.group(1), kind="section"))
    return out


def load_pairs() -> dict[str, list[Pair]]:
    everything = available()
    counts = collections.Counter(p.document for p in everything)
    kept = {name for name, _ in counts.most_common(SECTIONS)}
    splits = split_pairs([p for p in everything if p.document in kept])
    return {name: split[:KEEP[name]] for name, split in splits.items()}


def labels(splits) -> list[str]:
    """The sections, in a fixed order (by name), as the classifier's outputs."""
    return sorted({p.document for split in splits.values() for p in split})


if __name__ == "__main__":
    splits = load_pairs()
    print({k: len(v) for k, v in splits.items()})
    print(collections.Counter(p.document for p in splits["test"]).most_common())
    for p in splits["test"][:3]:
        print(p)
