"""Grouped-query attention (Ainslie et al., 2023) as in Llama 3.1.

x -> q [B,S,H,d], k and v [B,S,Hkv,d]; optionally (`qk_norm_eps`, Qwen3) an RMSNorm over each head of q and of k;
RoPE on q and k; causal softmax attention through `jax.nn.dot_product_attention`; output projection.
Tags: query_proj, key_proj (after the norm and RoPE), value_proj, attention_out, out_proj.

The attention kernel is chosen per device (`choose_impl`; `resolve_impl(cfg)` for a model config;
`attention_impls(model)` for a built model). `implementation=None` (the default) means: cuDNN flash attention on an
NVIDIA GPU when cuDNN takes the case, XLA elsewhere. XLA's attention materialises the [B, H, S, S] logits (memory
quadratic in the sequence), so a GPU run that falls back to it warns, naming why. An explicit "xla" or "cudnn"
wins; "cudnn" where cuDNN cannot run is a ValueError, before anything compiles.

What cuDNN takes through `jax.nn.dot_product_attention` (jax 0.10-0.11, `jax._src.cudnn.fused_attention_stablehlo`
`check_layout` / `check_is_flash_attention`): q, k, v in bf16 or fp16 (fp8 has its own path); one head dim for q,
k and v (the public API checks value's shape against key's); head dim a multiple of 8 and at most 256 on Hopper
and later (compute capability >= 9.0), at most 128 before. cuDNN's own kernel also runs a smaller value head dim
("mla", cuDNN >= 9.10 on Hopper), but only through the private `fused_attention_stablehlo.dot_product_attention`;
the zoo's MLA pads its values 128 -> 192 instead (exact; 192 <= 256), so DeepSeek-V3 runs cuDNN flash attention
on an H100/H200. Before Hopper (head dim 192 > 128) the fallback is XLA, with the warning.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.linear import projection
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import Rope
from zoo.layers.tagged import TaggedLayer
from zoo.sharding import BSD, BSH, BSK
from zoo.tags import name

Implementation = Literal["xla", "cudnn"] | None
IMPLEMENTATIONS = (None, "xla", "cudnn")
_CUDNN_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
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


_warned: set[str] = set()


def choose_impl(requested: Implementation, *, dtype, head_dim: int,
                device: jax.Device | None = None) -> AttentionChoice:
    """Which attention runs for `requested` (None: auto) with activations of `dtype` and the kernel's `head_dim`.

    An explicit "cudnn" that cuDNN cannot take is a ValueError; auto on a GPU that cannot use cuDNN warns (once)
    that XLA's attention needs memory quadratic in the sequence length."""
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
        message = (f"attention: XLA's attention on {device.device_kind}, which holds [B, H, S, S] logits (memory "
                   f"quadratic in the sequence length), because {refusal}")
        if message not in _warned:
            _warned.add(message)
            warnings.warn(message, stacklevel=2)
        return AttentionChoice("xla", f"auto, QUADRATIC MEMORY: {refusal}")
    return AttentionChoice("xla", f"auto on {device.platform}")


def kernel_head_dim(cfg: Any) -> int:
    """The head dim the attention kernel sees for a model config (the config says: `attention_head_dim()`)."""
    return cfg.attention_head_dim()


def resolve_impl(cfg: Any, device: jax.Device | None = None) -> AttentionChoice:
    """The attention a model built from `cfg` (its attention_impl, dtype and head dims) runs on `device`.
    Call it before building: an impossible explicit choice is a ValueError naming why."""
    return choose_impl(cfg.attention_impl, dtype=jnp.dtype(cfg.dtype), head_dim=kernel_head_dim(cfg), device=device)


def attention_impls(model: nnx.Module) -> dict[str, AttentionChoice]:
    """{path of each attention layer in `model`: the implementation it runs on the first device}."""
    out = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and hasattr(module, "attention_choice"):
            out["/".join(map(str, path))] = module.attention_choice()
    return out


def causal_attention(q, k, v, *, scale: float | None = None, implementation: Implementation = None):
    """Causal attention over [B,S,H,d] queries and [B,S,Hkv,d] keys/values (Hkv divides H). `implementation`
    None chooses per device (`choose_impl`)."""
    impl = choose_impl(implementation, dtype=q.dtype, head_dim=q.shape[-1]).impl
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=impl)


def positions_for(x: jax.Array) -> jax.Array:
    """Positions 0..S-1 of a [B,S,...] input (training on packed, unpadded sequences)."""
    return jnp.arange(x.shape[1], dtype=jnp.int32)


class Attention(TaggedLayer):
    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: Rope,
                 dtype=jnp.float32, param_dtype=jnp.float32, implementation: Implementation = None,
                 qk_norm_eps: float | None = None, rngs: nnx.Rngs):
        self.dim, self.dtype = dim, dtype
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        q_axes, kv_axes = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
        self.q_proj = projection("bsd,dhk->bshk", (dim, num_heads, head_dim), q_axes, n_in=1, **common)
        self.k_proj = projection("bsd,dhk->bshk", (dim, num_kv_heads, head_dim), kv_axes, n_in=1, **common)
        self.v_proj = projection("bsd,dhk->bshk", (dim, num_kv_heads, head_dim), kv_axes, n_in=1, **common)
        self.o_proj = projection("bshk,hkd->bsd", (num_heads, head_dim, dim), ("heads", "head_dim", "embed"), n_in=2,
                                 **common)
        # Qwen3's per-head q/k RMSNorm (one scale of head_dim each, shared by the heads), before RoPE
        norm = dict(eps=qk_norm_eps, dtype=dtype, param_dtype=param_dtype, axis_name="head_dim")
        self.q_norm = None if qk_norm_eps is None else RMSNorm(head_dim, **norm)
        self.k_norm = None if qk_norm_eps is None else RMSNorm(head_dim, **norm)
        self.rope = rope
        self.head_dim = head_dim
        self.implementation = implementation

    def attention_choice(self, device: jax.Device | None = None) -> AttentionChoice:
        """The attention implementation this layer runs on `device` (default: the first device)."""
        return choose_impl(self.implementation, dtype=self.dtype, head_dim=self.head_dim, device=device)

    def __call__(self, x: jax.Array) -> jax.Array:
        pos = positions_for(x)
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = name(self.rope(q, pos), "query_proj", BSH)
        k = name(self.rope(k, pos), "key_proj", BSK)
        v = name(self.v_proj(x), "value_proj", BSK)
        out = name(causal_attention(q, k, v, implementation=self.implementation), "attention_out", BSH)
        return name(self.o_proj(out), "out_proj", BSD)
