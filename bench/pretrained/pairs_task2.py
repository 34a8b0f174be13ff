"""A second contrastive task of a different kind (issue 40, section 7, task 2): code search in the
Python standard library. Query: a function's, method's or class's docstring summary (its first
paragraph, joined to one line); document: its qualified signature (`os.path.join(a, *p)`;
`class email.message.Message(...)` for a class) followed by the rest of its docstring, which
may be empty (then the signature alone must find the summary). From the standard library's
sources of the interpreter that runs this (sysconfig's `stdlib`; here
/root/.pyenv/versions/3.11.7/lib/python3.11, the pyenv Python of the project's .venv), parsed
with `ast` (nothing is imported); test suites, lib2to3, ensurepip, turtledemo and site-packages
left out. A pair needs a summary of at least 12 characters and a document of at least 24.

Split as bench/pretrained/pairs.py splits (pairs.split_of: train 70%, tune 10%, test 20%) by
the source, the module (`os.path`, `email.message`, ...), never by line: a module's functions
are all in one split (so the split sizes follow a few big modules: 5254 / 472 / 1180 pairs
here). Within a split, in a fixed order (a hash of the text), duplicate queries dropped, as
pairs.load_pairs does. The same Pair type, kind "pydoc".

    .venv/bin/python bench/pretrained/pairs_task2.py   # the split sizes and three test pairs
"""

import ast
import sysconfig
from pathlib import Path

from pairs import Pair, split_pairs

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3",
             "ensurepip", "turtledemo", "config-3.11-x86_64-linux-gnu"}
MIN_QUERY, MIN_DOCUMENT = 12, 24


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _signature(node, qualified: str) -> str:
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        return "class %s(%s)" % (qualified, bases) if bases else "class %s" % qualified
    return "%s(%s)" % (qualified, ast.unparse(node.args))


def _split_docstring(doc: str):
    """(summary: the first paragraph on one line, the rest on one line)."""
    paragraphs, current = [], []
    for line in doc.strip().splitlines():
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    if not paragraphs:
        return "", ""
    return paragraphs[0], " ".join(paragraphs[1:])


def _documented(node, prefix):
    """(qualified name, node) of every documented function, method and class under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + "." + child.name
            yield name, child
            yield from _documented(child, name)


def module_pairs(root: Path, path: Path) -> list[Pair]:
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except (SyntaxError, ValueError):
        return []
    module = _module_name(root, path)
    pairs = []
    for qualified, node in _documented(tree, module):
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary, rest = _split_docstring(doc)
        document = (_signature(node, qualified) + ": " + rest).strip().rstrip(":")
        if len(summary) < MIN_QUERY or len(document) < MIN_DOCUMENT:
            continue
        pairs.append(Pair(summary, document, module, "pydoc"))
    return pairs


def stdlib_pairs(root: Path | None = None) -> list[Pair]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    pairs = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        pairs.extend(module_pairs(root, path))
    return pairs


def load_pairs() -> dict[str, list[Pair]]:
    """Every pair, split by module; within a split in a fixed order (a hash of the text), with
    duplicate queries dropped (the first one in that order stays)."""
    return split_pairs(stdlib_pairs())

if __name__ == "__main__":
    loaded = load_pairs()
    for name, pairs in loaded.items():
        print(name, len(pairs), "pairs,", len({p.source for p in pairs}), "modules")
    for pair in loaded["test"][:3]:
        print(repr(pair.query), "->", repr(pair.document[:120]))
