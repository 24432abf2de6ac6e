"""The pre-norm decoder block (zoo.layers.block) as a unit: where the residuals go (x + attn(norm(x)), then
+ mlp(norm(.))) against the layers' references composed by hand, the tags (its sub-layers', nothing added), the MoE
form returning its aux, and the gradients of the output w.r.t. the input and the parameters against finite
differences in float64."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference as ref
from tests.layers.random_layers import jitted, random_layer
from zoo.emitted import emitted_by
from zoo.layers import MLP, Attention, RMSNorm, Rope
from zoo.layers.block import PreNormBlock
from zoo.layers.moe import Experts, MoE, MoEAux, SoftmaxRouter

B, S, D, H, KV, HD, F, E = 2, 8, 16, 2, 1, 8, 24, 4
EPS = 1e-5


class Block(PreNormBlock):
    def __init__(self, *, moe: bool = False, dtype=jnp.float32, rngs: nnx.Rngs):
        self.dim, self.dtype = D, dtype
        common = dict(dtype=dtype, param_dtype=dtype)
        self.attn_norm = RMSNorm(D, eps=EPS, **common)
        self.attn = Attention(dim=D, num_heads=H, num_kv_heads=KV, head_dim=HD, rope=Rope(dim=HD),
                              implementation="xla", rngs=rngs, **common)
        self.mlp_norm = RMSNorm(D, eps=EPS, **common)
        if moe:
            self.mlp = MoE(dim=D, router=SoftmaxRouter(dim=D, num_experts=E, k=2, param_dtype=dtype, rngs=rngs),
                           experts=Experts(num_experts=E, dim=D, hidden=F, rngs=rngs, **common),
                           backend="ragged_dot", dtype=dtype)
            self.moe = True
        else:
            self.mlp = MLP(dim=D, hidden=F, rngs=rngs, **common)


def make_block(dtype=jnp.float32, moe=False):
    return random_layer(lambda: Block(moe=moe, dtype=dtype, rngs=nnx.Rngs(0)))


def inputs(dtype=np.float32):
    return np.random.default_rng(1).normal(size=(B, S, D)).astype(dtype)


def reference(block, x):
    a, m = block.attn, block.mlp
    h = x + ref.gqa(ref.rms_norm(x, block.attn_norm.scale[...], EPS),
                    {n: getattr(a, f"{n}_proj").kernel[...] for n in "qkvo"}, inv_freq=a.rope.inv_freq())
    return h + ref.swiglu(ref.rms_norm(h, block.mlp_norm.scale[...], EPS), m.gate_proj.kernel[...],
                          m.up_proj.kernel[...], m.down_proj.kernel[...])


def test_tags_are_the_sub_layers():
    block = make_block()
    sds = jax.ShapeDtypeStruct((B, S, D), jnp.float32)
    assert block.tag_shapes(B, S) == emitted_by(block.attn, sds) | emitted_by(block.mlp, sds)


def test_residuals_and_gradients_float64():
    with ref.float64():
        block, x = make_block(jnp.float64), jnp.asarray(inputs(np.float64))
        assert ref.rel_err(jitted(block)(x), jax.jit(lambda x: reference(block, x))(x)) < 1e-6   # float32 softmax
        graphdef, params = nnx.split(block)
        check_grads(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)), (params, x), order=1, modes=("rev",),
                    eps=3e-4, atol=1e-4, rtol=1e-4)    # as tests/layers/test_attention.py, for the same reason


def test_a_moe_block_returns_its_aux():
    block, x = make_block(moe=True), inputs()
    y, aux = jitted(block)(x)
    assert y.shape == (B, S, D) and isinstance(aux, MoEAux) and aux.load.shape == (E,)
    h = x + jitted(block.attn)(jitted(block.attn_norm)(x))
    want, want_aux = jitted(block.mlp)(jitted(block.mlp_norm)(h))
    assert ref.rel_err(y, h + want) < 1e-6
    np.testing.assert_array_equal(aux.load, want_aux.load)
