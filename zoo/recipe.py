"""Recipes: for each tag, where its tensor lives between the forward and the backward pass.

A recipe (a value: a name and two tuples of tags or `fnmatch` patterns, expanded by `Recipe.resolve()`) keeps its
``device`` tags in HBM, copies its ``offload`` tags to pinned host memory and back, and recomputes every other tag;
``Recipe.policy()`` is its JAX checkpoint policy. ``seq_tiles`` and ``group`` say how the zoo's stacks recompute beyond
the tags (`zoo.layers.tiles`; layers per rematerialized group, Chen et al. 2016).
"""
from __future__ import annotations

import dataclasses
import fnmatch
import functools
from collections.abc import Iterable
from typing import Literal

import jax

from zoo import tags as tags_lib
from zoo.checks import check_positive

Placement = Literal["device", "offload", "remat"]
# The only destination JAX moves to host memory. Any other string (e.g. "host") silently keeps the value on the
# device, which is why it is fixed here and not a parameter.
OFFLOAD_DST = "pinned_host"
# The attention kernel's residuals: its output (attention_out) and its softmax statistics (context). Its backward
# reads both; keeping one without the other leaves the forward kernel in the backward pass to make the missing one,
# so the kept one saves nothing (zoo.layers.attention_kernel).
ATTENTION_RESIDUALS = ("attention_out", "context")
# Tags that only pay together.
TOGETHER = (ATTENTION_RESIDUALS,)


def _expand(patterns: tuple[str, ...], names: Iterable[str]) -> tuple[str, ...]:
    """The names of `names` (in their order) that some pattern of `patterns` matches."""
    return tuple(t for t in names if any(fnmatch.fnmatchcase(t, pat) for pat in patterns))


