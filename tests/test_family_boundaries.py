"""A family is its package and one registration line: no generic module names a family.

Generic means every module of the library (`zoo/`) and the application (`recipes/`) but a family's own files: its
package `zoo/models/<package>/` and its recipe set `recipes/<family name>.py`. Besides those, a family may be named
only where it is registered: its import line in `zoo/models/__init__.py`, and the application's default family
(`DEFAULT_MODEL` in `recipes/train/settings/config.py`). The check reads the whole text of a module (code, strings,
docstrings and comments): a docstring that says "as DeepSeek-V3 does" is a family's knowledge in a generic place
just as an `if type(cfg).__name__ == ...` is. Tests, docs and the benchmarks (which measure named models) are not
generic modules.

The words looked for are every registered family's name, package, config class, Hugging Face architecture and
model type, plus the published model names (llama, deepseek, qwen), case-insensitive. A family package may not
import another family's package either: what two families share belongs in zoo/layers or zoo/models.
"""
from __future__ import annotations

import ast
import pathlib
import re

import pytest

from zoo.models import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLISHED = ("llama", "deepseek", "qwen")

# Modules that name a family today and are being made generic by work in flight elsewhere (remove an entry when its
# module is clean: the test fails on an entry that is no longer needed).
PENDING: dict[str, str] = {}   # modules of work in flight that still name a family: none
# Modules that name a family by an old name, for one release: the renames' table (docs/changes.md).
OLD_NAMES = {"zoo/renames.py": "the old names of renamed modules and classes, each naming its new one"}


def family_package(f: registry.Family) -> str:
    """The package directory of a family, from the module its config class lives in (zoo.models.<package>...)."""
    parts = f.config_cls.__module__.split(".")
    assert parts[:2] == ["zoo", "models"] and len(parts) >= 3, f.config_cls.__module__
    return parts[2]


def words() -> list[str]:
    out = set(PUBLISHED)
    for f in registry.FAMILIES.values():
        out |= {f.name, family_package(f), f.config_cls.__name__, f.hf.architecture, f.hf.model_type}
    return sorted(w.lower() for w in out)


def family_files() -> set[pathlib.Path]:
    out = set()
    for f in registry.FAMILIES.values():
        out |= set((ROOT / "zoo" / "models" / family_package(f)).rglob("*.py"))
        out.add(ROOT / "recipes" / f"{f.name}.py")
    return out


def registration_lines(path: pathlib.Path, root: pathlib.Path) -> set[int]:
    """The lines of the registration modules that may name a family: `zoo/models/__init__.py`'s imports of a family
    package and its `__all__` (the names those imports export), `recipes/train/settings/config.py`'s
    `DEFAULT_MODEL = ...`."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text())
    packages = {family_package(f) for f in registry.FAMILIES.values()}
    lines = set()
    for node in tree.body:
        if rel == "zoo/models/__init__.py" and isinstance(node, ast.ImportFrom) and node.module and (
                node.module.split(".")[-1] in packages):
            lines |= set(range(node.lineno, node.end_lineno + 1))
        if rel == "zoo/models/__init__.py" and isinstance(node, ast.Assign) and [
                getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            lines |= set(range(node.lineno, node.end_lineno + 1))
        if rel == "recipes/train/settings/config.py" and isinstance(node, ast.Assign) and [
                getattr(t, "id", None) for t in node.targets] == ["DEFAULT_MODEL"]:
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return lines


def docstring_lines(path: pathlib.Path) -> set[int]:
    """The lines of `path`'s docstrings (its module's, classes' and functions'): documentation may cite the paper a
    layer implements and run its examples on a family's tiny preset; the code may not name a family."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                lines |= set(range(first.lineno, first.end_lineno + 1))
    return lines


def mentions(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """`line: text` of each line of `path` naming a family outside its registration lines and its docstrings."""
    pattern = re.compile("|".join(map(re.escape, words())), re.IGNORECASE)
    allowed = registration_lines(path, root) | docstring_lines(path)
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if i not in allowed and pattern.search(line):
            out.append(f"{i}: {line.strip()}")
    return out


def generic_modules() -> list[pathlib.Path]:
    own = family_files()
    return sorted(p for top in ("zoo", "recipes") for p in (ROOT / top).rglob("*.py") if p not in own)


def test_no_generic_module_names_a_family():
    found = {}
    for path in generic_modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel not in PENDING and rel not in OLD_NAMES and (hits := mentions(path)):
            found[rel] = hits
    assert not found, ("generic modules name a family; move what is the family's into its package "
                       "(zoo/models/<package>/, recipes/<family>.py), or ask the registry:\n"
                       + "\n".join(f"{p}:{h}" for p, hits in found.items() for h in hits))


@pytest.mark.parametrize("rel", sorted(PENDING) + sorted(OLD_NAMES))
def test_pending_exceptions_are_still_needed(rel):
    why = PENDING.get(rel) or OLD_NAMES[rel]
    assert mentions(ROOT / rel), f"{rel} names no family any more: delete its entry ({why})"


def test_a_family_package_imports_no_other_family():
    packages = {family_package(f) for f in registry.FAMILIES.values()}
    for pkg in packages:
        for path in (ROOT / "zoo" / "models" / pkg).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                for name in names:
                    parts = name.split(".")
                    other = parts[2] if parts[:2] == ["zoo", "models"] and len(parts) > 2 else None
                    assert other not in packages - {pkg}, f"{path.relative_to(ROOT)} imports {name}"


def test_the_check_sees_a_family_named_in_generic_code(tmp_path):
    """The check itself: a generic module that keys on a family's config class is caught; a registration line is
    not."""
    (tmp_path / "zoo" / "models").mkdir(parents=True)
    probe = tmp_path / "zoo" / "models" / "__init__.py"
    probe.write_text("from zoo.models.qwen3 import Qwen3Config  # noqa: F401\nRATE = {'LlamaConfig': 760.0}\n")
    assert mentions(probe, root=tmp_path) == ["2: RATE = {'LlamaConfig': 760.0}"]


def test_every_family_is_reachable_by_its_name():
    """`recipes.<family>` is its recipe set and `zoo.models.<Config>` its config class, for every family (none is
    left out of a hand-written list)."""
    import recipes
    import zoo
    assert set(registry.FAMILIES) >= {"llama3", "deepseek_v3", "qwen3", "qwen3_moe"}
    for f in registry.FAMILIES.values():
        assert getattr(recipes, f.name).DEFAULT in getattr(recipes, f.name).RECIPES
        assert getattr(zoo.models, f.config_cls.__name__) is f.config_cls
    with pytest.raises(AttributeError, match="no attribute 'not_a_module'"):
        recipes.not_a_module  # noqa: B018


def test_a_family_declares_defaults_only_for_its_own_presets():
    import dataclasses
    llama = registry.family("llama3")
    published = llama.train_defaults["llama3_1_8b"]
    bad = dataclasses.replace(llama, name="llama_copy", train_defaults={"qwen3_8b": published})
    with pytest.raises(ValueError, match=r"llama_copy: training defaults for \['qwen3_8b'\], which are not its "):
        registry.register(bad)
    assert "llama_copy" not in registry.FAMILIES


def test_a_family_package_is_named_as_the_family_and_its_builder_too():
    """`zoo/models/<family>/` is the family's package (its record comes from there), and `zoo.models.<family>` is
    its builder: the function the record builds with."""
    import importlib

    import zoo
    for f in registry.FAMILIES.values():
        assert family_package(f) == f.name
        assert importlib.import_module(f"zoo.models.{f.name}").FAMILY is f
        assert getattr(zoo.models, f.name) is f.build
