"""The code's own words: docstrings short (a module's at most 20 lines, a function's or class's at most 25, and at
most 15% of the library's lines: measurements, histories and rationale live in docs/, docs/internals.md first), and
no docstring or doc page naming a module, function or file that does not exist.

What is a name: a dotted path into the project's packages (`zoo.plan.peak.compile_step`, `recipes.train.job.Job`,
`bench.records.load`), resolved by importing the longest module prefix and reading the rest as attributes (a
dataclass's fields count); and a path of the repository (`zoo/plan/build.py`, `docs/planner.md`,
`bench/results/README.md`), which must exist. A path with a placeholder (`zoo/models/<family>/`) or a glob is left
alone, and so is docs/changes.md, whose first column names what no longer exists.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re

import pytest

from tests.helpers import ROOT

CODE = ("zoo", "recipes", "bench")
MODULE_LINES, FUNCTION_LINES, LIBRARY_SHARE = 20, 25, 0.15
PACKAGES = ("zoo", "recipes", "bench", "tests")
DOTTED = re.compile(r"(?<![\w./-])((?:zoo|recipes|bench|tests)(?:\.[A-Za-z_]\w*)+)")
EXTENSIONS = ("py", "md", "json", "jsonl", "toml", "yml", "txt", "png", "log")
PATH = re.compile(rf"(?<![\w./<-])((?:zoo|recipes|bench|tests|docs|\.ci)/[\w./-]*\w\.(?:{'|'.join(EXTENSIONS)}))"
                  r"(?![\w<*{])")
EXEMPT_PAGES = ("docs/changes.md",)   # its first column names what no longer exists


def docstrings(path):
    """(line, what, docstring) of the module and of every function and class of the file at `path`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                expr = body[0]
                yield expr.lineno, getattr(node, "name", None), expr.end_lineno - expr.lineno + 1, expr.value.value


def code_files(*roots):
    return sorted(p for r in roots for p in (ROOT / r).rglob("*.py") if "shims" not in p.parts)


@pytest.mark.parametrize("root", CODE)
def test_docstrings_are_short(root):
    long = [f"{p.relative_to(ROOT)}:{line} {name or 'module'}: {n} lines"
            for p in code_files(root) for line, name, n, _ in docstrings(p)
            if n > (MODULE_LINES if name is None else FUNCTION_LINES)]
    assert not long, "move the detail to docs/ (docs/internals.md) and link it in one line:\n" + "\n".join(long)


def test_docstrings_are_a_small_share_of_the_library():
    files = code_files("zoo")
    lines = sum(p.read_text().count("\n") for p in files)
    doc = sum(n for p in files for _, _, n, _ in docstrings(p))
    assert doc <= LIBRARY_SHARE * lines, f"docstrings are {doc / lines:.1%} of zoo/'s lines ({doc} of {lines})"


def resolves(dotted: str) -> bool:
    """Whether `dotted` names a module of the project, or an attribute (or a dataclass field) reached from one."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] not in PACKAGES:
                return True   # an optional dependency of the module is missing here: nothing to say
            continue
        for attr in parts[i:]:
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            if attr in fields or attr in getattr(obj, "__annotations__", {}):
                return True   # a field: its own attributes are its value's
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                return False
        return True
    return False


def texts():
    """(where, text) of every docstring of the code and the tests, and of every doc page."""
    for p in code_files(*CODE, "tests"):
        for line, _, _, text in docstrings(p):
            yield f"{p.relative_to(ROOT)}:{line}", text
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        if str(p.relative_to(ROOT)) not in EXEMPT_PAGES:
            yield str(p.relative_to(ROOT)), p.read_text()


def test_no_docstring_or_page_names_what_does_not_exist():
    missing = []
    for where, text in texts():
        for name in sorted(set(DOTTED.findall(text))):
            if name.rsplit(".", 1)[-1] in EXTENSIONS:
                continue   # a file's name (recipes.md), not a module's
            if not resolves(name):
                missing.append(f"{where}: {name}")
        for path in sorted(set(PATH.findall(text))):
            if not (ROOT / path).exists():
                missing.append(f"{where}: {path}")
    assert not missing, "names of nothing:\n" + "\n".join(missing)


def test_the_reference_check_finds_a_stale_name():
    """The check itself: a name or a path that does not exist is found, one that does is not."""
    assert resolves("zoo.plan.peak.compile_step") and resolves("recipes.train.job.Job.settings")
    assert not resolves("zoo.plan.peak.compile_everything") and not resolves("recipes.data.open_data")
    assert PATH.findall("see `recipes/train/loop.py` and zoo/models/<family>/config.py") == ["recipes/train/loop.py"]
