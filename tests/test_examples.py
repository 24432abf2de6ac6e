"""The "your own loop" examples (docs/examples/own_loop_<family>.py): for every family, both patterns train, agree,
and compile once.

Pattern (a) is `nnx.jit` + `nnx.value_and_grad` + `nnx.Optimizer`; pattern (b) `nnx.split(model, nnx.Param, ...)`
with `nnx.merge` inside `jax.value_and_grad` under `jax.jit`. Checked: over 3 steps the first compiles and the next
two compile nothing (executables XLA builds or takes from the persistent cache, `tests.helpers.executables`); the
two patterns log the same losses (same initialisation, data and optimizer); DeepSeek-V3's routing bias moves,
equally in both, and leaves pattern (b)'s step in its `rest` state.
"""
from __future__ import annotations

import importlib.util

import jax
import numpy as np
import pytest
from flax import nnx

from tests.helpers import ROOT, executables, tiered
from zoo.layers.moe import RoutingBias

FAMILIES = ("llama3", "deepseek_v3", "qwen3_moe")


def example(family: str):
    path = ROOT / "docs" / "examples" / f"own_loop_{family}.py"
    spec = importlib.util.spec_from_file_location(f"own_loop_{family}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compiles_per_step(step, state: tuple, batches: list) -> tuple[list[int], list[float], tuple]:
    """Run `step(*state, tokens)` on each batch; (compiles of each step, losses, final state). `step` returns the
    loss (pattern a, state updated in place) or (*new state, loss) (pattern b)."""
    counts, losses = [], []
    for tokens in batches:
        with executables() as seen:
            out = step(*state, tokens)
            if isinstance(out, tuple):
                *state, loss = out
            else:
                loss = out
            loss = float(loss)
        counts.append(len(seen))
        losses.append(loss)
    return counts, losses, tuple(state)


@pytest.mark.parametrize("family", tiered(FAMILIES, fast=("llama3",)))
def test_own_loop_both_patterns_compile_once_and_agree(family):
    ex = example(family)
    batches = [ex.batch(i) for i in range(3)]
    model, optimizer = ex.make_nnx()
    counts_a, losses_a, _ = compiles_per_step(ex.nnx_step, (model, optimizer), batches)
    counts_b, losses_b, (params, rest, _) = compiles_per_step(ex.functional_step, ex.make_functional(), batches)

    assert counts_a[0] >= 1 and counts_a[1:] == [0, 0], f"nnx.jit step compiles per step: {counts_a}"
    assert counts_b[0] >= 1 and counts_b[1:] == [0, 0], f"jax.jit step compiles per step: {counts_b}"
    assert np.all(np.isfinite(losses_a)) and losses_a[-1] < losses_a[0], losses_a
    np.testing.assert_allclose(losses_b, losses_a, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    if family == "deepseek_v3":
        biases = lambda state: [v for v in jax.tree.leaves(state) if v.shape[-1] == ex.cfg.num_experts]  # noqa: E731
        moved_a = biases(nnx.state(model, RoutingBias))
        assert moved_a and all(np.any(np.asarray(b) != 0) for b in moved_a), "the routing bias did not move"
        for a, b in zip(biases(rest), moved_a, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_own_loop_example_runs_as_documented(family, capsys):
    """`python docs/examples/own_loop_<family>.py`: its main() trains both patterns and prints both losses."""
    example(family).main(steps=4)
    out = capsys.readouterr().out
    assert "nnx.jit" in out and "jax.jit + split" in out
