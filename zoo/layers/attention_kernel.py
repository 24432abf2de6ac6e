"""The causal attention kernel, with its residuals named: which kernel runs, and what its backward pass reads.

Besides q, k and v, the backward reads the kernel's output and softmax statistics, named here inside a `jax.custom_vjp`
as ``attention_out`` [B, S, H, dv] and ``context`` [B, H, S] float32: a recipe that keeps both runs no attention forward
in the backward pass (one without the other saves nothing; `zoo.recipe` refuses it). Three kernels (`choose_impl`):
``cudnn``, ``xla`` (`zoo.layers.xla_attention`), and ``mosaic_cudnn``: tokamax's Mosaic GPU forward with cuDNN's
backward, on Hopper, which auto takes on one device where tokamax is installed. The planner counts attention's FLOPs
from its shapes (`attention_flops`). What each takes: docs/internals.md, "The attention kernel".
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

import jax
import jax.numpy as jnp

from zoo import tags as tags_lib
from zoo.layers import xla_attention
from zoo.sharding import BSH
from zoo.tags import name

Implementation = Literal["xla", "cudnn", "mosaic_cudnn"] | None
IMPLEMENTATIONS = (None, "xla", "cudnn", "mosaic_cudnn")
# Head dims tokamax's Mosaic GPU attention forward takes here (its shared-memory tiles; MLA's 192 is left to cuDNN).
_MOSAIC_HEAD_DIMS = (64, 128)
_CUDNN_DTYPES = ("bfloat16", "float16")
# The name scope of the kernel's own computation (forward and backward): jaxpr FLOP counts skip it, and the planner
# counts attention from its shapes instead (a cuDNN custom call has no matmul in the jaxpr to count).
SCOPE = "zoo_attention_kernel"
FORWARD = "forward"   # the scope of a kernel's forward within SCOPE: each pass of it, once (the planner's tests count)
# The softmax statistics' logical axes (per query head and position), for a sharding constraint at the tag site.
STATS_AXES = ("batch", "heads", "seq")


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """Which attention kernel a layer runs, and why (what `choose_impl` returns; `str()` gives both).

    Args:
        impl: "xla", "cudnn" or "mosaic_cudnn".
        reason: why (asked for, or what "auto" found on the device).

    Examples:
        >>> from zoo.layers.attention_kernel import choose_impl
        >>> str(choose_impl("xla", dtype="float32", head_dim=64))
        'xla (asked for)'
    """
    impl: str          # "xla", "cudnn" or "mosaic_cudnn": what runs
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


def _mosaic_module():
    """tokamax's Mosaic GPU attention module (imported from its source path: `tokamax.ops.gpu` would also import its
    Triton kernels, which need jax_triton)."""
    from tokamax._src.ops.attention import pallas_mosaic_gpu
    return pallas_mosaic_gpu


def _mosaic_refusal(dtype, head_dim: int, device: jax.Device) -> str | None:
    """None if `mosaic_cudnn` (tokamax's Mosaic GPU forward, cuDNN's backward) takes this case on `device`."""
    refusal = _cudnn_refusal(dtype, head_dim, device)
    if refusal:
        return refusal
    cc = str(getattr(device, "compute_capability", ""))
    if cc != "9.0":
        return f"its forward is written for Hopper (compute capability 9.0), and the device's is {cc or 'unknown'}"
    if head_dim not in _MOSAIC_HEAD_DIMS:
        return f"its forward takes head dims {_MOSAIC_HEAD_DIMS}, and the kernel's head dim is {head_dim}"
    try:
        _mosaic_module()
    except ImportError as e:
        return f"tokamax is not installed ({e}; pip install tokamax)"
    return None


def choose_impl(requested: Implementation, *, dtype, head_dim: int,
                device: jax.Device | None = None) -> AttentionChoice:
    """Which attention runs for `requested` (None: auto) with activations of `dtype` and the kernel's `head_dim`
    on `device` (default: the first device). Layers call it once, when they are built.

    Auto takes "mosaic_cudnn" where it runs and the run has one device (its forward is not partitioned by XLA's
    sharding), else cuDNN's kernel on a GPU that can run it, else the XLA kernel. An explicit kernel
    that cannot run here is a ValueError naming why; auto on a GPU that cannot use cuDNN warns that the XLA kernel
    runs (slower than cuDNN's; its residuals are still linear in the sequence length).

    Args:
        requested: None (auto), "xla", "cudnn" or "mosaic_cudnn".
        dtype: the activations' dtype.
        head_dim: the kernel's head dim (the larger of the query's and the value's).
        device: the device it runs on (default: the first).

    Returns:
        the `AttentionChoice`.
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl must be one of {IMPLEMENTATIONS}, got {requested!r}")
    device = device or jax.devices()[0]
    if requested == "xla":
        return AttentionChoice("xla", "asked for")
    if requested == "mosaic_cudnn":
        refusal = _mosaic_refusal(dtype, head_dim, device)
        if refusal:
            raise ValueError(f"attention_impl='mosaic_cudnn' cannot run here: {refusal}. Use attention_impl=None "
                             f"(auto) or 'cudnn'")
        return AttentionChoice("mosaic_cudnn", "asked for")
    refusal = _cudnn_refusal(dtype, head_dim, device)
    if requested == "cudnn":
        if refusal:
            raise ValueError(f"attention_impl='cudnn' cannot run here: {refusal}. Use attention_impl=None (auto) "
                             f"or 'xla'")
        return AttentionChoice("cudnn", "asked for")
    if refusal is None:
        if jax.device_count() == 1 and _mosaic_refusal(dtype, head_dim, device) is None:
            return AttentionChoice("mosaic_cudnn", f"auto: tokamax's Mosaic GPU forward and cuDNN's backward on "
                                                   f"{device.device_kind}, one device")
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


def _cudnn_attend(q, k, v, scale, causal: bool = True, kv_len=None):
    lengths = None if kv_len is None else jnp.full((q.shape[0],), kv_len, jnp.int32)
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, key_value_seq_lengths=lengths,
                                        implementation="cudnn")


