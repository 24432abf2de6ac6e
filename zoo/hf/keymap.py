"""Where each zoo parameter lives in a Hugging Face checkpoint, and how its layout differs: an `Entry` ties a zoo
variable path (a stack's layers on a leading axis, routed experts on the next) to the checkpoint's per-layer, per-expert
tensors (`hf` key template, `layers`, `experts`; `n_in=k`: a projection, HF's [out, in] weight transposed and reshaped).
A `copy` entry is a second tensor of a shared parameter, checked equal on load and written on save.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator

import numpy as np


@dataclasses.dataclass(frozen=True)
class Entry:
    path: tuple[str, ...]             # zoo variable path in nnx.state(model)
    hf: str                           # HF key, with "{i}" (layer) and "{e}" (expert) where stacked
    n_in: int | None = None           # None: same layout; k: projection with k input axes
    layers: tuple[int, ...] | None = None
    experts: int | None = None
    copy: bool = False                # another tensor of a parameter that has its own (not a copy) entry

    @property
    def depth(self) -> int:
        """Leading zoo axes that index HF tensors (layers, experts)."""
        return (self.layers is not None) + (self.experts is not None)

    def tensors(self) -> Iterator[tuple[tuple[int, ...], str]]:
        """(index of the slice in the zoo array, HF key) for every HF tensor of this parameter, in order."""
        if self.layers is None:
            yield (), self.hf
            return
        experts = range(self.experts) if self.experts is not None else [None]
        for (pos, i), e in itertools.product(enumerate(self.layers), experts):
            yield ((pos,) if e is None else (pos, e)), self.hf.format(i=i, e=e)

    def keys(self) -> list[str]:
        return [k for _, k in self.tensors()]

    def hf_shape(self, zoo_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one HF tensor for a zoo parameter of `zoo_shape` (with its layer / expert axes)."""
        shape = zoo_shape[self.depth:]
        if self.n_in is None:
            return tuple(shape)
        return (math.prod(shape[self.n_in:]), math.prod(shape[:self.n_in]))

    def to_zoo(self, tensor: np.ndarray, slice_shape: tuple[int, ...]) -> np.ndarray:
        return tensor if self.n_in is None else tensor.T.reshape(slice_shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        if self.n_in is None:
            return array
        return np.ascontiguousarray(
            array.reshape(math.prod(array.shape[:self.n_in]), math.prod(array.shape[self.n_in:])).T)


def stacked(prefix: tuple[str, ...], layers: range | tuple[int, ...],
            table: list[tuple[str, str, int | None]], experts: int | None = None) -> list[Entry]:
    """Entries of one scanned stack: `table` rows are (zoo path below the layer, HF key below
    `model.layers.{i}.`, n_in). Rows whose HF key holds "{e}" are per expert."""
    return [Entry(prefix + tuple(zoo.split(".")), f"model.layers.{{i}}.{hf}", n_in, tuple(layers),
                  experts if "{e}" in hf else None)
            for zoo, hf, n_in in table]


def embed_and_head(cfg) -> list[Entry]:
    out = [Entry(("embed", "embedding"), "model.embed_tokens.weight"), Entry(("norm", "scale"), "model.norm.weight")]
    if not cfg.tie_embeddings:
        out.append(Entry(("lm_head", "proj", "kernel"), "lm_head.weight", n_in=1))
    return out


def is_buffer(key: str) -> bool:
    """Keys a checkpoint may carry that hold no parameter (RoPE buffers saved by old transformers versions)."""
    return key.endswith("rotary_emb.inv_freq")


# Rows of the shared layers (zoo path below the layer, HF key below `model.layers.{i}.`, n_in): a pre-norm
# decoder's two norms, the SwiGLU MLP (zoo.layers.mlp), grouped-query attention (zoo.layers.attention).
NORMS = [("attn_norm.scale", "input_layernorm.weight", None),
         ("mlp_norm.scale", "post_attention_layernorm.weight", None)]
SWIGLU = [("mlp.gate_proj.kernel", "mlp.gate_proj.weight", 1),
          ("mlp.up_proj.kernel", "mlp.up_proj.weight", 1),
          ("mlp.down_proj.kernel", "mlp.down_proj.weight", 1)]
GQA = [("attn.q_proj.kernel", "self_attn.q_proj.weight", 1),
       ("attn.k_proj.kernel", "self_attn.k_proj.weight", 1),
       ("attn.v_proj.kernel", "self_attn.v_proj.weight", 1),
       ("attn.o_proj.kernel", "self_attn.o_proj.weight", 2)]
# the MoE layer's router and routed experts (zoo.layers.moe), one HF tensor per expert
ROUTED_EXPERTS = [("mlp.gate.kernel", "mlp.gate.weight", 1),
                  ("mlp.experts.gate_proj", "mlp.experts.{e}.gate_proj.weight", 1),
                  ("mlp.experts.up_proj", "mlp.experts.{e}.up_proj.weight", 1),
                  ("mlp.experts.down_proj", "mlp.experts.{e}.down_proj.weight", 1)]
