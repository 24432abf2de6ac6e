"""The loop guard: a loop inside a tagged layer may not hold a tag or an offload (offload inside nested scans is known
to break); any other loop, such as tokamax's kernel's, runs under any recipe, and the zoo's own sequence tiles
(`zoo.layers.tiles`, `TILE_SCOPE`) may hold tags. Apart from the tag reader (`zoo.emitted`) that calls it: it changes
with what JAX's nested scans support.
"""
from __future__ import annotations

from typing import Any

from zoo.jaxprs import sub_jaxprs

LOOPS = ("scan", "while")   # the loop primitives (fori_loop lowers to one of them)
TILE_SCOPE = "zoo_seq_tiles"   # the name scope of the sequence-tile loop (zoo.layers.tiles)


def is_loop(eqn) -> bool:
    """Whether the jaxpr equation `eqn` is a loop."""
    return eqn.primitive.name in LOOPS


def is_tile_loop(eqn) -> bool:
    """Whether the jaxpr equation `eqn` is the loop of the zoo's sequence tiles (`zoo.layers.tiles`)."""
    return eqn.primitive.name == "scan" and TILE_SCOPE in str(getattr(eqn.source_info, "name_stack", ""))


def _is_host_target(target) -> bool:
    """A device_put destination in host memory: a memory space, a memory kind, or a sharding with one."""
    kind = getattr(target, "memory_kind", None) or getattr(target, "kind", None)
    text = str(kind if kind is not None else target).lower()
    return "host" in text


def unsafe_content(params: dict[str, Any]) -> str | None:
    """What in the jaxprs of these equation parameters (recursively) makes a loop unsafe: 'the tag X' or 'an offload
    to host memory (device_put)'; None when there is neither."""
    for sub in sub_jaxprs(params):
        for eqn in sub.eqns:
            if eqn.primitive.name == "name":
                return f"the tag {eqn.params['name']!r}"
            if eqn.primitive.name == "device_put" and any(_is_host_target(d) for d in eqn.params.get("devices", ())):
                return "an offload to host memory (device_put)"
            held = unsafe_content(eqn.params)
            if held:
                return held
    return None


def check_loop(eqn) -> None:
    """ValueError when the loop equation `eqn` holds a tag or an offload anywhere in its body (the tile loop may hold
    tags); nothing otherwise."""
    held = unsafe_content(eqn.params)
    if held and held.startswith("the tag") and is_tile_loop(eqn):
        return
    if held:
        raise ValueError(f"a tagged layer contains a {eqn.primitive.name} whose body holds {held}: offload inside "
                         f"nested scans is known to break; the zoo keeps tags and offloads at one scan level (the "
                         f"layer stack). A loop without tags or offloads (a kernel's own, e.g. tokamax's grouped "
                         f"matmul) is fine")
