"""Where each zoo parameter lives in a Hugging Face checkpoint, and how its layout differs.

A zoo model keeps one array per parameter, with the layers of a stack on a leading axis; a checkpoint keeps one
tensor per layer. An `Entry` ties a zoo parameter path to the HF key of each of its layers (`hf` is a template
with `{i}` for the HF layer index; `layers` lists those indices in stack order, or is None for an unstacked
parameter) and to the layout change between them:

- `n_in=None`: same layout (embeddings, norm scales).
- `n_in=k`: a projection. HF keeps `nn.Linear.weight` as [out, in] with heads flattened; the zoo keeps an einsum
  kernel with its k input axes first, heads unflattened: zoo = weight.T.reshape(zoo_shape).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Entry:
    path: tuple[str, ...]             # zoo parameter path in nnx.state(model)
    hf: str                           # HF key, with "{i}" for the layer index when `layers` is set
    n_in: int | None = None           # None: same layout; k: projection with k input axes
    layers: tuple[int, ...] | None = None

    def keys(self) -> list[str]:
        return [self.hf] if self.layers is None else [self.hf.format(i=i) for i in self.layers]

    def hf_shape(self, zoo_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one HF tensor for a zoo parameter of `zoo_shape` (stacked: with its layer axis)."""
        shape = zoo_shape[1:] if self.layers is not None else zoo_shape
        if self.n_in is None:
            return tuple(shape)
        return (math.prod(shape[self.n_in:]), math.prod(shape[:self.n_in]))

    def to_zoo(self, tensor: np.ndarray, zoo_layer_shape: tuple[int, ...]) -> np.ndarray:
        return tensor if self.n_in is None else tensor.T.reshape(zoo_layer_shape)

    def to_hf(self, array: np.ndarray) -> np.ndarray:
        if self.n_in is None:
            return array
        return np.ascontiguousarray(
            array.reshape(math.prod(array.shape[:self.n_in]), math.prod(array.shape[self.n_in:])).T)


def stacked(prefix: tuple[str, ...], hf_prefix: str, layers: range | tuple[int, ...],
            table: list[tuple[str, str, int | None]]) -> list[Entry]:
    """Entries of one scanned stack: `table` rows are (zoo path below the layer, HF key below the layer, n_in)."""
    return [Entry(prefix + tuple(zoo.split(".")), f"{hf_prefix}.{{i}}.{hf}", n_in, tuple(layers))
            for zoo, hf, n_in in table]


# -- Llama --------------------------------------------------------------------------------------------------

LLAMA_LAYER = [
    ("attn.q_proj.kernel", "self_attn.q_proj.weight", 1),
    ("attn.k_proj.kernel", "self_attn.k_proj.weight", 1),
    ("attn.v_proj.kernel", "self_attn.v_proj.weight", 1),
    ("attn.o_proj.kernel", "self_attn.o_proj.weight", 2),
    ("attn_norm.scale", "input_layernorm.weight", None),
    ("mlp_norm.scale", "post_attention_layernorm.weight", None),
    ("mlp.gate_proj.kernel", "mlp.gate_proj.weight", 1),
    ("mlp.up_proj.kernel", "mlp.up_proj.weight", 1),
    ("mlp.down_proj.kernel", "mlp.down_proj.weight", 1),
]


def embed_and_head(cfg) -> list[Entry]:
    out = [Entry(("embed", "embedding"), "model.embed_tokens.weight"), Entry(("norm", "scale"), "model.norm.weight")]
    if not cfg.tie_embeddings:
        out.append(Entry(("lm_head", "proj", "kernel"), "lm_head.weight", n_in=1))
    return out


def llama(cfg) -> list[Entry]:
    return embed_and_head(cfg) + stacked(("layers", "layers"), "model.layers", range(cfg.num_layers), LLAMA_LAYER)


# Keys a checkpoint may carry that hold no parameter (buffers saved by old transformers versions).
def is_buffer(key: str) -> bool:
    return key.endswith("rotary_emb.inv_freq")
