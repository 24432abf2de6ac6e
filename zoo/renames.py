"""Names renamed since the last release, kept for one release as errors that name the new form (docs/changes.md): a
renamed attribute raises `AttributeError`, a module `ModuleNotFoundError`, a keyword `TypeError`, and a module that used
to be called `TypeError`. This module imports nothing of the zoo, so any module may use it.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
import types
from collections.abc import Callable

# module -> {old attribute: what replaces it}
ATTRIBUTES: dict[str, dict[str, str]] = {
    "zoo.tags": {"emitted": "zoo.emitted.emitted", "emitted_by": "zoo.emitted.emitted_by",
                 "join_chunks": "zoo.emitted.join_chunks", "sub_jaxprs": "zoo.jaxprs.sub_jaxprs"},
    "zoo.layers": {"Llama3Scaling": "zoo.layers.WavelengthScaling"},
    "zoo.layers.rope": {"Llama3Scaling": "zoo.layers.rope.WavelengthScaling"},
    "zoo.models": {"llama": "zoo.models.llama3", "deepseek": "zoo.models.deepseek_v3"},
}
# old module -> its new name
MODULES: dict[str, str] = {"zoo.models.llama": "zoo.models.llama3", "zoo.models.deepseek": "zoo.models.deepseek_v3"}
# module that used to be called -> what to call instead
CALLS: dict[str, str] = {"zoo.plan": "zoo.plan.plan(cfg, recipe, batch=..., seq=...)"}


def attributes(module: str) -> Callable[[str], object]:
    """The module-level `__getattr__` of `module`: a renamed attribute raises AttributeError naming the new one."""
    renamed = ATTRIBUTES[module]

    def __getattr__(name: str):
        if name in renamed:
            raise AttributeError(f"{module}.{name} is now {renamed[name]}")
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    return __getattr__


def keywords(**renamed: str) -> Callable[[Callable], Callable]:
    """A decorator: calling the function with a renamed keyword raises TypeError naming the new one (the
    signature, docs and behaviour are otherwise the function's)."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old in kwargs:   # in the caller's order: the first renamed one is named
                if old in renamed:
                    raise TypeError(f"{fn.__name__}(): the keyword {old}= is now {renamed[old]}")
            return fn(*args, **kwargs)
        return call
    return decorate


class _CalledModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        raise TypeError(f"{self.__name__} is a package, not a function: call {CALLS[self.__name__]}")


def called(module: str) -> None:
    """Make calling the module `module` (a name in CALLS) a TypeError naming what to call instead."""
    sys.modules[module].__class__ = _CalledModule


class _Finder(importlib.abc.MetaPathFinder):
    """Last on `sys.meta_path`: an import of a renamed module (one no other finder found) fails naming the new."""

    def find_spec(self, fullname, path, target=None):
        if fullname in MODULES:
            raise ModuleNotFoundError(f"{fullname} is now {MODULES[fullname]}", name=fullname)
        return None


def install_module_finder() -> None:
    """Put the renamed-module finder last on `sys.meta_path` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
