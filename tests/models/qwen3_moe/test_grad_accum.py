"""Qwen3-MoE under gradient accumulation: the Switch balance loss (weight * E * sum_i f_i P_i) is a product of two
batch means, so it is computed on each micro-batch and averaged (as transformers computes it per forward pass);
the next-token loss adds up exactly. What `--grad-accum K` computes is then exactly the mean of K one-micro-batch
steps, and it differs from K=1 on the whole batch by the balance loss alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from zoo.models.qwen3_moe import Qwen3MoeConfig, aux_loss, qwen3_moe
from zoo.train_step import loss_and_grads, micro_batches

B, S, K = 4, 8, 4


def _setup():
    # two MoE layers (one stack): the smallest model with the balance loss; parameters drawn by NumPy into its
    # abstract state (no initializer compiles)
    cfg = Qwen3MoeConfig.preset("tiny", num_layers=2, mlp_only_layers=())
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: qwen3_moe(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda v: jnp.asarray(0.2 * rng.standard_normal(v.shape), v.dtype), abstract)
    batch = {"tokens": jnp.asarray(rng.integers(256, size=(B, S + 1)), jnp.int32), "weights": jnp.ones((B, S))}

    @jax.jit(static_argnums=(2, 3))
    def grads(state, batch, k, with_balance=True):
        m = nnx.merge(graphdef, state)
        loss, *_, g = loss_and_grads(m, batch, aux_loss=aux_loss if with_balance else lambda c, a: 0.0,
                                     grad_accum=k)
        return loss, jax.tree.leaves(g)
    return state, batch, grads


def _rel(a, b) -> float:
    return max(float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)) for x, y in zip(a, b))


@pytest.mark.slow
def test_grad_accum_is_the_mean_of_micro_batch_steps():
    """K micro-batches compute the mean of K one-micro-batch steps (each with its own balance loss), to float32
    rounding."""
    state, batch, grads = _setup()
    accum_loss, accum = grads(state, batch, K)
    mbs = micro_batches(batch, K)
    parts = [grads(state, {k: v[m] for k, v in mbs.items()}, 1) for m in range(K)]
    mean = [sum(leaves) / K for leaves in zip(*(p[1] for p in parts))]
    assert _rel(accum, mean) < 1e-5
    np.testing.assert_allclose(accum_loss, np.mean([p[0] for p in parts]), rtol=1e-6)


@pytest.mark.slow
def test_grad_accum_differs_from_k1_by_the_balance_loss_alone():
    """Against K=1 on the whole batch: different with the balance loss (each micro-batch's f_i and P_i are its own:
    the difference the README states), equal to rounding without it."""
    state, batch, grads = _setup()
    whole_loss, whole = grads(state, batch, 1)
    accum_loss, accum = grads(state, batch, K)
    assert _rel(accum, whole) > 1e-5 and not np.isclose(accum_loss, whole_loss, rtol=1e-6)
    _, whole = grads(state, batch, 1, False)
    _, accum = grads(state, batch, K, False)
    assert _rel(accum, whole) < 1e-5
