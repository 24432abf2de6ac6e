"""The tag vocabulary: one name per offloadable intermediate.

Every layer passes the tensors a training step might keep, offload or recompute through :func:`name`
(`jax.ad_checkpoint.checkpoint_name` checked against this closed vocabulary). Names follow MaxText where it has one;
each tag has a meaning and a symbolic shape for people, its real shape being read off a trace (`zoo.emitted`).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
from jax.ad_checkpoint import checkpoint_name

from zoo import logical, renames


@dataclasses.dataclass(frozen=True)
class Tag:
    name: str
    shape: str  # symbolic, for people; the real shape comes from tracing a layer
    meaning: str


# one row a tag (a table: its rows repeat each other's shape)
_TAGS = (
    Tag("decoder_layer_input", "[B,S,D]", "the decoder layer's input (the scan carry), named on the first line of "
        "the rematerialized layer body; naming the carry outside the body offloads nothing (jax#23869)"),
    Tag("query_proj", "[B,S,H,dq]", "queries after RoPE (GQA, after the q norm where there is one) or after "
        "concatenating nope and rope parts (MLA)"),
    Tag("key_proj", "[B,S,Hkv,dq]", "keys after RoPE (GQA, after the k norm where there is one) or after "
        "concatenating nope and shared rope parts (MLA)"),
    Tag("value_proj", "[B,S,Hkv,dv]", "values"),
    Tag("attention_out", "[B,S,H,dv]", "the attention kernel's output (before the output projection), named by the "
        "kernel as one of its two residuals; keep it together with context or neither"),
    Tag("out_proj", "[B,S,D]", "attention output projection"),
    Tag("context", "[B,H,S]", "the attention kernel's softmax statistics (float32 log-sum-exp of each query's "
        "logits), what its backward reads beside q, k, v and attention_out: keeping both leaves no attention forward "
        "in the backward pass (zoo.layers.attention_kernel)"),
    Tag("query_wa_proj", "[B,S,q_lora_rank]", "MLA query down-projection, before its RMSNorm"),
    Tag("mla_q", "[B,S,q_lora_rank]", "MLA query latent after its RMSNorm"),
    Tag("kv_wa_proj", "[B,S,kv_lora_rank+qk_rope]", "MLA key/value down-projection (latent and shared rope key)"),
    Tag("mla_kv", "[B,S,kv_lora_rank]", "MLA key/value latent after its RMSNorm"),
    Tag("mlpwi_0", "[B,S,F]", "dense MLP gate projection, before the activation"),
    Tag("mlpwi_1", "[B,S,F]", "dense MLP up projection"),
    Tag("mlpwo", "[B,S,D]", "dense MLP down projection"),
    Tag("moe_mlpwi_0", "[B*S*k,Fe]", "routed experts' gate projection over the dispatched rows, before the activation"),
    Tag("moe_mlpwi_1", "[B*S*k,Fe]", "routed experts' up projection over the dispatched rows"),
    Tag("moe_mlpwo", "[B*S*k,D]", "routed experts' down projection over the dispatched rows"),
    Tag("shared_mlpwi_0", "[B,S,Fs]", "shared expert gate projection, before the activation"),
    Tag("shared_mlpwi_1", "[B,S,Fs]", "shared expert up projection"),
    Tag("shared_mlpwo", "[B,S,D]", "shared expert down projection"),
)

TAGS: dict[str, Tag] = {t.name: t for t in _TAGS}
NAMES: tuple[str, ...] = tuple(TAGS)


def seq_axis(tag: str) -> int:
    """The sequence axis of a tag's tensor, from its symbolic shape ("[B,H,S]" -> 2); 1 where S is not an axis of
    its own (the routed experts' dispatched rows)."""
    axes = TAGS[tag].shape.strip("[]").split(",")
    return axes.index("S") if "S" in axes else 1


def vocabulary() -> str:
    """The vocabulary as text, for error messages and `--help`."""
    return ", ".join(NAMES)


# The first layer of each group names its tags apart ("attention_out@lead"), so a checkpoint policy can keep them
# for that layer alone (`Recipe.lead_device`, `Recipe.lead_offload`; zoo.models.stack.group_body).
LEAD = "lead"
_ROLE: contextvars.ContextVar[str] = contextvars.ContextVar("zoo_tag_role", default="")


def role_name(tag: str, role: str = "") -> str:
    """The checkpoint name of `tag` in a layer of `role`.

    Args:
        tag: a tag of the vocabulary.
        role: "" for every layer but a group's first (`LEAD`).

    Returns:
        `tag`, or `tag@role`.

    Examples:
        >>> from zoo import tags
        >>> tags.role_name("context", tags.LEAD)
        'context@lead'
    """
    return f"{tag}@{role}" if role else tag


def split_name(checkpoint: str) -> tuple[str, str]:
    """The tag and role of a checkpoint name `role_name` made.

    Args:
        checkpoint: a checkpoint name (`tag` or `tag@role`).

    Returns:
        (tag, role), the role "" for a plain tag.
    """
    tag, _, role = checkpoint.partition("@")
    return tag, role


@contextlib.contextmanager
def role(value: str):
    """Within this block (while a layer is traced), `name` names each tag as `role_name(tag, value)`.

    Args:
        value: the role (`LEAD` for a group's first layer).
    """
    token = _ROLE.set(value)
    try:
        yield
    finally:
        _ROLE.reset(token)


def current_role() -> str:
    """The role `name` names tags under now ("" outside `role`)."""
    return _ROLE.get()


def name(x: jax.Array, tag: str, axes: tuple[str | None, ...] | None = None) -> jax.Array:
    """Tag `x` as the intermediate `tag`: `checkpoint_name` restricted to the vocabulary (inside `role`, the
    checkpoint name is `role_name(tag, role)`).

    `axes`: the logical axis names of `x`. Under an active mesh and rules (`zoo.sharding.use`) a sharding constraint
    by those names comes first, so an offloaded residual keeps its sharding in host memory; a no-op otherwise."""
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}; the vocabulary is: {vocabulary()}")
    if axes is not None:
        x = logical.constrain(x, axes)
    return checkpoint_name(x, role_name(tag, _ROLE.get()))


__getattr__ = renames.attributes(__name__)   # names moved to zoo.emitted, zoo.jaxprs (docs/changes.md)
