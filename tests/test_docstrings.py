"""The code's own words: docstrings short where they are prose (a module's at most 20 lines, a function's or class's at
most 80: a public one carries its `Args:`, `Returns:` and an example, flax's way; measurements, histories and rationale
live in docs/, docs/internals.md first), and no docstring or doc page naming a module, function or file that does not
exist.

What is a name: a dotted path into the project's packages (`zoo.plan.peak.compile_step`,
`recipes.train.settings.job.Job`, `bench.records.load`), resolved by importing the longest module prefix and reading the
rest as attributes (a dataclass's fields count); and a path of the repository (`zoo/plan/build.py`, `docs/planner.md`,
`bench/results/README.md`), which must exist. A path with a placeholder (`zoo/models/<family>/`) or a glob is left
alone, and so is docs/changes.md, whose first column names what no longer exists.

The public API (`public_api`) is documented as flax documents its modules: each class and function has a docstring
with `Args:` naming every argument and no other (a module's constructor arguments in the class docstring, its call
arguments in `__call__`'s), `Returns:` unless it returns None, an example (`>>>`) that `test_docstring_examples_run`
runs, and, for a layer that names intermediates, `Emits:` naming tags of the vocabulary (`zoo.tags`).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re

import pytest

from tests.helpers import ROOT

CODE = ("zoo", "recipes", "bench")
MODULE_LINES, FUNCTION_LINES = 20, 80
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
    assert resolves("zoo.plan.peak.compile_step") and resolves("recipes.train.settings.job.Job.storage")
    assert not resolves("zoo.plan.peak.compile_everything") and not resolves("recipes.data.open_data")
    assert PATH.findall("see `recipes/train/loop.py` and zoo/models/<family>/config.py") == ["recipes/train/loop.py"]


# -- the public API, documented as flax documents its own ----------------------------------------------------------
# Modules (and the modules below them) whose every public class (defined there, not imported) is public API; and
# whose every public function is, for the last two.
CLASSES = ("zoo.layers", "zoo.models", "zoo.recipe", "zoo.train_step")
FUNCTIONS = ("zoo.recipe", "zoo.train_step")
# Packages whose `__all__` names public API defined in their modules (which also hold helpers of their own).
EXPORTING = ("zoo.layers", "zoo.layers.moe", "zoo.models", "zoo.models.deepseek_v3", "zoo.models.llama3",
             "zoo.models.qwen3", "zoo.models.qwen3_moe", "zoo.plan")
# Public names allowed to lack their documentation for now, by exact name (none: every one is documented).
PENDING: set[str] = set()
SECTION = re.compile(r"^(\s*)(Args|Returns|Raises|Example|Examples|Emits|Yields|Attributes):\s*$", re.M)


def library_modules(prefix: str) -> list[str]:
    """`prefix` and every module below it, by name (private modules left out)."""
    root = ROOT / prefix.replace(".", "/")
    if not root.is_dir():
        return [prefix]
    return sorted(prefix + "".join(f".{part}" for part in p.relative_to(root).with_suffix("").parts)
                  for p in root.rglob("*.py") if not any(part.startswith("_") for part in p.relative_to(root).parts
                                                           if part != "__init__.py"))


def public_api() -> dict[str, object]:
    """{qualified name where defined: class or function} of the public API."""
    import inspect
    out = {}
    for prefix in CLASSES:
        for name in library_modules(prefix):
            module = importlib.import_module(name.removesuffix(".__init__"))
            for attr, obj in vars(module).items():
                wanted = inspect.isclass(obj) or (inspect.isfunction(obj) and prefix in FUNCTIONS)
                if not attr.startswith("_") and wanted and obj.__module__ == module.__name__:
                    out[f"{module.__name__}.{attr}"] = obj
    for name in EXPORTING:
        module = importlib.import_module(name)
        for attr in module.__all__:
            obj = getattr(module, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__.startswith("zoo."):
                out[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return out


def section(doc: str, title: str) -> str | None:
    """The text of a docstring's section (`Args:` ...), up to the next section or the end; None without one."""
    heads = list(SECTION.finditer(doc))
    for i, m in enumerate(heads):
        if m.group(2) == title:
            return doc[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(doc)]
    return None


def documented_args(doc: str) -> set[str]:
    """The names an `Args:` section documents (`name: ...` or `name (type): ...` at its first indentation)."""
    text = section(doc, "Args")
    if text is None:
        return set()
    lines = [x for x in text.splitlines() if x.strip()]
    indent = min((len(x) - len(x.lstrip()) for x in lines), default=0)
    return {m.group(1) for x in lines if len(x) - len(x.lstrip()) == indent
            for m in [re.match(r"\s*\**(\w+)(?:\s*\([^)]*\))?:", x)] if m}


def arguments(fn) -> list[str]:
    """A function's argument names, self and cls left out."""
    import inspect
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    return [p for p in params if p not in ("self", "cls")]


def constructor(cls):
    """The `__init__` that makes `cls` (None where it is object's, a Protocol's or flax's own: no arguments)."""
    import typing
    if typing.Protocol in cls.__mro__:
        return None
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            return None if klass.__module__.split(".")[0] not in PACKAGES else klass.__init__
    return None