# The residuals of cuDNN attention, as jax defines them: `jax.nn.dot_product_attention(implementation="cudnn")` calls
# `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, whose `_dot_product_attention` is a custom_vjp;
# its forward rule, `_dot_product_attention_fwd_rule` (jax 0.10-0.12), saves
#     res = (query, key, value, bias, q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v,
#            activation, fwd_output)
# with activation = outputs[1], the softmax statistics (float32 [B, H, S]), and fwd_output = outputs[0], the output;
# a bias, length, offset or page table the call leaves out is one shared `zeros(0)` (`_not_used`). `jax.vjp`'s
# function holds them as its leaves in that order, that placeholder once.
CUDNN_INPUTS = ("query", "key", "value")
CUDNN_PLACEHOLDERS = ("bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k", "page_table_v")
CUDNN_SAVED = ("activation", "fwd_output")


def _same_array(leaf, x) -> bool:
    """The input itself (traced), or, outside a trace, an array of its shape and dtype."""
    return leaf is x or (getattr(leaf, "shape", None) == x.shape and getattr(leaf, "dtype", None) == x.dtype)


def _placeholder_or_length(leaf, batch: int) -> bool:
    """A left-out argument's zero-size placeholder, or a sequence-length array (int32 [B])."""
    shape = getattr(leaf, "shape", None)
    return getattr(leaf, "size", 1) == 0 or (shape == (batch,) and leaf.dtype == jnp.int32)


def _cudnn_roles(leaves, inputs, out) -> list[tuple[str, int | None]]:
    """Each residual leaf's role in cuDNN attention's residuals (above), by its position: ("input", i) for `inputs[i]`
    (q, k and the padded v), ("empty", j) for the placeholders (and sequence lengths, where given), then
    ("stats", 0) for `activation` and ("out", None) for `fwd_output`. ValueError where the leaves do not have that
    structure (the inputs the arrays given, the placeholders zero-size or int32 [B] lengths, `fwd_output` shaped as
    the kernel's output `out`)."""
    n, saved = len(inputs), len(CUDNN_SAVED)
    head, middle, tail = leaves[:n], leaves[n:len(leaves) - saved], leaves[n:][-saved:]
    if (len(leaves) < n + saved or len(middle) > len(CUDNN_PLACEHOLDERS)
            or not all(_same_array(leaf, x) for leaf, x in zip(head, inputs))
            or not all(_placeholder_or_length(leaf, inputs[0].shape[0]) for leaf in middle)
            or (tail[-1].shape, tail[-1].dtype) != (out.shape, out.dtype)):
        raise ValueError(f"the attention kernel's backward reads the residuals "
                         f"{[(x.shape, str(x.dtype)) for x in leaves]}, not cuDNN's "
                         f"{CUDNN_INPUTS + CUDNN_PLACEHOLDERS + CUDNN_SAVED} (placeholders zero-size, the last its "
                         f"output {out.shape} {out.dtype}); the zoo cannot name them as its tags")
    return [("input", i) for i in range(n)] + [("empty", j) for j in range(len(middle))] + [("stats", 0), ("out", None)]


