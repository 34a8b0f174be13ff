"""Text pairs every Debian machine has, for a contrastive task on a pretrained sentence encoder
(issue 31): a package's one-line description and its long description (/var/lib/dpkg/status),
and a manual page's NAME line and the first paragraph of its DESCRIPTION
(/usr/share/man/man1), of the installed packages (/var/lib/dpkg/info/*.list). The split is drawn
per source, never per line: train, tune or test by a hash of the source's name, the package for
a description, the page for a manual page (whole packages would not do: a few ship most pages,
and the test split would get a few hundred pairs)."""

import gzip
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

DPKG_STATUS = Path("/var/lib/dpkg/status")
DPKG_INFO = Path("/var/lib/dpkg/info")
MAN1 = Path("/usr/share/man/man1")
SPLITS = ("train", "tune", "test")


@dataclass(frozen=True)
class Pair:
    query: str     # the one-line description, or the NAME line
    document: str  # the long description, or the DESCRIPTION's first paragraph
    source: str    # the package (dpkg) or the page (man) it comes from
    kind: str      # "dpkg" or "man"


def split_of(source: str) -> str:
    """train (70%), tune (10%) or test (20%), a pure function of the source's name."""
    bucket = int(hashlib.sha1(source.encode()).hexdigest(), 16) % 10
    return "train" if bucket < 7 else "tune" if bucket == 7 else "test"


def dpkg_pairs(status: Path = DPKG_STATUS) -> list[Pair]:
    pairs = []
    for stanza in status.read_text(errors="replace").split("\n\n"):
        package = re.search(r"^Package: (.+)$", stanza, re.M)
        description = re.search(r"^Description: (.*)\n((?: .*\n?)*)", stanza, re.M)
        if not package or not description:
            continue
        body = " ".join(line.strip() for line in description.group(2).splitlines() if line.strip() not in ("", "."))
        if len(body) >= 40:
            pairs.append(Pair(description.group(1).strip(), body, package.group(1).strip(), "dpkg"))
    return pairs


def _man_owners(info: Path = DPKG_INFO) -> dict[str, str]:
    owners = {}
    for listing in info.glob("*.list"):
        package = listing.stem.split(":")[0]
        for line in listing.read_text(errors="replace").splitlines():
            if line.startswith(str(MAN1) + "/"):
                owners[line] = package
    return owners


_ESCAPES = re.compile(r"\\f[BIRP0-9]|\\f\(..|\\\*?\(..|\\[&|^ ]|\\s[+-]?\d")


def _plain(line: str) -> str:
    line = _ESCAPES.sub("", line).replace("\\-", "-").replace("\\e", "\\")
    if line.startswith((".B ", ".I ", ".BR ", ".IR ", ".BI ", ".RB ", ".RI ", ".IB ")):
        line = line.split(" ", 1)[1].replace('"', "")
    return line.strip()


def man_pair(text: str):
    """(NAME line, first DESCRIPTION paragraph) of a man(7) page, or None."""
    lines = text.splitlines()
    sections, current = {}, None
    for line in lines:
        heading = re.match(r'^\.S[Hh]\s+"?([A-Za-z ]+)"?', line)
        if heading:
            current = heading.group(1).strip().upper()
            sections.setdefault(current, [])
        elif current is not None:
            sections[current].append(line)
    name = " ".join(_plain(line) for line in sections.get("NAME", []) if not line.startswith("."))
    paragraph = []
    for line in sections.get("DESCRIPTION", []):
        if line.startswith((".PP", ".P", ".LP", ".TP", ".IP", ".SS", ".sp")) and paragraph:
            break
        if line.startswith(".") and not line.startswith((".B ", ".I ", ".BR ", ".IR ", ".BI ", ".RB ", ".RI ")):
            continue
        plain = _plain(line)
        if plain:
            paragraph.append(plain)
    document = " ".join(paragraph)
    if " - " not in name or len(document) < 40:
        return None
    return name.split(" - ", 1)[1].strip(), document


def man_pairs() -> list[Pair]:
    pairs = []
    for path, package in sorted(_man_owners().items()):
        try:
            with gzip.open(path, "rt", errors="replace") as page:
                text = page.read()
        except (OSError, EOFError):
            continue
        found = man_pair(text)
        if found and len(found[0]) >= 8:
            pairs.append(Pair(found[0], found[1], package + ":" + Path(path).name, "man"))
    return pairs


def load_pairs() -> dict[str, list[Pair]]:
    """Every pair, split by source; within a split, in a fixed order (by a hash of the text),
    and with duplicate queries dropped (the first one in that order stays)."""
    return split_pairs(dpkg_pairs() + man_pairs())


def split_pairs(everything: list[Pair]) -> dict[str, list[Pair]]:
    """`everything` split by source (split_of); within a split in a fixed order (a hash of the
    text), with duplicate queries dropped (the first one in that order stays)."""
    splits = {name: [] for name in SPLITS}
    seen = set()
    for pair in sorted(everything, key=lambda p: hashlib.sha1((p.query + "\0" + p.document).encode()).hexdigest()):
        if pair.query.lower() in seen:
            continue
        seen.add(pair.query.lower())
        splits[split_of(pair.source)].append(pair)
    return splits


if __name__ == "__main__":
    loaded = load_pairs()
    for name, pairs in loaded.items():
        kinds = {kind: sum(p.kind == kind for p in pairs) for kind in ("dpkg", "man")}
        print(name, len(pairs), kinds, len({p.source for p in pairs}), "sources")
    for pair in loaded["test"][:3]:
        print(repr(pair.query), "->", repr(pair.document[:100]))
