"""A causal language model: embedding, one or more scanned decoder stacks under one recipe, norm, LM head, and
optionally a multi-token-prediction (MTP) module beside the head.

Family packages (zoo/models/<family>/) say what the layers are; this class says how they are stacked and checks
the recipe against what the stacks really emit, when the model is built.

The MTP module (a family's, e.g. `zoo.models.deepseek.mtp`) runs only for training outputs (`return_aux=True`):
its logits [depths, B, S, vocab] are `aux[MTP_LOGITS]` (depth k predicts the token k + 1 positions after the
next one: a loss function shifts the targets, `zoo.train_step.mtp_loss`), and its decoder layers are the stack
`MTP_STACK`, listed by `stacks()` like the others, so recipes, the planner and the routing-bias update cover it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.layers import Embed, LMHead, RMSNorm
from zoo.layers.linear import Stored
from zoo.models.config import LMConfig
from zoo.models.stack import Stack
from zoo.recipe import Recipe

# Tags are the same for any batch and length: the recipe check at build time traces this small shape.
_CHECK_BATCH, _CHECK_SEQ = 1, 8
# The aux keys of the multi-token-prediction module: its logits, and its stack (and the model attribute holding it).
MTP_LOGITS, MTP_STACK = "mtp_logits", "mtp"


@dataclasses.dataclass(frozen=True)
class StackTags:
    """What one stack emits: its number of layers and, per layer, {tag: shape and dtype}."""
    num_layers: int
    tags: dict[str, jax.ShapeDtypeStruct]


class CausalLM(nnx.Module):
    """Embedding -> stacks (in order) -> RMSNorm -> LM head. `stacks` maps a stack's attribute name to
    (make_layer, num_layers). `mtp(rngs)`, if given, builds the multi-token-prediction module: a module with a
    `Stack` named `layers`, called as `mtp(h, embeddings, head, policy) -> (logits [D, B, S, V], aux)` on the final
    normed hidden states and the input embeddings, with this model's head."""

    def __init__(self, cfg: LMConfig, *, stacks: dict[str, tuple[Callable[[nnx.Rngs], nnx.Module], int]],
                 recipe: Recipe | None, rngs: nnx.Rngs, mtp: Callable[[nnx.Rngs], nnx.Module] | None = None):
        if not isinstance(cfg, LMConfig):
            raise ValueError(f"{type(self).__name__} needs a zoo.models.LMConfig, got {type(cfg).__name__}")
        dtype, param_dtype = cfg.compute_dtype, cfg.weight_dtype
        self.config = cfg
        self.embed = Embed(vocab=cfg.vocab_size, dim=cfg.dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.stack_names = tuple(stacks)
        for stack_name, (make_layer, num_layers) in stacks.items():
            setattr(self, stack_name, Stack(make_layer, num_layers=num_layers, rngs=rngs))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = None if cfg.tie_embeddings else LMHead(
            dim=cfg.dim, vocab=cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mtp = mtp(rngs) if mtp is not None else None
        self.recipe = Recipe.none()
        self.set_recipe(recipe if recipe is not None else Recipe.none())

    # -- the recipe ---------------------------------------------------------------------------------------
    def set_recipe(self, recipe: Recipe) -> None:
        """Use `recipe` from now on. ValueError if it names a tag (or pattern) that no stack emits."""
        self.check_recipe(recipe)
        self.recipe = recipe

    def check_recipe(self, recipe: Recipe) -> None:
        """ValueError unless `recipe` is a Recipe naming only tags (or patterns) that some stack emits."""
        if not isinstance(recipe, Recipe):
            raise ValueError(f"recipe must be a zoo.Recipe, got {type(recipe).__name__}")
        emitted = {t for st in self.tag_shapes(_CHECK_BATCH, _CHECK_SEQ).values() for t in st.tags}
        recipe.check_emitted(emitted, where=type(self).__name__)

    def stacks(self) -> dict[str, Stack]:
        """Every stack: the main ones in order (`stack_names`), then the MTP module's (`MTP_STACK`) if any."""
        out = {n: getattr(self, n) for n in self.stack_names}
        if self.mtp is not None:
            out[MTP_STACK] = self.mtp.layers
        return out

    def tag_shapes(self, batch: int, seq: int) -> dict[str, StackTags]:
        """Per stack: layers and the {tag: shape} of one layer for a [batch, seq] input (abstract trace)."""
        return {n: StackTags(s.num_layers, s.tag_shapes(s.abstract_input(batch, seq)))
                for n, s in self.stacks().items()}

    # -- the forward pass ---------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, *, return_aux: bool = False):
        """int tokens [B, S] -> logits [B, S, vocab]; with return_aux, also {stack: aux stacked over layers} (and,
        with an MTP module, its logits under `MTP_LOGITS`).

        `tokens` may be any integer array-like (a nested Python list of ints becomes an int32 array). On concrete
        values (an eager call) every id is checked against the vocabulary: ValueError naming the first bad one.
        Under `jax.jit`/`nnx.jit` (tracers) no value check is possible and none is made: an id >= vocab_size then
        embeds as NaN (JAX's out-of-bounds gather fills), and a negative id counts from the end (-1 is the last
        row), silently. Check ids where they are made (the main job's data reader does)."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        embeddings = self.embed(tokens)
        x = embeddings
        policy = self.recipe.policy()
        aux: dict[str, Any] = {}
        for stack_name in self.stack_names:
            x, aux[stack_name] = getattr(self, stack_name)(x, policy)
        x = self.norm(x)
        logits = self.head(x)
        if not return_aux:
            return logits
        if self.mtp is not None:
            aux[MTP_LOGITS], aux[MTP_STACK] = self.mtp(x, embeddings, self.head, policy)
        return logits, aux

    def head(self, x: jax.Array) -> jax.Array:
        """Normed hidden states [B, S, dim] -> logits [B, S, vocab]: the LM head, or the embedding when tied."""
        return self.embed_attend(x) if self.lm_head is None else self.lm_head(x)

    def embed_attend(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("bsd,vd->bsv", x, self.embed.embedding[...].astype(x.dtype))


def shift_left(x: jax.Array, k: int) -> jax.Array:
    """x[:, i + k] at position i of a [B, S, ...] array; zeros where i + k >= S (what depth k of an MTP module
    embeds, and the targets and weights of its loss)."""
    pad = [(0, 0), (0, min(k, x.shape[1]))] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, k:], pad)


def check_tokens(tokens, vocab_size: int):
    """`tokens` as an integer [batch, seq] array; ValueError for another shape or dtype, or (concrete values only)
    an id outside [0, vocab_size)."""
    if not isinstance(tokens, (jax.Array, np.ndarray)):
        try:
            tokens = np.asarray(tokens)
        except (ValueError, TypeError) as e:
            raise ValueError(f"tokens must be an integer array [batch, seq]; {type(tokens).__name__} does not "
                             f"convert: {e}") from None
        if tokens.dtype.kind in "iu":
            tokens = tokens.astype(np.int32)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [batch, seq], got {tokens.dtype}{list(tokens.shape)}")
    # Concrete values only (a closed-over array inside someone's jit is concrete too), checked on the host with
    # NumPy: a jnp reduction here would itself be traced under an outer jit.
    if (not isinstance(tokens, jax.core.Tracer) and tokens.size
            and getattr(tokens, "is_fully_addressable", True)):
        ids = np.asarray(tokens)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            where = tuple(int(i) for i in np.argwhere(ids == bad)[0])
            raise ValueError(f"token id {bad} at {list(where)} is outside the vocabulary [0, {vocab_size})")
    return tokens


def non_embedding_params(model: CausalLM) -> int:
    """Parameters that take part in a matmul per token: all but the embedding table, which is a gather (it counts
    when it is also the LM head: tied)."""
    cfg = model.config
    return count_params(model) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)


def count_params(model: nnx.Module) -> int:
    """Number of parameters (works on `nnx.eval_shape` models: nothing is allocated): every `nnx.Param`, and every
    `Stored` variable (e.g. DeepSeek-V3's routing biases), which the published checkpoints store though no gradient
    trains them."""
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, (nnx.Param, Stored))))
