"""A causal language model: embedding, one or more scanned decoder stacks under one recipe, norm, LM head, and
optionally extra prediction heads beside the LM head.

Family packages (zoo/models/<family>/) say what the layers are; this class stacks them and checks the recipe against
what the stacks emit. `model(tokens)` gives the logits; a training loss reads `model.hidden(tokens)` and
`model.head_function()` instead, to run the head over chunks (`zoo.loss.head_loss`). What an extra head provides:
docs/internals.md, "Extra heads".
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

# Tags are the same for any batch and length: the recipe check at build time traces this small shape (times the
# recipe's sequence tiles).
_CHECK_BATCH, _CHECK_SEQ = 1, 8


def extra_logits_key(name: str) -> str:
    """The aux key of extra head `name`'s logits in `model(tokens, return_aux=True)`."""
    return f"{name}_logits"


@dataclasses.dataclass(frozen=True)
class StackTags:
    """What one stack emits, read from a trace.

    Args:
        num_layers: the stack's layers.
        tags: per layer, {tag: shape and dtype}.
        tiled: the tags made inside sequence tiles (`zoo.layers.tiles`: kept in HBM tile by tile, or recomputed;
            never offloaded) or query tiles.
        query_tiled: the tags made one query tile at a time (`zoo.layers.query_tiles`: always recomputed).

    Examples:
        >>> import jax
        >>> from zoo.models import StackTags
        >>> StackTags(2, {"mlpwo": jax.ShapeDtypeStruct((1, 8, 64), "float32")}).num_layers
        2
    """
    num_layers: int
    tags: dict[str, jax.ShapeDtypeStruct]
    tiled: frozenset[str] = frozenset()
    query_tiled: frozenset[str] = frozenset()