@dataclasses.dataclass(frozen=True)
class ResolvedRecipe:
    """A recipe's patterns expanded to tag names (`Recipe.resolve`): over the vocabulary, or over the tags one
    model emits.

    Args:
        recipe: the recipe as written.
        offload: the tag names it sends to pinned host memory.
        device: the tag names it keeps in HBM.
        group_keep: the tag names a group's layers keep while the group's backward runs.
        lead_device: the tag names the first layer of each group keeps in HBM between the passes.
        lead_offload: the tag names the first layer of each group sends to pinned host memory.

    Examples:
        >>> from zoo import Recipe
        >>> Recipe("mlp", device=("mlpwi_*",)).resolve().device
        ('mlpwi_0', 'mlpwi_1')
    """
    recipe: Recipe
    offload: tuple[str, ...]
    device: tuple[str, ...]
    group_keep: tuple[str, ...] = ()
    lead_device: tuple[str, ...] = ()
    lead_offload: tuple[str, ...] = ()

    @property
    def lead(self) -> tuple[str, ...]:
        """The tag names the first layer of each group keeps between the passes (in HBM or on the host)."""
        return self.lead_device + self.lead_offload


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Where each named intermediate of a training step lives between the forward and the backward pass: kept in HBM
    (`device`), copied to pinned host memory and back (`offload`), or recomputed (every tag the recipe does not
    name). It compiles to a JAX checkpoint policy (`policy()`), and the zoo's stacks also apply its structure: sequence
    tiles (Arctic Long Sequence Training's tiled compute) and layer groups (sublinear checkpointing, Chen et al.
    2016, two levels deep, or three with subgroups). A value: it holds what was written (tag names or `fnmatch`
    patterns) and nothing else.

    Args:
        name: the recipe's name (what `--recipe` takes when a family's set holds it).
        offload: tags (or patterns over the vocabulary, `zoo.tags.NAMES`) sent to pinned host memory.
        device: tags (or patterns) kept in HBM.
        special: "none" (nothing recomputed) or "full" (everything recomputed but the layer input); use
            `Recipe.none()` and `Recipe.full()`.
        description: one line saying what the recipe does, for tables and `--help`.
        seq_tiles: each layer's per-position parts run over this many sequence tiles, each rematerialized alone.
        group: layers per rematerialized group: the layer input is kept every `group` layers and each layer inside
            a group is rematerialized on its own.
        group_keep: tags each layer of a group keeps in HBM only while the group's backward pass runs.
        subgroup: layers per checkpoint between a group's and each layer's (three levels): a group's backward keeps
            its subgroups' inputs, and each subgroup's backward its layers' inputs, for one more forward pass of the
            group. 1: two levels. It must divide `group` and be smaller.
        lead_device: tags the first layer of each group (two levels) keeps in HBM between the passes, where the other
            layers recompute them: the attention kernel's pair for one layer in `group`, one attention forward fewer
            for that layer, where HBM cannot hold it for every layer.
        lead_offload: the same, sent to pinned host memory.

    Raises:
        ValueError: a name or pattern that matches no tag (the message lists the vocabulary), a tag in two
            placements, one of the attention kernel's two residuals kept without the other, a non-positive or boolean
            `seq_tiles`, `group` or `subgroup`, `group_keep` without groups, a `subgroup` that is not a proper divisor
            of `group`, lead tags on a recipe without groups, in subgroups, on a special recipe, or already kept by
            every layer.

    Examples:
        >>> from zoo import Recipe
        >>> r = Recipe("qkv_offload", offload=("query_proj", "key_proj", "value_proj"))
        >>> r.placement("key_proj"), r.placement("mlpwi_0")
        ('offload', 'remat')
    """

    name: str
    offload: tuple[str, ...] = ()   # tag names or fnmatch patterns over the vocabulary, as written
    device: tuple[str, ...] = ()
    # "none": everything saved on device; "full": everything recomputed. Use the constructors below.
    special: Literal["none", "full"] | None = None
    description: str = ""
    seq_tiles: int = 1              # the per-position parts of each layer in this many sequence tiles
    group: int = 1                  # layers per rematerialized group: the layer input kept every `group` layers
    # tags (or patterns) each layer of a group keeps in HBM while its group's backward pass runs, recomputed between
    # the passes: the group's recompute makes them once, each layer's own backward reads them (two-level checkpoints)
    group_keep: tuple[str, ...] = ()
    subgroup: int = 1               # layers per checkpoint between a group's and each layer's (1: two levels)
    # tags (or patterns) the first layer of each group keeps between the passes, in HBM or on the host: the layers
    # after it recompute them (the kernel's pair for one layer in `group`, where there is no room for every layer's)
    lead_device: tuple[str, ...] = ()
    lead_offload: tuple[str, ...] = ()

    def __post_init__(self):
        """Checks only (the fields are never rewritten): tuples of strings, each matching a tag of the vocabulary,
        no tag placed twice, a special recipe without tags."""
        for field in ("offload", "device", "group_keep", "lead_device", "lead_offload"):
            value = getattr(self, field)
            if not isinstance(value, tuple):
                raise ValueError(f"Recipe {self.name!r}: {field} takes a tuple of tags, got {value!r}")
            for pat in value:
                if not isinstance(pat, str):
                    raise ValueError(f"Recipe.{field}: expected tag names or patterns (str), got {pat!r}")
                if not _expand((pat,), tags_lib.NAMES):
                    raise ValueError(f"Recipe.{field}: {pat!r} matches no tag; the vocabulary is: "
                                     f"{tags_lib.vocabulary()}")
        if self.special not in (None, "none", "full"):
            raise ValueError(f"Recipe {self.name!r}: special must be None, 'none' or 'full', got {self.special!r}")
        if self.special is not None and (self.offload or self.device):
            raise ValueError(f"Recipe {self.name!r}: the special recipe {self.special!r} takes no tags")
        for field in ("seq_tiles", "group", "subgroup"):
            check_positive(f"Recipe {self.name!r}: {field}", getattr(self, field), optional=False)
        if self.group_keep and self.group == 1:
            raise ValueError(f"Recipe {self.name!r}: group_keep={self.group_keep!r} needs layer groups (group > 1): it "
                             f"says what a group's backward pass keeps while it runs")
        if self.subgroup > 1 and (self.group % self.subgroup or self.subgroup == self.group):
            raise ValueError(f"Recipe {self.name!r}: subgroup={self.subgroup} must divide group={self.group} and be "
                             f"smaller: a group runs in whole subgroups of fewer layers")
        if self.special == "none" and (self.seq_tiles > 1 or self.group > 1):
            raise ValueError(f"Recipe {self.name!r} recomputes nothing: seq_tiles and group only change what is "
                             f"recomputed, and must be 1")
        r = self.resolve()
        both = sorted(set(r.offload) & set(r.device))
        if both:
            raise ValueError(f"Recipe {self.name!r}: {both} placed both on device and offloaded; a tag has one "
                             f"placement. The vocabulary is: {tags_lib.vocabulary()}")
        self._check_lead(r)
        for group in TOGETHER:
            kept = [t for t in group if t in r.offload or t in r.device]
            if kept and len(kept) < len(group):
                missing = [t for t in group if t not in kept]
                raise ValueError(f"Recipe {self.name!r} keeps {kept} but recomputes {missing}: {' and '.join(group)} "
                                 f"only pay together (the attention kernel's backward reads both, so keeping one "
                                 f"still runs the attention forward again); keep {missing} too (on device or "
                                 f"offloaded), or neither")
        self._whole("group_keep keeps", set(r.group_keep + r.offload + r.device))

    def _whole(self, who: str, tags) -> None:
        """ValueError where `tags` hold part of a group of tags that only pay together (`TOGETHER`), naming `who`
        holds it."""
        for group in TOGETHER:
            inner = [t for t in group if t in tags]
            if 0 < len(inner) < len(group):
                raise ValueError(f"Recipe {self.name!r}: {who} {inner} but not "
                                 f"{[t for t in group if t not in inner]}: {' and '.join(group)} only pay together")

    def _check_lead(self, r: ResolvedRecipe) -> None:
        """ValueError unless the lead tags (`lead_device`, `lead_offload`) have a group's first layer to serve: a
        two-level group, tags no layer keeps already, the kernel's pair whole."""
        lead = r.lead
        if not lead:
            return
        if self.special is not None or self.group == 1 or self.subgroup > 1:
            got = f"special={self.special!r}" if self.special else f"group={self.group}, subgroup={self.subgroup}"
            raise ValueError(f"Recipe {self.name!r}: lead_device / lead_offload say what the first layer of each group "
                             f"keeps, so they need layer groups of two levels (group > 1, subgroup 1) on a recipe of "
                             f"tags; got {got}")
        both = sorted(set(r.lead_device) & set(r.lead_offload))
        every = sorted(set(lead) & set(r.device + r.offload))
        if both or every:
            raise ValueError(f"Recipe {self.name!r}: lead tags {both or every} are "
                             + ("placed both in HBM and offloaded; a tag has one placement" if both else
                                "kept by every layer already (device or offload); lead tags are for the first "
                                "layer of each group alone"))
        self._whole("the lead layer keeps", lead)

    def resolve(self, emitted: Iterable[str] | None = None, where: str = "the model") -> ResolvedRecipe:
        """The tag names this recipe offloads and keeps on the device: over the whole vocabulary, or, given the
        tags a model emits, over those (ValueError if a name or pattern matches none of them: a recipe that names
        a tag the model never computes would otherwise do nothing, silently; MaxText lost a 2.6x to a renamed tag
        this way)."""
        if emitted is None:
            names: Iterable[str] = tags_lib.NAMES
        else:
            names = [t for t in tags_lib.NAMES if t in set(emitted)]
            for field in ("offload", "device", "group_keep", "lead_device", "lead_offload"):
                for pat in getattr(self, field):
                    if not _expand((pat,), names):
                        raise ValueError(
                            f"Recipe {self.name!r}: {field} entry {pat!r} matches no tag that {where} emits; "
                            f"{where} emits: {', '.join(sorted(names))}")
        return ResolvedRecipe(self, _expand(self.offload, names), _expand(self.device, names),
                              _expand(self.group_keep, names), _expand(self.lead_device, names),
                              _expand(self.lead_offload, names))

    @classmethod
    def none(cls, name: str = "none") -> Recipe:
        """Nothing recomputed: every residual stays on the device (plain backprop)."""
        return cls(name, special="none", description="nothing recomputed: every residual saved on device")

    @classmethod
    def full(cls, name: str = "full", *, seq_tiles: int = 1, group: int = 1, group_keep: tuple[str, ...] = (),
             subgroup: int = 1) -> Recipe:
        """Everything recomputed but the scan carry (kept every `group` layers, in subgroups of `subgroup`), in
        `seq_tiles` sequence tiles."""
        return cls(name, special="full", description="everything recomputed but the scan carry", seq_tiles=seq_tiles,
                   group=group, group_keep=group_keep, subgroup=subgroup)

    @property
    def structure(self) -> str:
        """How the stack recomputes beyond the tags, in words ("" for one tile and one layer per group)."""
        r = self.resolve()
        keep = r.group_keep
        parts = [f"in {self.seq_tiles} sequence tiles" if self.seq_tiles > 1 else "",
                 f"the layer input kept every {self.group} layers" if self.group > 1 else "",
                 f"in subgroups of {self.subgroup}" if self.subgroup > 1 else "",
                 f"{list(keep)} kept while a group's backward runs" if keep else "",
                 f"the first layer of each group keeping {list(r.lead_device)} in HBM" if r.lead_device else "",
                 f"the first layer of each group offloading {list(r.lead_offload)}" if r.lead_offload else ""]
        return ", ".join(p for p in parts if p)

    def placement(self, tag: str) -> Placement:
        if tag not in tags_lib.TAGS:
            raise ValueError(f"unknown tag {tag!r}; the vocabulary is: {tags_lib.vocabulary()}")
        if self.special == "none":
            return "device"
        if _expand(self.offload, (tag,)):
            return "offload"
        if _expand(self.device, (tag,)):
            return "device"
        return "remat"

    def check_emitted(self, emitted: Iterable[str], where: str = "the model") -> None:
        """Raise ValueError if a name or pattern of this recipe matches no tag that `where` emits
        (`resolve(emitted)`)."""
        self.resolve(emitted, where)

    def policy(self):
        """The JAX checkpoint policy for this recipe (for `jax.checkpoint` / `nnx.remat`)."""
        cp = jax.checkpoint_policies
        if self.special == "none":
            return cp.everything_saveable
        if self.special == "full" or not (self.offload or self.device or self.lead_device or self.lead_offload):
            return cp.nothing_saveable
        r = self.resolve()
        lead = functools.partial(tags_lib.role_name, role=tags_lib.LEAD)
        # a group's first layer names its tags apart (`lead_policy`): the same placements, and its lead tags
        device, offload = (list(r.device), list(r.offload)) if not r.lead else (
            list(r.device) + [lead(t) for t in r.device + r.lead_device],
            list(r.offload) + [lead(t) for t in r.offload + r.lead_offload])
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=device,
            names_which_can_be_offloaded=offload,
            offload_src="device",
            offload_dst=OFFLOAD_DST,
        )

    def layer_policy(self):
        """The checkpoint policy of each layer inside a group of `group` layers (two-level checkpoints,
        `zoo.models.stack.group_body`): every tag the recipe keeps (in HBM or offloaded: the group's own policy
        brings it back) and `group_keep`, saved in HBM while the group's backward pass runs."""
        cp = jax.checkpoint_policies
        if self.special == "none":
            return cp.everything_saveable
        r = self.resolve()
        names = (() if self.special == "full" else r.device + r.offload) + r.group_keep
        return cp.save_only_these_names(*names) if names else cp.nothing_saveable

    def lead_policy(self):
        """The checkpoint policy of the first layer of each group, whose tags are named apart
        (`zoo.tags.role_name(tag, zoo.tags.LEAD)`): what `layer_policy` saves, and the lead tags. None where the
        recipe has no lead tags (the group's first layer runs as the others)."""
        r = self.resolve()
        if not r.lead:
            return None
        names = r.device + r.offload + r.group_keep + r.lead
        return jax.checkpoint_policies.save_only_these_names(*(tags_lib.role_name(t, tags_lib.LEAD) for t in names))

    def __str__(self) -> str:
        extra = f"; {self.structure}" if self.structure else ""
        if self.special:
            return f"{self.name}: {self.description}{extra}"
        r = self.resolve()
        parts = [f"offload={list(r.offload)}" if r.offload else "",
                 f"device={list(r.device)}" if r.device else ""]
        return f"{self.name}: " + ", ".join(p for p in parts if p) + "; every other tag recomputed" + extra
