"""A zoo model in a user's own step compiles the step once over many steps: for every family, under `none`, `full`
and the family's offloading recipe, in both NNX patterns (`nnx.jit` on the model and an `nnx.Optimizer`; and
`nnx.split(model, nnx.Param, ...)` around a `jax.jit` step with optax, as the Flax docs teach).

Counted over three steps: the executables XLA builds for them (backend compiles, and hits of the persistent
compilation cache the test run shares), through `jax.monitoring`. The step is the user's, written plainly: no
`jax.device_put` of the state, no shardings.

What JAX does, and why the offloading recipes need one placement: a step whose program moves values to host
memory (an offload) returns committed arrays even when every input was uncommitted, and an uncommitted input is
lowered without the placement a committed one carries. The first step's inputs are a freshly built model and
optimizer, uncommitted (optax's and nnx's step counters among them, which the zoo does not make); the second step's
are the first step's outputs, committed: a different program, compiled again. A recipe that offloads nothing leaves
the outputs uncommitted, so its second step reuses the first step's executable. Placing the state once
(`jax.device_put(state, jax.devices()[0])`, docs/own-loop.md) gives the first step the inputs every later step
gets. `test_a_plain_step_compiles_once` holds the offloading recipes as strict expected failures: when JAX stops
committing those outputs (or the zoo finds a way around it) they pass, fail as unexpected passes, and the
placement advice goes.
"""
from __future__ import annotations

import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zoo
from tests.helpers import executables
from zoo.models import registry

FAMILIES = ("llama3", "deepseek_v3", "qwen3", "qwen3_moe")
PATTERNS = ("nnx.jit", "jax.jit + split")


def recipe_of(family: str, which: str) -> zoo.Recipe:
    sets = importlib.import_module(f"recipes.{family}")
    return sets.RECIPES[sets.DEFAULT if which == "offload" else which]


def batches(cfg, n: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, cfg.vocab_size, size=(2, 9), dtype=np.int32) for _ in range(n)]


def loss_of(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:]).mean()


def nnx_steps(family: str, recipe: zoo.Recipe, place: bool) -> list[int]:
    """Pattern (a): `nnx.jit` over the model and an `nnx.Optimizer`, updated in place."""
    cfg = registry.family(family).config("tiny")
    model = registry.family(family).build(cfg, recipe=recipe, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    if place:
        nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), jax.devices()[0]))

    @nnx.jit
    def step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_of)(model, tokens)
        optimizer.update(model, grads)
        return loss

    counts = []
    for tokens in batches(cfg):
        with executables() as seen:
            float(step(model, optimizer, tokens))
        counts.append(len(seen))
    return counts


def functional_steps(family: str, recipe: zoo.Recipe, place: bool) -> list[int]:
    """Pattern (b): `nnx.split(model, nnx.Param, ...)`, merged inside `jax.value_and_grad` under `jax.jit`."""
    cfg = registry.family(family).config("tiny")
    graphdef, params, rest = nnx.split(registry.family(family).build(cfg, recipe=recipe, rngs=nnx.Rngs(0)),
                                       nnx.Param, ...)
    tx = optax.adamw(1e-3)
    state = (params, rest, tx.init(params))
    if place:
        state = jax.device_put(state, jax.devices()[0])

    @jax.jit
    def step(params, rest, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: loss_of(nnx.merge(graphdef, p, rest), tokens))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    counts = []
    for tokens in batches(cfg):
        with executables() as seen:
            *state, loss = step(*state, tokens)
            float(loss)
        counts.append(len(seen))
    return counts


def steps(family: str, which: str, pattern: str, place: bool) -> list[int]:
    run = nnx_steps if pattern == "nnx.jit" else functional_steps
    return run(family, recipe_of(family, which), place)


# One case of each kind by default (plain: a recipe that offloads nothing, an offloading one; placed: an offloading
# one, whose program the plain offloading case's second step compiled); the rest of the grid is in the slow set
# (tests/test_examples.py runs DeepSeek-V3's placed state in both patterns by default).
DEFAULT = {False: {("llama3", "full", "jax.jit + split"), ("llama3", "offload", "jax.jit + split")},
           True: {("llama3", "offload", "jax.jit + split")}}
JAX_COMMITS = ("JAX commits the outputs of a step that offloads while the fresh model and optimizer are uncommitted: "
               "the second step compiles again (this module's docstring)")


def grid(place: bool) -> list:
    out = []
    for family, which, pattern in itertools.product(FAMILIES, ("none", "full", "offload"), PATTERNS):
        marks = [] if (family, which, pattern) in DEFAULT[place] else [pytest.mark.slow]
        if which == "offload" and not place:
            marks.append(pytest.mark.xfail(strict=True, reason=JAX_COMMITS))
        out.append(pytest.param(family, which, pattern, marks=marks, id=f"{family}-{which}-{pattern}"))
    return out


@pytest.mark.parametrize("family, which, pattern", grid(place=False))
def test_a_plain_step_compiles_once(family, which, pattern):
    """The user's step as the Flax docs write it, on the freshly built model: the first step compiles, the next two
    reuse its executable."""
    counts = steps(family, which, pattern, place=False)
    assert counts[0] >= 1 and counts[1:] == [0, 0], f"executables per step: {counts}"


@pytest.mark.parametrize("family, which, pattern", grid(place=True))
def test_a_step_on_placed_state_compiles_once(family, which, pattern):
    """The same step after one `jax.device_put` of the state (docs/own-loop.md): one compile under every recipe."""
    counts = steps(family, which, pattern, place=True)
    assert counts[0] >= 1 and counts[1:] == [0, 0], f"executables per step: {counts}"
