"""Recipes: for each tag, where its tensor lives between the forward and the backward pass.

A recipe is data: a name and two tuples of tags (or `fnmatch` patterns over the vocabulary):

- ``device``:  kept in HBM (saved residual),
- ``offload``: copied to pinned host memory in the forward pass and streamed back in the backward pass,
- every other tag is rematerialized (recomputed in the backward pass).

Two special recipes exist: ``Recipe.none()`` (nothing recomputed) and ``Recipe.full()`` (everything recomputed
but the scan carry). ``Recipe.policy()`` compiles a recipe to a JAX checkpoint policy that any
``jax.checkpoint`` / ``nnx.remat`` accepts.
"""
from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable
from typing import Literal

import jax

from zoo import tags as tags_lib

Placement = Literal["device", "offload", "remat"]
# The only destination JAX moves to host memory. Any other string (e.g. "host") silently keeps the value on the
# device, which is why it is fixed here and not a parameter.
OFFLOAD_DST = "pinned_host"
# Tags that only pay together: the attention kernel's backward reads its output (attention_out) and its softmax
# statistics (context); keeping one without the other leaves the forward kernel in the backward pass to make the
# missing one, so the kept one saves nothing (zoo.layers.attention_kernel).
TOGETHER = (("attention_out", "context"),)


def _expand(patterns: Iterable[str], field: str) -> tuple[str, ...]:
    out: list[str] = []
    for pat in patterns:
        if not isinstance(pat, str):
            raise ValueError(f"Recipe.{field}: expected tag names or patterns (str), got {pat!r}")
        hits = [t for t in tags_lib.NAMES if fnmatch.fnmatchcase(t, pat)]
        if not hits:
            raise ValueError(f"Recipe.{field}: {pat!r} matches no tag; the vocabulary is: {tags_lib.vocabulary()}")
        out.extend(h for h in hits if h not in out)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A mapping from tag to placement; unnamed tags are rematerialized.

    >>> r = Recipe("qkv_offload", offload=("query_proj", "key_proj", "value_proj"))
    >>> r.placement("key_proj"), r.placement("mlpwo")
    ('offload', 'remat')
    """

    name: str
    offload: tuple[str, ...] = ()
    device: tuple[str, ...] = ()
    # "none": everything saved on device; "full": everything recomputed. Use the constructors below.
    special: Literal["none", "full"] | None = None
    description: str = ""

    def __post_init__(self):
        if isinstance(self.offload, str) or isinstance(self.device, str):
            raise ValueError(f"Recipe {self.name!r}: offload and device take a tuple of tags, not a single string")
        if self.special not in (None, "none", "full"):
            raise ValueError(f"Recipe {self.name!r}: special must be None, 'none' or 'full', got {self.special!r}")
        if self.special is not None and (self.offload or self.device):
            raise ValueError(f"Recipe {self.name!r}: the special recipe {self.special!r} takes no tags")
        # Keep what the user wrote (patterns) in `patterns`, and store the expanded tag names.
        object.__setattr__(self, "patterns", {"offload": tuple(self.offload), "device": tuple(self.device)})
        offload = _expand(self.offload, "offload")
        device = _expand(self.device, "device")
        both = sorted(set(offload) & set(device))
        if both:
            raise ValueError(f"Recipe {self.name!r}: {both} placed both on device and offloaded; a tag has one "
                             f"placement. The vocabulary is: {tags_lib.vocabulary()}")
        object.__setattr__(self, "offload", offload)
        object.__setattr__(self, "device", device)
        for group in TOGETHER:
            kept = [t for t in group if t in offload or t in device]
            if kept and len(kept) < len(group):
                missing = [t for t in group if t not in kept]
                raise ValueError(f"Recipe {self.name!r} keeps {kept} but recomputes {missing}: {' and '.join(group)} "
                                 f"only pay together (the attention kernel's backward reads both, so keeping one "
                                 f"still runs the attention forward again); keep {missing} too (on device or "
                                 f"offloaded), or neither")

    @classmethod
    def none(cls, name: str = "none") -> Recipe:
        """Nothing recomputed: every residual stays on the device (plain backprop)."""
        return cls(name, special="none", description="nothing recomputed: every residual saved on device")

    @classmethod
    def full(cls, name: str = "full") -> Recipe:
        """Everything recomputed but the scan carry."""
        return cls(name, special="full", description="everything recomputed but the scan carry")

    def placement(self, tag: str) -> Placement:
        if tag not in tags_lib.TAGS:
            raise ValueError(f"unknown tag {tag!r}; the vocabulary is: {tags_lib.vocabulary()}")
        if self.special == "none":
            return "device"
        if tag in self.offload:
            return "offload"
        if tag in self.device:
            return "device"
        return "remat"

    def placements(self, emitted: Iterable[str]) -> dict[str, Placement]:
        return {t: self.placement(t) for t in emitted}

    def check_emitted(self, emitted: Iterable[str], where: str = "the model") -> None:
        """Raise ValueError if a name or pattern of this recipe matches no tag that `where` emits.

        A recipe that names a tag the model never computes would otherwise do nothing, silently (MaxText lost a
        2.6x to a renamed tag this way).
        """
        emitted = set(emitted)
        for field, pats in self.patterns.items():
            for pat in pats:
                if not any(fnmatch.fnmatchcase(t, pat) for t in emitted):
                    raise ValueError(
                        f"Recipe {self.name!r}: {field} entry {pat!r} matches no tag that {where} emits; "
                        f"{where} emits: {', '.join(sorted(emitted))}")

    def policy(self):
        """The JAX checkpoint policy for this recipe (for `jax.checkpoint` / `nnx.remat`)."""
        cp = jax.checkpoint_policies
        if self.special == "none":
            return cp.everything_saveable
        if self.special == "full" or not (self.offload or self.device):
            return cp.nothing_saveable
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=list(self.device),
            names_which_can_be_offloaded=list(self.offload),
            offload_src="device",
            offload_dst=OFFLOAD_DST,
        )

    def __str__(self) -> str:
        if self.special:
            return f"{self.name}: {self.description}"
        parts = [f"offload={list(self.offload)}" if self.offload else "",
                 f"device={list(self.device)}" if self.device else ""]
        return f"{self.name}: " + ", ".join(p for p in parts if p) + "; every other tag recomputed"
