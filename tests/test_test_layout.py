"""The library's tests do not import the application: every test file outside `tests/train/` (the application's
tests) checks the library through its own API, and imports nothing of `recipes.train` nor runs it.

The files checked are every `*.py` under `tests/` but `tests/train/`, the two files that run the docs' commands
as a user types them (`tests/test_docs.py`, `tests/test_examples.py`), the one that resolves every name the docstrings
and pages give (`tests/test_docstrings.py`), and this file (whose probe holds what it
looks for). Importing the recipe sets (`recipes.llama3`,
`recipes.registry`, ...) is fine: they are data. The check parses each file with `ast` and looks for
- an import of `recipes.train` or below (`import recipes.train.settings.cli`, `from recipes.train import loop`,
  `from recipes import train`), or of the application's test helpers (`tests.train`);
- the attribute `recipes.train` (reached after `import recipes`);
- a string naming a module of the application (`"recipes.train"`, `"recipes.train.plan"`: what `-m`,
  `runpy.run_module` and `importlib.import_module` take), a command that runs one (`"python -m recipes.train ..."`
  given to a call), or Python source for `python -c` that imports one.
Docstrings are prose and are not read.

Also here, the layout's other rules: tests/layers/ mirrors zoo/layers/ (a test file per module), and the recipe sets
(`recipes/*.py`) import nothing of the application.
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

from tests.helpers import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
APP = "recipes.train"
EXEMPT = {"tests/test_docs.py", "tests/test_examples.py",   # the docs' commands, run as a user types them
          "tests/test_docstrings.py",                       # every docstring and page's names, the application's too
          "tests/test_test_layout.py"}                      # this check: it holds the names it looks for
MODULE = re.compile(r"recipes\.train(\.[A-Za-z_]\w*)*")
RUNS = re.compile(r"-m\s+recipes\.train\b")
IMPORTS = re.compile(r"(^|[\s;])(from\s+recipes\.train\b|import\s+recipes\.train\b|from\s+recipes\s+import\s+[^\n;]*"
                     r"\btrain\b)")


def library_test_files() -> list[pathlib.Path]:
    out = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("tests/train/") and rel not in EXEMPT:
            out.append(path)
    return out


def _is_app(module: str) -> bool:
    return module == APP or module.startswith(APP + ".") or module == "tests.train" or module.startswith(
        "tests.train.")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string nodes that are docstrings (of the module, a class or a function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                out.add(id(first.value))
    return out


def uses_of_the_app(source: str) -> list[str]:
    """`line: what` for each place the source imports or runs the application."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    in_calls = {id(c) for call in ast.walk(tree) if isinstance(call, ast.Call)
                for arg in [*call.args, *(k.value for k in call.keywords)] for c in ast.walk(arg)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if _is_app(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if _is_app(node.module):
                found.append(f"{node.lineno}: from {node.module} import ...")
            elif node.module in ("recipes", "tests"):
                found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                          if _is_app(f"{node.module}.{a.name}")]
        elif (isinstance(node, ast.Attribute) and node.attr == "train" and isinstance(node.value, ast.Name)
              and node.value.id == "recipes"):
            found.append(f"{node.lineno}: recipes.train")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if MODULE.fullmatch(text.strip()):
                found.append(f"{node.lineno}: the module name {text!r}")
            elif RUNS.search(text) and id(node) in in_calls:
                found.append(f"{node.lineno}: runs {text!r}")
            elif IMPORTS.search(text):
                found.append(f"{node.lineno}: code importing the application {text!r}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def test_no_library_test_imports_or_runs_the_application():
    found = {}
    for path in library_test_files():
        if hits := uses_of_the_app(path.read_text()):
            found[path.relative_to(ROOT).as_posix()] = hits
    assert not found, ("these library tests import or run the application (recipes.train); check the library through "
                       "its own API (zoo.plan.plan, zoo.train_step, ...), or move a test of the application to "
                       "tests/train/:\n" + "\n".join(f"{p}:{h}" for p, hits in found.items() for h in hits))


def test_the_files_checked_are_the_library_tests():
    files = {p.relative_to(ROOT).as_posix() for p in library_test_files()}
    assert {"tests/test_recipe.py", "tests/plan/test_plan.py", "tests/layers/test_rope.py",
            "tests/models/test_config_fields.py", "tests/hf/test_hf.py", "tests/test_family_boundaries.py"} <= files
    assert not any(f.startswith("tests/train/") for f in files) and not files & EXEMPT


def test_the_check_sees_each_way_of_reaching_the_application():
    """The check itself: each form below is caught, with its line; the recipe sets, a docstring and a phrase
    compared with the docs are not."""
    probe = '''"""A docstring may say `python -m recipes.train` and `from recipes.train import loop`."""
import subprocess
import recipes.train.settings.cli
from recipes.train import loop
from recipes import train, llama3
from tests.train.cli_runs import cli
import recipes
from recipes.llama3 import RECIPES
from recipes.registry import recipes_of
recipes.train.main([])
PLAN = ("-m", "recipes.train.plan", "--model", "llama3")
subprocess.run("python -m recipes.train --steps 1", shell=True)
subprocess.run(["python", "-c", "import os; from recipes.train import plan"])
said = "python -m recipes.train.tokenizer" in "the docs"
'''
    assert uses_of_the_app(probe) == [
        "3: import recipes.train.settings.cli", "4: from recipes.train import ...", "5: from recipes import train",
        "6: from tests.train.cli_runs import ...", "10: recipes.train", "11: the module name 'recipes.train.plan'",
        "12: runs 'python -m recipes.train --steps 1'",
        "13: code importing the application 'import os; from recipes.train import plan'"]


def test_every_layer_module_has_its_unit_test_file():
    """tests/layers/ mirrors zoo/layers/: each module `zoo/layers/<path>/<m>.py` has `tests/layers/<path>/test_<m>.py`
    (the package faces `__init__.py` excepted)."""
    layers = ROOT / "zoo" / "layers"
    missing = [p.relative_to(ROOT).as_posix() for p in sorted(layers.rglob("*.py")) if p.name != "__init__.py"
               and not (ROOT / "tests" / "layers" / p.parent.relative_to(layers) / f"test_{p.name}").exists()]
    assert not missing, f"modules of zoo/layers without tests/layers/.../test_<module>.py: {missing}"


# -- the recipe sets (recipes/*.py) are data beside the application, not part of it: no set imports it, so a user's
# own loop takes a recipe without loading the main job.
def test_no_recipe_set_imports_the_application():
    """The recipe sets, read as the library's tests are (`uses_of_the_app`)."""
    sets = sorted((ROOT / "recipes").glob("*.py"))
    assert {p.stem for p in sets} >= {"registry", "context", "gqa", "llama3"}
    found = {p.name: hits for p in sets if (hits := uses_of_the_app(p.read_text()))}
    assert not found, found


def test_taking_a_recipe_loads_no_part_of_the_application():
    code = ("import sys, recipes; from recipes.registry import recipes_of\n"
            "from zoo.models import registry\n"
            "for f in registry.FAMILIES.values(): recipes_of(f)\n"
            "print(sorted(m for m in sys.modules if m.startswith('recipes.train')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=cpu_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
