"""Settings for the whole test run, made before any test imports JAX (and inherited by every subprocess a test
starts with `os.environ` in its environment):

- XLA's CPU backend compiles with LLVM's optimisation level 0 (`--xla_backend_optimization_level=0`, added to the
  user's `XLA_FLAGS`, whose own setting wins). The tests run tiny models whose time is almost all compilation, and
  LLVM's optimisation passes are most of a CPU compile: this halves it. What the tests read is unchanged: the HLO
  passes, buffer assignment (the compiled peaks) and the program text are XLA's at any LLVM level, and every
  numeric comparison is between programs compiled under the same flags.
- One persistent JAX compilation cache per run (a temporary directory, made by the first pytest process and shared
  by the xdist workers and the subprocesses; removed at the end): a program compiled twice in a run (the same step
  in two tests, in a test and its subprocess, or again in a second `loop.run`) is compiled once. A directory the
  user set in `JAX_COMPILATION_CACHE_DIR` is used as is and kept.
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

CPU_OPT = "--xla_backend_optimization_level"
_made_cache = None   # the directory this process made (removed at the end)


def _setdefault_xla_flag(flag: str, value: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "").split()
    if not any(f.split("=")[0] == flag for f in flags):
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"{flag}={value}"])


_setdefault_xla_flag(CPU_OPT, "0")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:   # set by the user, or by the first pytest process (xdist)
    _made_cache = tempfile.mkdtemp(prefix="zoo-tests-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _made_cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
    if _made_cache is not None:
        shutil.rmtree(_made_cache, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """The tests that start processes with fake devices take minutes, the rest seconds: run them first, so that
    under xdist (`--dist worksteal`, pyproject.toml) the short ones fill the other workers instead of a long test
    starting last. A stable sort: every worker collects the same order."""
    items.sort(key=lambda item: item.get_closest_marker("multidevice") is None)


@pytest.fixture(scope="module")
def tiny_model():
    """A one-layer Llama whose parameters NumPy draws into its abstract state (no compilation)."""
    from tests.helpers import random_tiny_llama  # imports JAX: only after the flags above are set
    return random_tiny_llama(0.3)