def _vjp_with_residuals(q, k, v, scale, attend=_cudnn_attend):
    """A kernel with a VJP of its own (cuDNN's) as (out, residuals, backward(residuals, g) -> (dq, dk, dv)): its
    forward through `jax.vjp`, its residual leaves named by their role in cuDNN's (`_cudnn_roles`: its output
    attention_out, its softmax statistics context), handed back to its own backward. Values are zero-padded to q's
    head dim (exact) for the kernel."""
    dv, d = v.shape[-1], q.shape[-1]
    vp = _pad_last(v, d)
    with jax.named_scope(SCOPE), jax.named_scope(FORWARD):
        out_p, vjp_fn = jax.vjp(lambda q, k, vp: attend(q, k, vp, scale), q, k, vp)
    leaves, tree = jax.tree.flatten(vjp_fn)
    out = name(out_p[..., :dv], "attention_out", BSH)
    kinds = _cudnn_roles(leaves, (q, k, vp), out_p)
    empty = [leaf for leaf, (kind, _) in zip(leaves, kinds) if kind == "empty"]
    stats = [name(leaf, "context", _stats_axes(leaf, q)) for leaf, (kind, _) in zip(leaves, kinds) if kind == "stats"]

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


def _mosaic_cudnn_with_residuals(q, k, v, scale):
    """tokamax's Mosaic GPU forward, cuDNN's backward, as (out, residuals, backward): the forward's softmax residuals
    (the row max m and sum l) become cuDNN's statistics, the log-sum-exp m + log l, named ``context``; the backward
    traces cuDNN's own VJP (whose forward XLA then drops, its outputs unused) and hands it the Mosaic forward's output
    and statistics in place of its own (`_cudnn_roles`)."""
    dv, d = v.shape[-1], q.shape[-1]
    vp = _pad_last(v, d)
    with jax.named_scope(SCOPE), jax.named_scope(FORWARD):
        out_p, lse = _mosaic_forward(q, k, vp, scale, True)
    out = name(out_p[..., :dv], "attention_out", BSH)
    stats = name(lse, "context", STATS_AXES)

    def backward(res, g):
        q, k, v, out, stats = res
        vp, outp = _pad_last(v, d), _pad_last(out, d)
        with jax.named_scope(SCOPE):
            dq, dk, dvp = _cudnn_backward_given(q, k, vp, outp, stats, _pad_last(g, d), scale)
        return dq, dk, dvp[..., :dv]

    return out, (q, k, v, out, stats), backward


def _cudnn_backward_given(q, k, v, out, stats, g, scale, causal: bool = True, kv_len=None):
    """cuDNN's backward of attention over (q, k, v) for the cotangent g, handed `out` and `stats` (the log-sum-exp
    [B, H, Sq]) in place of its own forward's: it traces cuDNN's VJP, whose forward XLA then drops (its outputs
    unused), and swaps those two residuals (`_cudnn_roles`)."""
    _, vjp_fn = jax.vjp(lambda q, k, v: _cudnn_attend(q, k, v, scale, causal, kv_len), q, k, v)
    leaves, tree = jax.tree.flatten(vjp_fn)
    kinds = _cudnn_roles(leaves, (q, k, v), out)
    given = {"stats": lambda x: stats.reshape(x.shape).astype(x.dtype), "out": lambda x: out}
    leaves = [given.get(kind, lambda x: x)(x) for x, (kind, _) in zip(leaves, kinds)]
    return jax.tree.unflatten(tree, leaves)(g)


def _lse_shape(q: jax.Array) -> tuple[int, int, int]:
    b, s, h, _ = q.shape
    return (b, h, s)


def _cudnn_forward(q, k, v, scale, causal, kv_len=None):
    out, vjp_fn = jax.vjp(lambda q, k, v: _cudnn_attend(q, k, v, scale, causal, kv_len), q, k, v)
    leaves, _ = jax.tree.flatten(vjp_fn)
    stats = next(x for x, (kind, _) in zip(leaves, _cudnn_roles(leaves, (q, k, v), out)) if kind == "stats")
    return out, stats.reshape(_lse_shape(q)).astype(jnp.float32)


