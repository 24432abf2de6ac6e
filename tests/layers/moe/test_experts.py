"""The routed experts (zoo.layers.moe.experts) as a unit: the grouped (dropless) and batched (capacity) forms against
each row through its own expert's SwiGLU, their tags and shapes, and the grouped form's gradients w.r.t. the rows and
the experts' weights against finite differences in float64."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference as ref
from tests.layers.random_layers import random_layer
from zoo.emitted import emitted
from zoo.layers.moe import Experts

E, D, F, C = 4, 8, 12, 3
SIZES = np.array([3, 0, 4, 2], np.int32)     # rows per expert, one expert empty
N = int(SIZES.sum()) + 2                     # two rows past the groups: no expert's


def make_experts(dtype=jnp.float32):
    return random_layer(lambda: Experts(num_experts=E, dim=D, hidden=F, dtype=dtype, param_dtype=dtype,
                                        rngs=nnx.Rngs(0)))


def rows(dtype=np.float32, shape=(N, D)):
    return np.random.default_rng(1).normal(size=shape).astype(dtype)


def reference_grouped(ex, r):
    expert = np.repeat(np.arange(E), SIZES)
    out = ref.swiglu(r[:len(expert)], ex.gate_proj[...][expert], ex.up_proj[...][expert], ex.down_proj[...][expert])
    return jnp.concatenate([out, jnp.zeros((N - len(expert), D), out.dtype)])


def test_grouped_matches_reference_tags_and_gradients_float64():
    with ref.float64():
        ex, r = make_experts(jnp.float64), jnp.asarray(rows(np.float64))
        sizes = jnp.asarray(SIZES)
        graphdef, params = nnx.split(ex)
        grouped = jax.jit(lambda p, r: nnx.merge(graphdef, p).grouped(r, sizes, "ragged_dot"))
        assert ref.rel_err(grouped(params, r), reference_grouped(ex, r)) < 1e-13
        tags = emitted(grouped, params, r)
        assert {t: s.shape for t, s in tags.items()} == {"moe_mlpwi_0": (N, F), "moe_mlpwi_1": (N, F),
                                                         "moe_mlpwo": (N, D)}
        check_grads(grouped, (params, r), order=1, modes=("rev",))


def test_batched_matches_reference_and_tags():
    ex, buf = make_experts(), jnp.asarray(rows(shape=(E, C, D)))
    got = jax.jit(lambda b: ex.batched(b))(buf)
    want = ref.swiglu(buf, ex.gate_proj[...][:, None], ex.up_proj[...][:, None], ex.down_proj[...][:, None])
    assert ref.rel_err(got, want) < 1e-6
    tags = emitted(lambda b: ex.batched(b), buf)
    assert {t: s.shape for t, s in tags.items()} == {"moe_mlpwi_0": (E, C, F), "moe_mlpwi_1": (E, C, F),
                                                     "moe_mlpwo": (E, C, D)}
