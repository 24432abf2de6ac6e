"""One of jaxlib's distributed constructors, replaced while `jax.distributed.initialize()` runs: how the training
command hosts the coordination service in a process of its own (`recipes.train.processes.coordinator`) and reaches it
through a relay (`recipes.train.processes.relay`). jaxlib keeps them in a private module,
`jax._src.distributed._jax`."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def replaced(name: str, replace: Callable[[Callable], Callable]) -> Iterator[None]:
    """Within the block, jaxlib's constructor `name` is `replace(original)`; where this JAX keeps no such name,
    the block runs with JAX's own."""
    try:
        from jax._src import distributed
        lib = distributed._jax
        original = getattr(lib, name)
    except (ImportError, AttributeError):
        yield
        return

    class Lib:   # jaxlib's module, with one constructor replaced
        def __getattr__(self, attr: str) -> Any:
            return getattr(lib, attr)

    patched = Lib()
    setattr(patched, name, replace(original))
    distributed._jax = patched
    try:
        yield
    finally:
        distributed._jax = lib