class CausalLM(nnx.Module):
    """The decoder-only causal language model every family builds on: embedding -> stacks of decoder layers (each a
    scanned `Stack`, in order) -> RMSNorm -> LM head (tied to the embedding with `tie_embeddings`), every tag placed as
    `recipe` says. A family's model (`Llama`, `Qwen3`, ...) passes its stacks and extra heads.

    Args:
        cfg: the model's `LMConfig`.
        stacks: {a stack's attribute name: (make_layer(rngs), num_layers)}, in order.
        recipe: the placement of each tag (`zoo.Recipe`; None: `Recipe.none()`).
        rngs: the random generators of the parameters' initialization.
        extra_heads: {an extra head's attribute name: its builder make(rngs), or None where this config has none}.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.models import CausalLM, LlamaConfig, llama3
        >>> model = llama3(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> isinstance(model, CausalLM), model(jnp.zeros((2, 8), jnp.int32)).shape
        (True, (2, 8, 256))
    """

    def __init__(self, cfg: LMConfig, *, stacks: dict[str, tuple[Callable[[nnx.Rngs], nnx.Module], int]],
                 recipe: Recipe | None, rngs: nnx.Rngs,
                 extra_heads: dict[str, Callable[[nnx.Rngs], nnx.Module] | None] | None = None):
        if not isinstance(cfg, LMConfig):
            raise ValueError(f"{type(self).__name__} needs a zoo.models.LMConfig, got {type(cfg).__name__}")
        extra_heads = dict(extra_heads or {})
        taken = sorted(set(extra_heads) & (set(stacks) | {"config", "embed", "norm", "lm_head", "recipe"}))
        if taken:
            raise ValueError(f"{type(self).__name__}: extra head names {taken} are taken by stacks or the model")
        dtype, param_dtype = cfg.compute_dtype, cfg.weight_dtype
        self.config = cfg
        self.embed = Embed(vocab=cfg.vocab_size, dim=cfg.dim, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.stack_names = tuple(stacks)
        for stack_name, (make_layer, num_layers) in stacks.items():
            setattr(self, stack_name, Stack(make_layer, num_layers=num_layers, rngs=rngs))
        self.norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = None if cfg.tie_embeddings else LMHead(
            dim=cfg.dim, vocab=cfg.vocab_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.extra_head_names = tuple(n for n, make in extra_heads.items() if make is not None)
        for name, make in extra_heads.items():
            setattr(self, name, make(rngs) if make is not None else None)
        self._recipe = Recipe.none()
        self.set_recipe(recipe if recipe is not None else Recipe.none())

    # -- the recipe ---------------------------------------------------------------------------------------
    @property
    def recipe(self) -> Recipe:
        """The recipe the stacks apply: the model's one copy of it (each call hands its policy to every stack).
        A value: change it with `set_recipe`, which checks it first."""
        return self._recipe

    def set_recipe(self, recipe: Recipe) -> None:
        """Use `recipe` from now on (a static field of the model's graph: a jitted step traces again). ValueError if
        it names a tag (or pattern) that no stack emits; the model keeps its recipe then."""
        self.check_recipe(recipe)
        self._recipe = recipe

    def check_recipe(self, recipe: Recipe) -> None:
        """ValueError unless `recipe` is a Recipe naming only tags (or patterns) that some stack emits, whose `group`
        divides every scanned stack's layers, and that offloads no tag made inside sequence tiles."""
        if not isinstance(recipe, Recipe):
            raise ValueError(f"recipe must be a zoo.Recipe, got {type(recipe).__name__}")
        where = type(self).__name__
        query_tiles = self.config.attention_tiles
        shapes = self.tag_shapes(_CHECK_BATCH, _CHECK_SEQ * math.lcm(recipe.seq_tiles, query_tiles),
                                 tiles=recipe.seq_tiles)
        recipe.check_emitted({t for st in shapes.values() for t in st.tags}, where=where)
        for name in self.stack_names:
            getattr(self, name).check_group(recipe.group, f"{where}.{name}")
        resolved = recipe.resolve()
        offloaded = set(resolved.offload)
        tiled = sorted({t for st in shapes.values() for t in st.tiled - st.query_tiled} & offloaded)
        if tiled:
            raise ValueError(f"Recipe {recipe.name!r} offloads {tiled}, which seq_tiles={recipe.seq_tiles} makes "
                             f"inside sequence tiles: a tiled tag is kept in HBM (tile by tile) or recomputed, not "
                             f"offloaded (offload inside nested loops is known to break); keep it on the device, "
                             f"recompute it, or set seq_tiles=1")
        if query_tiles > 1:
            made = {t for st in shapes.values() for t in st.query_tiled}
            kept = sorted(made & set(resolved.offload + resolved.device + resolved.group_keep + resolved.lead))
            if kept:
                raise ValueError(f"Recipe {recipe.name!r} keeps or offloads {kept}, which attention_tiles="
                                 f"{query_tiles} makes one query tile at a time and recomputes tile by tile "
                                 f"(zoo.layers.query_tiles); leave them out of the recipe, or set attention_tiles=1")

    def stack_group(self, name: str, group: int) -> int:
        """Layers per rematerialized group of the stack `name` under a recipe's `group`: `group` for a main stack,
        1 for an extra head's (its layers run one at a time)."""
        return group if name in self.stack_names else 1

    def stacks(self) -> dict[str, Stack]:
        """Every stack: the main ones in order (`stack_names`), then each extra head's `layers` under its name."""
        out = {n: getattr(self, n) for n in self.stack_names}
        for name, head in self.extra_heads().items():
            if isinstance(getattr(head, "layers", None), Stack):
                out[name] = head.layers
        return out

    def extra_heads(self) -> dict[str, nnx.Module]:
        """{name: module} of the extra heads this model has (see the module docstring)."""
        return {n: getattr(self, n) for n in self.extra_head_names}

    def tag_shapes(self, batch: int, seq: int, tiles: int = 1) -> dict[str, StackTags]:
        """Per stack: layers and the {tag: shape} of one layer for a [batch, seq] input, its per-position parts in
        `tiles` sequence tiles (abstract trace)."""
        out = {}
        for n, s in self.stacks().items():
            x = s.abstract_input(batch, seq)
            in_query = s.tiled_tags(x, 1) if self.config.attention_tiles > 1 else frozenset()
            out[n] = StackTags(s.num_layers, s.tag_shapes(x, tiles), s.tiled_tags(x, tiles), in_query)
        return out

    # -- the forward pass ---------------------------------------------------------------------------------
    def __call__(self, tokens: jax.Array, *, return_aux: bool = False):
        """The next-token logits of `tokens`. On concrete values every id is checked against the vocabulary (ValueError
        naming the first bad one); under jit none can be, so check ids where they are made.

        Args:
            tokens: int [B, S] token ids.
            return_aux: also return {stack: aux stacked over its layers} (and each extra head's aux under its name and
                its logits under `extra_logits_key(name)`).

        Returns:
            logits [B, S, vocab]; with `return_aux`, (logits, aux).
        """
        if not return_aux:
            x, _, _, _ = self._trunk(tokens)
            return self.head(x)
        x, aux, extra = self.hidden(tokens)
        for name, hidden in extra.items():
            aux[extra_logits_key(name)] = jnp.stack([self.head(h) for h in hidden])
        return self.head(x), aux

    def hidden(self, tokens: jax.Array, *, extra: bool = True) -> tuple[jax.Array, dict[str, Any],
                                                                        dict[str, jax.Array]]:
        """(the normed final hidden states [B, S, dim] the LM head reads, {stack: aux} with each extra head's aux,
        {extra head: its hidden states [D, B, S, dim]}): what a training loss needs, without the logits. With
        `extra=False` the extra heads do not run (an evaluation's loss): `{}`."""
        x, embeddings, policy, aux = self._trunk(tokens)
        heads = {}
        for name, head in (self.extra_heads() if extra else {}).items():
            heads[name], aux[name] = head(x, embeddings, policy, tiles=self.recipe.seq_tiles)
        return x, aux, heads

    def _trunk(self, tokens):
        """(normed final hidden states, input embeddings, the recipe's policy, {stack: aux})."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        self.config.check_seq(tokens.shape[1])   # within max_seq_len: a static shape, checked when traced too
        embeddings = self.embed(tokens)
        x = embeddings
        r = self.recipe
        policy = r.policy()
        aux: dict[str, Any] = {}
        for stack_name in self.stack_names:
            x, aux[stack_name] = getattr(self, stack_name)(x, policy, group=r.group, tiles=r.seq_tiles,
                                                              layer_policy=r.layer_policy(), subgroup=r.subgroup,
                                                              lead_policy=r.lead_policy())
        return self.norm(x), embeddings, policy, aux

    def head(self, x: jax.Array) -> jax.Array:
        """Normed hidden states [B, S, dim] -> logits [B, S, vocab]: the LM head, or the embedding when tied."""
        return self.embed_attend(x) if self.lm_head is None else self.lm_head(x)

    def head_function(self) -> tuple[Callable[[Any, jax.Array], jax.Array], Any]:
        """(apply, weights): the LM head as a pure function of its parameters, `apply(weights, x) == head(x)`, and
        those parameters (the embedding's when tied): what a loss differentiates through (`zoo.loss.head_loss`)."""
        tied = self.lm_head is None
        graphdef, params, rest = nnx.split(self.embed if tied else self.lm_head, nnx.Param, ...)
        leaves, treedef = jax.tree.flatten(params)

        def apply(weights, x):
            module = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights), rest)
            return attend(module, x) if tied else module(x)
        return apply, leaves

    def embed_attend(self, x: jax.Array) -> jax.Array:
        return attend(self.embed, x)


def attend(embed: Embed, x: jax.Array) -> jax.Array:
    """The tied head: hidden states [B, S, dim] against the embedding table -> logits [B, S, vocab]."""
    return jnp.einsum("bsd,vd->bsv", x, embed.embedding[...].astype(x.dtype))


def shift_left(x: jax.Array, k: int) -> jax.Array:
    """x[:, i + k] at position i of a [B, S, ...] array; zeros where i + k >= S (what a head predicting k tokens
    further ahead embeds, and the targets and weights of its loss)."""
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
    """The number of parameters of `model`: every `nnx.Param`, and every `Stored` variable (e.g. a MoE router's
    bias), which the published checkpoints store though no gradient trains them. It reads shapes only, so an
    `nnx.eval_shape` model (nothing allocated) will do.

    Args:
        model: the module (a whole model or one layer).

    Returns:
        the count, an int.

    Examples:
        >>> from flax import nnx
        >>> from zoo.layers import MLP
        >>> from zoo.models import count_params
        >>> count_params(nnx.eval_shape(lambda: MLP(dim=8, hidden=16, rngs=nnx.Rngs(0))))   # 3 kernels of 8 x 16
        384
    """
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, (nnx.Param, Stored))))
