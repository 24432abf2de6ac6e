"""The causal attention kernel, with its residuals named: which kernel runs, and what its backward pass reads.

Besides q, k and v, the backward reads the kernel's output and softmax statistics, named here inside a `jax.custom_vjp`
as ``attention_out`` [B, S, H, dv] and ``context`` [B, H, S] float32: a recipe that keeps both runs no attention forward
in the backward pass (one without the other saves nothing; `zoo.recipe` refuses it). Two kernels, chosen per device
(`choose_impl`): ``cudnn`` and ``xla`` (`zoo.layers.xla_attention`). The planner counts attention's FLOPs from its
shapes (`attention_flops`). What cuDNN takes: docs/internals.md, "The attention kernel".
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

from zoo.layers import xla_attention
from zoo.sharding import BSH
from zoo.tags import name

Implementation = Literal["xla", "cudnn"] | None
IMPLEMENTATIONS = (None, "xla", "cudnn")
_CUDNN_DTYPES = ("bfloat16", "float16")
# The name scope of the kernel's own computation (forward and backward): jaxpr FLOP counts skip it, and the planner
# counts attention from its shapes instead (a cuDNN custom call has no matmul in the jaxpr to count).
SCOPE = "zoo_attention_kernel"
# The softmax statistics' logical axes (per query head and position), for a sharding constraint at the tag site.
STATS_AXES = ("batch", "heads", "seq")


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """Which attention kernel a layer runs, and why (what `choose_impl` returns; `str()` gives both).

    Args:
        impl: "xla" or "cudnn".
        reason: why (asked for, or what "auto" found on the device).

    Examples:
        >>> from zoo.layers.attention_kernel import choose_impl
        >>> str(choose_impl("xla", dtype="float32", head_dim=64))
        'xla (asked for)'
    """
    impl: str          # "xla" or "cudnn": what runs
    reason: str

    def __str__(self) -> str:
        return f"{self.impl} ({self.reason})"


def _cudnn_refusal(dtype, head_dim: int, device: jax.Device) -> str | None:
    """None if cuDNN flash attention takes this case on `device`, else why not."""
    if device.platform != "gpu" or "cuda" not in str(getattr(device.client, "platform_version", "")).lower():
        return f"cuDNN runs only on NVIDIA GPUs, and the device is {device.platform} ({device.device_kind})"
    if jnp.dtype(dtype).name not in _CUDNN_DTYPES:
        return f"cuDNN flash attention takes bf16/fp16, and the activations are {jnp.dtype(dtype).name}"
    cc = str(getattr(device, "compute_capability", "0"))
    limit = 256 if float(cc or 0) >= 9.0 else 128
    if head_dim % 8 or head_dim > limit:
        return (f"cuDNN flash attention takes head dims that are multiples of 8 up to {limit} on compute "
                f"capability {cc}, and the kernel's head dim is {head_dim}")
    return None


def choose_impl(requested: Implementation, *, dtype, head_dim: int,
                device: jax.Device | None = None) -> AttentionChoice:
    """Which attention runs for `requested` (None: auto) with activations of `dtype` and the kernel's `head_dim`
    on `device` (default: the first device). Layers call it once, when they are built.

    An explicit "cudnn" that cuDNN cannot take is a ValueError; auto on a GPU that cannot use cuDNN warns that the
    XLA kernel runs (slower than cuDNN's; its residuals are still linear in the sequence length)."""
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be one of {IMPLEMENTATIONS}, got {requested!r}")
    device = device or jax.devices()[0]
    if requested == "xla":
        return AttentionChoice("xla", "asked for")
    refusal = _cudnn_refusal(dtype, head_dim, device)
    if requested == "cudnn":
        if refusal:
            raise ValueError(f"attention_impl='cudnn' cannot run here: {refusal}. Use attention_impl=None (auto) "
                             f"or 'xla'")
        return AttentionChoice("cudnn", "asked for")
    if refusal is None:
        return AttentionChoice("cudnn", f"auto: cuDNN flash attention on {device.device_kind}")
    if device.platform == "gpu":
        warnings.warn(f"attention: the XLA kernel on {device.device_kind} (slower than cuDNN flash attention; its "
                      f"[B, H, S, S] logits are temporaries of each pass, never saved), because {refusal}",
                      stacklevel=2)
        return AttentionChoice("xla", f"auto, XLA kernel: {refusal}")
    return AttentionChoice("xla", f"auto on {device.platform}")


def resolve_impl(cfg, device: jax.Device | None = None) -> AttentionChoice:
    """The attention a model built from `cfg` (its attention_impl, dtype and kernel head dim, from the config's
    `attention_head_dim()`) runs on `device`. An impossible explicit choice is a ValueError naming why."""
    return choose_impl(cfg.attention_impl, dtype=jnp.dtype(cfg.dtype), head_dim=cfg.attention_head_dim(),
                       device=device)


def causal_attention_flops(batch: int, seq: int, heads: int, dq: int, dv: int) -> int:
    """Forward FLOPs of causal attention: the logits (2 B H S^2 dq) and the weighted values (2 B H S^2 dv), half of
    each under the causal mask. The planner's count (`attention_flops`) and the families' FLOPs per token are this."""
    return batch * heads * seq * seq * (dq + dv)


def attention_flops(q: jax.ShapeDtypeStruct, v: jax.ShapeDtypeStruct) -> int:
    """`causal_attention_flops` of queries q [B, S, H, dq] and values v [B, S, Hkv, dv]."""
    b, s, h, dq = q.shape
    return causal_attention_flops(b, s, h, dq, v.shape[-1])


def _pad_last(x: jax.Array, size: int) -> jax.Array:
    pad = size - x.shape[-1]
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad > 0 else x


def _stats_axes(leaf: jax.Array, q: jax.Array) -> tuple[str | None, ...]:
    """Logical axes of a softmax-statistics array: batch first, then heads and seq where their sizes match."""
    b, s, h, _ = q.shape
    axes: list[str | None] = ["batch"]
    for size in leaf.shape[1:]:
        label = "heads" if size == h and "heads" not in axes else "seq" if size == s and "seq" not in axes else None
        axes.append(label)
    return tuple(axes)


def _cudnn_attend(q, k, v, scale):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="cudnn")