def problems(qualname: str, obj) -> list[str]:
    """What the docstring of a public class or function lacks."""
    import inspect
    doc = inspect.getdoc(obj) if inspect.isfunction(obj) else obj.__doc__
    if not doc:
        return [f"{qualname}: no docstring"]
    doc = inspect.cleandoc(doc)
    out = []
    if ">>>" not in doc:
        out.append(f"{qualname}: no example (>>>)")
    if re.search(r"^\s*Example:\s*$", doc, re.M):
        out.append(f"{qualname}: title its examples 'Examples:' (the docs site reads 'Example:' as a note, as prose)")
    if inspect.isclass(obj):
        init = constructor(obj)
        known = set().union(*(documented_args(inspect.cleandoc(k.__doc__ or "")) for k in obj.__mro__
                              if k.__module__.split(".")[0] in PACKAGES))
        missing = [a for a in (arguments(init) if init else []) if a not in known]
        if missing:
            out.append(f"{qualname}: constructor arguments not under Args: {missing}")
        stale = sorted(documented_args(doc) - set(arguments(init))) if init else []
        if stale:
            out.append(f"{qualname}: Args: names what is not a constructor argument: {stale}")
        call = vars(obj).get("__call__")
        if call is not None and not getattr(call, "__isabstractmethod__", False):
            out += problems(f"{qualname}.__call__", call) if arguments(call) else []
        from zoo.layers.tagged import TaggedLayer
        if issubclass(obj, TaggedLayer) and obj is not TaggedLayer:
            out += emits(qualname, doc)
        return out
    missing = [a for a in arguments(obj) if a not in documented_args(doc)]
    if missing:
        out.append(f"{qualname}: arguments not under Args: {missing}")
    stale = sorted(documented_args(doc) - set(arguments(obj)))
    if stale:
        out.append(f"{qualname}: Args: names what is not an argument: {stale}")
    if inspect.signature(obj).return_annotation not in (None, "None") and section(doc, "Returns") is None \
            and section(doc, "Yields") is None:
        out.append(f"{qualname}: no Returns:")
    return [x for x in out if not (x.endswith("no example (>>>)") and qualname.endswith(".__call__"))]


def emits(qualname: str, doc: str) -> list[str]:
    """A layer's `Emits:` section names tags of the vocabulary (`{prefix}mlpwi_0` for a prefixed tag)."""
    from zoo.tags import NAMES
    text = section(doc, "Emits")
    if text is None:
        return [f"{qualname}: no Emits: (the tags it names)"]
    named = [t.replace("{prefix}", "") for t in re.findall(r"`([{}\w]+)`", text)]
    return [] if set(named) & set(NAMES) else [f"{qualname}: Emits: names no tag of zoo.tags"]


def test_every_public_class_and_function_is_documented():
    """Every class and function of the public API has a docstring with `Args:` for every argument, `Returns:`, an
    example and, for a layer, the tags it emits; PENDING lists those not yet documented, by name."""
    api = public_api()
    assert len([n for n, o in api.items() if isinstance(o, type) and n.startswith(("zoo.layers.", "zoo.models."))]) \
        == 45
    found = [p for name, obj in sorted(api.items()) if name not in PENDING for p in problems(name, obj)]
    assert not found, "document these as flax does (Args:, Returns:, an example):\n" + "\n".join(found)
    still = [n for n in sorted(PENDING) if n in api and not problems(n, api[n])]
    assert not still, f"documented now: take them out of PENDING: {still}"
    gone = sorted(PENDING - set(api))
    assert not gone, f"PENDING names what is not public API: {gone}"


def test_the_check_sees_a_missing_argument_and_a_missing_example():
    def f(a, *, b):
        """Does.

        Args:
          a: one.

        Returns:
          nothing much.
        """
    assert problems("f", f) == ["f: no example (>>>)", "f: arguments not under Args: ['b']"]

    def g(a) -> None:
        """Does.

        Args:
          a: one.
          b: gone.

        Examples:
          >>> g(1)
        """
    assert problems("g", g) == ["g: Args: names what is not an argument: ['b']"]
    assert documented_args("Args:\n  x (int): a.\n    y: no, a continuation.\n  **kw: rest.\n") == {"x", "kw"}


def doctests():
    import doctest
    finder = doctest.DocTestFinder(recurse=True, exclude_empty=True)
    found = {}
    for name in library_modules("zoo"):
        module = importlib.import_module(name.removesuffix(".__init__"))
        for test in finder.find(module, module.__name__):   # in the module's globals, as `python -m doctest`
            if test.examples and test.name.startswith(module.__name__) and \
                    getattr(test, "lineno", None) is not None and test.filename == module.__file__:
                found[test.name] = test
    return sorted(found.values(), key=lambda t: t.name)


# The layers' and the recipe's examples run in the default set; those that build whole models, plan or compile a step
# (seconds each) in the slow set.
FAST_EXAMPLES = ("zoo.layers.", "zoo.recipe.", "zoo.checks.", "zoo.names.", "zoo.tags.")


@pytest.mark.parametrize("test", [t if t.name.startswith(FAST_EXAMPLES) else pytest.param(t, marks=pytest.mark.slow)
                                  for t in doctests()], ids=lambda t: t.name)
def test_docstring_examples_run(test):
    """Every `>>>` example of the library's docstrings runs and prints what it shows (on the CPU, tiny shapes)."""
    import doctest
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = []
    runner.run(test, out=out.append)
    assert runner.failures == 0, "".join(out)
