"""Walking a jaxpr: the jaxprs held in an equation's parameters (a jit's body, a scan's, a cond's branches, a custom
VJP's primal), one level down, as open jaxprs (`jax.extend.core.jaxprs_in_params` skips the `ClosedJaxpr`s). The tag
reader, the loop guard, the per-device tag shapes and the planner's FLOP count recurse with it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax.extend.core


def sub_jaxprs(params: dict[str, Any]) -> Iterator[jax.extend.core.Jaxpr]:
    """The jaxprs in an equation's `params` (a value, or a tuple or list of them), each as an open `Jaxpr`."""
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v
