"""`LMConfig`: the fields `CausalLM` reads, checked once for every model config (each field against its type annotation,
`zoo.models.fields`, then the base's ranges, then the subclass's `check()`: a ValueError names the field); `MoEConfig`:
what a family with routed experts adds. Each family's config extends one of them.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from zoo import checks
from zoo.dtypes import DTYPES, dtype_of
from zoo.layers.attention_kernel import IMPLEMENTATIONS as ATTENTION_IMPLEMENTATIONS
from zoo.layers.moe import BACKENDS, EP_DISPATCHES, backend_choice, resolve_backend
from zoo.models.fields import check_field_names, check_non_negative, check_positive, check_positive_float, check_types
from zoo.names import did_you_mean


@dataclasses.dataclass(frozen=True, kw_only=True)
class LMConfig:
    """What every causal LM of the zoo has; `CausalLM` reads only these fields. A family's config extends it (or
    `MoEConfig`); every field is checked against its type and range when the config is made (a ValueError naming it).

    Args:
        vocab_size: the number of token ids.
        dim: the model width D.
        num_layers: the decoder layers.
        norm_eps: every RMSNorm's eps.
        tie_embeddings: whether the LM head shares the embedding table.
        dtype: the activations' dtype ("bfloat16", "float32", ...).
        param_dtype: the parameters' dtype.
        attention_impl: the attention kernel: None (chosen for the device: "mosaic_cudnn" on one Hopper device
            with tokamax installed, else cuDNN's where it runs, else XLA's), "xla", "cudnn", or "mosaic_cudnn"
            (tokamax's Mosaic GPU forward with cuDNN's backward: Hopper, head dim 64 or 128;
            `zoo.layers.attention_kernel.choose_impl`).
        mlp_seq_chunks: the dense MLP in this many sequence chunks (`zoo.layers.MLP`'s `seq_chunks`).
        attention_tiles: each layer's attention over this many tiles of queries, one at a time, each against the
            keys up to it (`zoo.layers.query_tiles`), so a layer's backward holds one tile's queries and outputs; it
            divides the sequence. 1: the whole sequence at once. Grouped-query attention only.
        max_seq_len: the longest sequence the model takes (a published context); None: any.

    Examples:
        >>> from zoo.models import LlamaConfig
        >>> cfg = LlamaConfig.preset("tiny", num_layers=1)
        >>> cfg.dim, cfg.num_layers
        (64, 1)
    """
    vocab_size: int
    dim: int
    num_layers: int
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "bfloat16"            # activations
    param_dtype: str = "float32"       # parameters
    attention_impl: str | None = None  # None: chosen for the device; "xla", "cudnn", "mosaic_cudnn"
    mlp_seq_chunks: int = 1            # the dense MLP in this many sequence chunks (zoo.layers.mlp: earlier copies)
    attention_tiles: int = 1           # attention over this many query tiles (zoo.layers.query_tiles)
    max_seq_len: int | None = None     # the longest sequence the model takes (a published context); None: any
    # {preset name: {field: value}}: the published sizes and a tiny one, as a table (a subclass sets its own)
    PRESETS: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    def __post_init__(self):
        check_types(self)
        check_positive(self, "vocab_size", "dim", "num_layers", "mlp_seq_chunks", "attention_tiles")
        if self.max_seq_len is not None:
            check_positive(self, "max_seq_len")
        check_positive_float(self, "norm_eps")
        dtype_of(f"{type(self).__name__}.dtype", self.dtype)
        dtype_of(f"{type(self).__name__}.param_dtype", self.param_dtype)
        if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"{type(self).__name__}.attention_impl must be one of {ATTENTION_IMPLEMENTATIONS}, "
                             f"got {self.attention_impl!r}")
        self.check()

    def check(self) -> None:
        """The model's own checks (ranges, divisibility), after the types and the base's fields."""

    def check_seq(self, seq: int) -> None:
        """ValueError unless `seq` is a positive int within `max_seq_len` (the positions the model was made for)."""
        checks.check_positive("the sequence length", seq, optional=False)
        if seq % self.attention_tiles:
            raise ValueError(f"{type(self).__name__}.attention_tiles={self.attention_tiles} does not divide the "
                             f"sequence length {seq}: attention runs over tiles of queries of equal length")
        if self.max_seq_len is not None and seq > self.max_seq_len:
            raise ValueError(f"sequence length {seq} is longer than {type(self).__name__}.max_seq_len="
                             f"{self.max_seq_len} (the context its positions were made for); raise it with "
                             f"max_seq_len=N (--set max_seq_len=N) to train longer")

    def attention_head_dim(self) -> int:
        """The head dim the attention kernel sees (it decides cuDNN's eligibility: zoo.layers.attention)."""
        raise NotImplementedError(f"{type(self).__name__} must say its attention kernel's head dim")

    def kernel_choices(self, device) -> dict[str, str]:
        """{kernel: what runs on `device` and why} beyond attention (e.g. a MoE's grouped matmul); ValueError for
        an explicit choice that cannot run there."""
        return {}

    def mesh_divisors(self) -> tuple[tuple[str, str], ...]:
        """(mesh axis, field) pairs: each field's value must be divisible by that axis's size
        (`zoo.sharding.check_mesh`). A model config adds its own before these."""
        return (("tp", "vocab_size"), ("fsdp", "dim"))

    def without_extra_heads(self):
        """This config with none of the model's extra heads (`zoo.models.lm`: trained beside the LM head, unused by
        inference; `from_hf(..., extra_heads=False)`)."""
        return self

    @property
    def compute_dtype(self):
        """The activations' dtype (`dtype`) as a jnp dtype."""
        return DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        """The parameters' dtype (`param_dtype`) as a jnp dtype."""
        return DTYPES[self.param_dtype]

    @classmethod
    def presets(cls) -> tuple[str, ...]:
        """The names of the family's published (and test) sizes: `--preset` takes these (`PRESETS`)."""
        return tuple(cls.PRESETS)

    @classmethod
    def preset(cls, name: str, **overrides):
        """The config of the size `name` (a key of the class's `PRESETS` table) with `overrides` replacing fields."""
        if name not in cls.PRESETS:
            raise ValueError(f"{name!r} is not a {cls.__name__} preset{did_you_mean(str(name), cls.PRESETS)}; choose "
                             f"one of: {', '.join(cls.PRESETS)}")
        check_field_names(cls, overrides)
        return cls(**{**cls.PRESETS[name], **overrides})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(LMConfig):
    """What a family with routed experts adds to `LMConfig` (`zoo.layers.moe`): the experts, how tokens reach them, the
    balance loss's weight. A subclass's `check()` calls this one's first.

    Args:
        num_experts: the routed experts E.
        num_experts_per_tok: the experts each token visits (k).
        moe_mlp_dim: each routed expert's hidden width.
        norm_topk_prob: whether the k chosen weights are renormalized to sum to one.
        moe_backend: "auto", "ragged_dot", "tokamax" or "capacity" (`zoo.layers.moe.backend`).
        capacity_factor: the capacity backend's rows per expert, as a multiple of an even share.
        ep_dispatch: "gather" or "ragged_a2a" (dropless expert parallelism under a mesh).
        balance_loss_weight: the router's balance loss weight (alpha).

    Examples:
        >>> from zoo.models import Qwen3MoeConfig
        >>> Qwen3MoeConfig.preset("tiny").num_experts_per_tok
        2
    """
    num_experts: int                   # routed experts
    num_experts_per_tok: int
    moe_mlp_dim: int                   # each routed expert's hidden size
    norm_topk_prob: bool = True        # the k chosen weights renormalised to sum to one
    moe_backend: str = "auto"          # "ragged_dot" | "tokamax" | "capacity" | "auto" (see zoo.layers.moe)
    capacity_factor: float = 1.25      # capacity dispatch only
    ep_dispatch: str = "gather"        # dropless backends under a mesh: "gather" | "ragged_a2a" (expert parallelism)
    balance_loss_weight: float = 1e-4  # the router's balance loss weight (alpha)

    def check(self) -> None:
        name = type(self).__name__
        check_positive(self, "num_experts", "num_experts_per_tok", "moe_mlp_dim")
        check_positive_float(self, "capacity_factor")
        check_non_negative(self, "balance_loss_weight")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{name}.num_experts_per_tok={self.num_experts_per_tok} must be at most "
                             f"num_experts={self.num_experts}")
        if self.moe_backend not in BACKENDS:
            raise ValueError(f"{name}.moe_backend must be one of {BACKENDS}, got {self.moe_backend!r}")
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"{name}.ep_dispatch must be one of {EP_DISPATCHES}, got {self.ep_dispatch!r}")
        try:
            resolve_backend(self.moe_backend, ep_dispatch=self.ep_dispatch)
        except ValueError as e:
            raise ValueError(f"{name}.moe_backend: {e}") from None

    def kernel_choices(self, device) -> dict[str, str]:
        name, why = backend_choice(self.moe_backend, dtype=self.compute_dtype, device=device,
                                   ep_dispatch=self.ep_dispatch)
        out = {"moe backend": f"{name} ({why})"}
        if self.ep_dispatch != "gather":
            out["ep dispatch"] = f"{self.ep_dispatch} (asked for)"
        return out

    def mesh_divisors(self) -> tuple[tuple[str, str], ...]:
        return (("tp", "moe_mlp_dim"), ("ep", "num_experts")) + super().mesh_divisors()
