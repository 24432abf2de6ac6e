"""The tag vocabulary: one name per offloadable intermediate.

Every layer in the zoo passes the tensors a training step might keep, offload or recompute through
:func:`name`, which is `jax.ad_checkpoint.checkpoint_name` plus a check that the tag is in this closed
vocabulary. Names follow MaxText where MaxText has one, so a MaxText `custom` remat config carries over.

Shapes are never written down twice: :func:`emitted` traces a function abstractly (no FLOPs, no memory) and
reads the tags and their shapes off the jaxpr. The planner, the recipe check at model build and the tests
all use that.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zoo import logical


@dataclasses.dataclass(frozen=True)
class Tag:
    name: str
    shape: str  # symbolic, for people; the real shape comes from tracing a layer
    meaning: str


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


def vocabulary() -> str:
    """The vocabulary as text, for error messages and `--help`."""
    return ", ".join(NAMES)


def name(x: jax.Array, tag: str, axes: tuple[str | None, ...] | None = None) -> jax.Array:
    """Tag `x` as the intermediate `tag`: `checkpoint_name` restricted to the vocabulary.

    `axes`: the logical axis names of `x`. Under an active mesh and rules (`zoo.sharding.use`) a sharding constraint
    by those names comes first, so an offloaded residual keeps its sharding in host memory; a no-op otherwise."""
    if tag not in TAGS:
        raise ValueError(f"unknown tag {tag!r}; the vocabulary is: {vocabulary()}")
    if axes is not None:
        x = logical.constrain(x, axes)
    return checkpoint_name(x, tag)


def sub_jaxprs(params: dict[str, Any]):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


# Loops inside a layer. A loop is refused only when its body holds a tag or an offload: those are what a nested
# scan breaks (the policy's saves and host copies inside an inner loop). Any other loop, such as the scan inside
# tokamax's Mosaic GPU grouped-matmul kernel, is only computation and runs under any recipe.
_LOOPS = ("scan", "while")


def _is_host_target(target) -> bool:
    """A device_put destination in host memory: a memory space, a memory kind, or a sharding with one."""
    kind = getattr(target, "memory_kind", None) or getattr(target, "kind", None)
    text = str(kind if kind is not None else target).lower()
    return "host" in text


def _tag_or_offload(params: dict[str, Any]) -> str | None:
    """What in these sub-jaxprs (recursively) makes a loop unsafe: 'the tag X' or 'an offload to host'."""
    for sub in sub_jaxprs(params):
        for eqn in sub.eqns:
            if eqn.primitive.name == "name":
                return f"the tag {eqn.params['name']!r}"
            if eqn.primitive.name == "device_put" and any(_is_host_target(d) for d in eqn.params.get("devices", ())):
                return "an offload to host memory (device_put)"
            held = _tag_or_offload(eqn.params)
            if held:
                return held
    return None


def _collect(jaxpr, found: dict[str, jax.ShapeDtypeStruct], prefix: tuple[int, ...] = ()) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            aval = eqn.outvars[0].aval
            sds = jax.ShapeDtypeStruct(prefix + tuple(aval.shape), aval.dtype)
            tag = eqn.params["name"]
            if tag in found:
                sds = join_chunks(tag, found[tag], sds, len(prefix) + 1)
            found[tag] = sds
        elif eqn.primitive.name in _LOOPS:
            held = _tag_or_offload(eqn.params)
            if held:
                raise ValueError(f"a tagged layer contains a {eqn.primitive.name} whose body holds {held}: offload "
                                 f"inside nested scans is known to break; the zoo keeps tags and offloads at one "
                                 f"scan level (the layer stack). A loop without tags or offloads (a kernel's own, "
                                 f"e.g. tokamax's grouped matmul) is fine")
            # A loop holding no tag has none to collect: nothing to descend into.
        else:
            for sub in sub_jaxprs(eqn.params):
                _collect(sub, found, prefix)


def join_chunks(tag: str, a: jax.ShapeDtypeStruct, b: jax.ShapeDtypeStruct, axis: int) -> jax.ShapeDtypeStruct:
    """A tag emitted more than once in one layer names one tensor made in sequence chunks (e.g. `MLP(seq_chunks=n)`):
    the chunks must agree on everything but the sequence axis (axis 1 of [B, S, ...]), and the tag's shape is their
    concatenation. Anything else is two tensors under one name: a ValueError."""
    same = (a.dtype == b.dtype and len(a.shape) == len(b.shape) > axis
            and a.shape[:axis] + a.shape[axis + 1:] == b.shape[:axis] + b.shape[axis + 1:])
    if not same:
        raise ValueError(f"tag {tag!r} is emitted twice in one layer with shapes {a.shape} {a.dtype} and {b.shape} "
                         f"{b.dtype}; a tag names one tensor (sequence chunks of it differ only in the sequence axis)")
    return jax.ShapeDtypeStruct(a.shape[:axis] + (a.shape[axis] + b.shape[axis],) + a.shape[axis + 1:], a.dtype)


def emitted(fn: Callable[..., Any], *args: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """Trace `fn(*args)` abstractly and return {tag: shape and dtype} for every tag it emits, in order.

    `args` may be arrays or `jax.ShapeDtypeStruct`s; nothing is computed.
    """
    found: dict[str, jax.ShapeDtypeStruct] = {}
    _collect(jax.make_jaxpr(fn)(*args).jaxpr, found)
    return found


def emitted_by(module, x: jax.ShapeDtypeStruct) -> dict[str, jax.ShapeDtypeStruct]:
    """Tags emitted by an NNX module applied to an input of shape `x`, read from an abstract trace."""
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    return emitted(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