def _vjp_with_residuals(q, k, v, scale, attend=_cudnn_attend):
    """A kernel with a VJP of its own (cuDNN's) as (out, residuals, backward(residuals, g) -> (dq, dk, dv)): its
    forward through `jax.vjp`, the residual leaves that are not q, k, v named (its output attention_out, the other
    one context), handed back to its own backward. Values are zero-padded to q's head dim (exact) for the kernel."""
    dv, d = v.shape[-1], q.shape[-1]
    vp = _pad_last(v, d)
    with jax.named_scope(SCOPE):
        out_p, vjp_fn = jax.vjp(lambda q, k, vp: attend(q, k, vp, scale), q, k, vp)
    leaves, tree = jax.tree.flatten(vjp_fn)
    out = name(out_p[..., :dv], "attention_out", BSH)
    kinds, stats, empty = [], [], []
    for leaf in leaves:
        position = next((i for i, x in enumerate((q, k, vp)) if leaf is x), None)
        if position is not None:
            kinds.append(("input", position))
        elif leaf is out_p or (leaf.shape == out_p.shape and leaf.dtype == out_p.dtype):
            kinds.append(("out", None))   # the kernel's output, as its backward reads it
        elif not getattr(leaf, "size", 1):   # cuDNN's placeholders for an absent bias or lengths: zeros(0)
            kinds.append(("empty", len(empty)))
            empty.append(leaf)
        else:
            kinds.append(("stats", len(stats)))
            stats.append(name(leaf, "context", _stats_axes(leaf, q)))
    if len(stats) != 1:
        raise ValueError(f"the attention kernel's backward reads {len(stats)} residuals beside q, k, v and its "
                         f"output ({[(x.shape, str(x.dtype)) for x in stats]}; expected one: the softmax "
                         f"statistics); the zoo cannot name them as one tag")

    def backward(res, g):
        q, k, v, out, stats, empty = res
        vp, outp = _pad_last(v, d), _pad_last(out, d)
        inputs = (q, k, vp)
        pick = {"input": lambda i: inputs[i], "out": lambda i: outp, "stats": lambda i: stats[i],
                "empty": lambda i: empty[i]}
        rebuilt = [pick[kind](i) for kind, i in kinds]
        with jax.named_scope(SCOPE):
            dq, dk, dvp = jax.tree.unflatten(tree, rebuilt)(_pad_last(g, d))
        return dq, dk, dvp[..., :dv]

    return out, (q, k, v, out, tuple(stats), tuple(empty)), backward


def _xla_with_residuals(q, k, v, scale):
    with jax.named_scope(SCOPE):
        out, lse = xla_attention.forward(q, k, v, scale)
    out = name(out, "attention_out", BSH)
    lse = name(lse, "context", STATS_AXES)

    def backward(res, g):
        q, k, v, out, lse = res
        with jax.named_scope(SCOPE):
            return xla_attention.backward(q, k, v, out, lse, g, scale)

    return out, (q, k, v, out, lse), backward


_KERNELS = {"cudnn": _vjp_with_residuals, "xla": _xla_with_residuals}


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str | None = None,
                     scale: float | None = None) -> jax.Array:
    """Causal scaled dot-product attention, softmax(q k^T * scale + causal mask) v, with grouped-query heads (each of
    the Hkv key/value heads serves H / Hkv query heads; Ainslie et al., 2023).

    Args:
        q: [B, S, H, dq].
        k: [B, S, Hkv, dq] (Hkv divides H).
        v: [B, S, Hkv, dv].
        impl: the kernel, "xla" or "cudnn" (the zoo's layers pass what `choose_impl` chose when they were built;
            None chooses for the first device now).
        scale: the softmax scale (default dq ** -0.5).

    Returns:
        [B, S, H, dv] in q's dtype.

    Emits:
        `attention_out` (the output) and `context` (the float32 softmax statistics [B, H, S]), inside a
        `jax.custom_vjp`: what the backward pass reads besides q, k and v.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers import causal_attention
        >>> q = jnp.ones((1, 4, 2, 8))
        >>> causal_attention(q, q[:, :, :1], q[:, :, :1], impl="xla").shape
        (1, 4, 2, 8)
    """
    if impl is None:
        impl = choose_impl(None, dtype=q.dtype, head_dim=max(q.shape[-1], v.shape[-1])).impl
    if impl not in _KERNELS:
        raise ValueError(f"causal_attention: impl must be 'xla' or 'cudnn' (see choose_impl), got {impl!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernel = _KERNELS[impl]
    backward_of = {}

    def forward(q, k, v):
        out, res, backward = kernel(q, k, v, scale)
        backward_of["rule"] = backward   # static structure, traced with the forward rule
        return out, res

    @jax.custom_vjp
    def attend(q, k, v):
        # The primal also runs the forward rule, so an abstract trace (zoo.emitted) sees both names.
        return kernel(q, k, v, scale)[0]

    attend.defvjp(forward, lambda res, g: backward_of["rule"](res, g))
    return attend(q, k, v)