def _mosaic_forward(q, k, v, scale, causal, kv_len=None):
    """tokamax's Mosaic GPU forward: (out, lse), lse = the row max + log of the row sum (cuDNN's statistics). Given a
    key length (which it does not take), cuDNN's forward."""
    if kv_len is not None:
        return _cudnn_forward(q, k, v, scale, causal, kv_len)
    out, (row_max, row_sum) = _mosaic_module().PallasMosaicGpuFlashAttention()(
        q, k, v, is_causal=causal, logits_scale=scale, return_residuals=True)
    # one kernel run per call: behind a barrier XLA cannot run the kernel again where its outputs are read
    out, row_max, row_sum = jax.lax.optimization_barrier((out, row_max, row_sum))
    return out, (row_max + jnp.log(row_sum)).reshape(_lse_shape(q)).astype(jnp.float32)


# Each kernel's forward, (q, k, v, scale, causal, kv_len) -> (out, lse [B, H, Sq] float32), and its backward,
# (q, k, v, out, lse, g, scale, causal, kv_len) -> (dq, dk, dv) from a given output and log-sum-exp.
_PART_FORWARD = {"xla": xla_attention.forward, "cudnn": _cudnn_forward, "mosaic_cudnn": _mosaic_forward}
_PART_BACKWARD = {"xla": xla_attention.backward, "cudnn": _cudnn_backward_given, "mosaic_cudnn": _cudnn_backward_given}


def attention_part(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, scale: float, *, causal: bool,
                   kv_len: jax.Array | int | None = None) -> tuple[jax.Array, jax.Array]:
    """One kernel call with its statistics: (out [B, Sq, H, d], lse [B, H, Sq] float32) of softmax(q k^T * scale) v
    over keys [B, Sk, Hkv, d], causal (Sq = Sk) or over the first `kv_len` keys (None: all; a traced int32 may
    do: cuDNN's padding mask skips the rest). `impl`: "xla", "cudnn" or "mosaic_cudnn" (its Mosaic forward; cuDNN's
    given `kv_len`). The parts of a softmax split over key blocks merge by their log-sum-exps
    (`zoo.layers.tile_attention`); rows that see no key are not defined."""
    return _PART_FORWARD[impl](q, k, v, scale, causal, kv_len)


def attention_part_backward(impl: str, q, k, v, out, lse, g, scale: float, *, causal: bool, kv_len=None):
    """(dq, dk, dv) of one kernel call (`attention_part`) for the output cotangent g, given `out` and `lse` of the
    whole softmax this call's keys are a part of (FlashAttention's backward reads only those: p = exp(s - lse) and
    the rows' sum of g * out), so a softmax split over key blocks differentiates block by block. With `kv_len`, dk
    and dv past it are not defined."""
    return _PART_BACKWARD[impl](q, k, v, out, lse, g, scale, causal, kv_len)


def _xla_with_residuals(q, k, v, scale):
    with jax.named_scope(SCOPE), jax.named_scope(FORWARD):
        out, lse = xla_attention.forward(q, k, v, scale)
    out = name(out, "attention_out", BSH)
    lse = name(lse, "context", STATS_AXES)

    def backward(res, g):
        q, k, v, out, lse = res
        with jax.named_scope(SCOPE):
            return xla_attention.backward(q, k, v, out, lse, g, scale)

    return out, (q, k, v, out, lse), backward


_KERNELS = {"cudnn": _vjp_with_residuals, "xla": _xla_with_residuals, "mosaic_cudnn": _mosaic_cudnn_with_residuals}


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, impl: str | None = None,
                     scale: float | None = None) -> jax.Array:
    """Causal scaled dot-product attention, softmax(q k^T * scale + causal mask) v, with grouped-query heads (each of
    the Hkv key/value heads serves H / Hkv query heads; Ainslie et al., 2023).

    Args:
        q: [B, S, H, dq].
        k: [B, S, Hkv, dq] (Hkv divides H).
        v: [B, S, Hkv, dv].
        impl: the kernel, "xla", "cudnn" or "mosaic_cudnn" (the zoo's layers pass what `choose_impl` chose when
            they were built; None chooses for the first device now).
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
        raise ValueError(f"causal_attention: impl must be one of {tuple(_KERNELS)} (see choose_impl), got {impl!r}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    kernel = _KERNELS[impl]
    backward_of = {}
    role = tags_lib.current_role()   # JAX may trace the forward rule after the layer's trace has left its role

    def forward(q, k, v):
        with tags_lib.role(role):
            out, res, backward = kernel(q, k, v, scale)
        backward_of["rule"] = backward   # static structure, traced with the forward rule
        return out, res

    @jax.custom_vjp
    def attend(q, k, v):
        # The primal also runs the forward rule, so an abstract trace (zoo.emitted) sees both names.
        return kernel(q, k, v, scale)[0]

    attend.defvjp(forward, lambda res, g: backward_of["rule"](res, g))
    return attend(q, k, v)
