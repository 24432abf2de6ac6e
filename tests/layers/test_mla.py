"""Multi-head latent attention (zoo.layers.mla) as a unit, DeepSeek-V3's (YaRN RoPE with its mscale, rope columns
interleaved as published, values of a smaller head dim): output shape, the tags and their shapes, the output against
DeepSeek's "naive" MLA written out (an explicit masked softmax, RoPE on interleaved pairs), gradients of the output
w.r.t. the input and the parameters against finite differences in float64, and against transformers'
`DeepseekV3Attention` under torch autograd (float32, relative 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.helpers import tiered
from tests.layers import reference as ref
from tests.layers.random_layers import jitted, random_layer
from zoo.emitted import emitted_by
from zoo.layers import MLA, Rope, YarnScaling
from zoo.models.deepseek_v3.hf import MLA as MLA_KEYS

B, S, D, H = 2, 8, 32, 3
Q_RANK, KV_RANK, NOPE, ROPE, V = 16, 12, 8, 4, 6
EPS = 1e-6

# The tags the layer emits for an input [B, S, D]: {tag: (shape, dtype)}, dtype None meaning the layer's dtype.
# This is the one place to update when the layer's tags change. (Compared as a dict: the order is not asserted.)
TAGS = {
    "query_wa_proj": ((B, S, Q_RANK), None),
    "mla_q": ((B, S, Q_RANK), None),
    "query_proj": ((B, S, H, NOPE + ROPE), None),     # nope and rotated rope parts, concatenated
    "kv_wa_proj": ((B, S, KV_RANK + ROPE), None),
    "mla_kv": ((B, S, KV_RANK), None),
    "key_proj": ((B, S, H, NOPE + ROPE), None),
    "value_proj": ((B, S, H, V), None),               # not padded to the q/k head dim
    "attention_out": ((B, S, H, V), None),            # the attention kernel's output, sliced back to V
    "context": ((B, H, S), jnp.float32),              # the kernel's softmax statistics (log-sum-exp), float32
    "out_proj": ((B, S, D), None),
}
# How check_grads checks the layer in float64: reverse mode (what training runs; a custom_vjp kernel has no forward
# mode), and, since jax.nn.dot_product_attention's softmax runs in float32 whatever the input dtype, the finite
# differences carry float32 rounding: a larger step and tolerance than the float64 defaults (a wrong gradient is off
# by order one, not 1e-4).
GRAD_CHECK = dict(modes=("rev",), eps=3e-4, atol=1e-4, rtol=1e-4)

# DeepSeek-V3's YaRN (mscale == mscale_all_dim: cos/sin unscaled, softmax scale times mscale^2), a small original
# context; and the paper's YaRN (no mscale fields: cos/sin scaled, softmax scale as is) with rotate-half weights.
YARN = dict(factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0)
VARIANTS = {
    "deepseek-v3": dict(scaling=YarnScaling(**YARN, mscale=1.0, mscale_all_dim=1.0), rope_interleave=True),
    "yarn-paper-rotate-half": dict(scaling=YarnScaling(**YARN, mscale=0.0, mscale_all_dim=0.0),
                                   rope_interleave=False),
}


def make_mla(variant="deepseek-v3", dtype=jnp.float32, seed=0) -> MLA:
    v = VARIANTS[variant]
    return random_layer(lambda: MLA(
        dim=D, num_heads=H, q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
        v_head_dim=V, rope=Rope(dim=ROPE, scaling=v["scaling"]), rope_interleave=v["rope_interleave"], norm_eps=EPS,
        dtype=dtype, param_dtype=dtype, implementation="xla", rngs=nnx.Rngs(seed)), seed)


def inputs(dtype=np.float32, seed=1):
    return np.random.default_rng(seed).normal(size=(B, S, D)).astype(dtype)


def reference(mla, x, variant):
    s = VARIANTS[variant]["scaling"]
    p = dict(q_a=mla.q_a_proj.kernel[...], q_a_norm=mla.q_a_layernorm.scale[...], q_b=mla.q_b_proj.kernel[...],
             kv_a=mla.kv_a_proj_with_mqa.kernel[...], kv_a_norm=mla.kv_a_layernorm.scale[...],
             kv_b=mla.kv_b_proj.kernel[...], o=mla.o_proj.kernel[...])
    # the scalings' factors from their formulas (tests/layers/test_rope.py checks the zoo's against transformers')
    both = s.mscale and s.mscale_all_dim
    attention_factor = (ref.yarn_mscale(s.factor, s.mscale) / ref.yarn_mscale(s.factor, s.mscale_all_dim) if both
                        else ref.yarn_mscale(s.factor, 1.0))
    softmax_mscale = ref.yarn_mscale(s.factor, s.mscale_all_dim) ** 2 if s.mscale_all_dim else 1.0
    inv_freq = ref.yarn_inv_freq(ROPE, 10000.0, **YARN)
    return ref.mla(x, p, nope=NOPE, rope_dim=ROPE, kv_lora_rank=KV_RANK, inv_freq=inv_freq, eps=EPS,
                   softmax_mscale=softmax_mscale, attention_factor=attention_factor,
                   interleaved=VARIANTS[variant]["rope_interleave"])


def test_shape_and_tags():
    mla = make_mla()
    assert jax.eval_shape(mla, jax.ShapeDtypeStruct((B, S, D), jnp.float32)).shape == (B, S, D)
    for dtype in (jnp.float32, jnp.bfloat16):
        layer = make_mla(dtype=dtype)
        got = emitted_by(layer, jax.ShapeDtypeStruct((B, S, D), dtype))
        assert {t: (s.shape, s.dtype) for t, s in got.items()} == {
            t: (shape, jnp.dtype(dt or dtype)) for t, (shape, dt) in TAGS.items()}
        assert layer.tag_shapes(B, S) == got


@pytest.mark.parametrize("variant", tiered(sorted(VARIANTS), fast=("deepseek-v3",)))
def test_matches_reference_and_gradients_float64(variant):
    with ref.float64():
        mla, x = make_mla(variant, jnp.float64), jnp.asarray(inputs(np.float64))
        out = jitted(mla)(x)
        assert out.dtype == jnp.float64
        want = jax.jit(lambda x: reference(mla, x, variant))(x)
        assert ref.rel_err(out, want) < 1e-6    # the kernel's float32 softmax
        graphdef, params = nnx.split(mla)
        check_grads(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)), (params, x), order=1, **GRAD_CHECK)


def test_rope_layout_matters():
    """The interleaved and rotate-half layouts of the same weights give different outputs (the reference
    comparison above would see the layer take the wrong one)."""
    a, b = make_mla("deepseek-v3"), make_mla("deepseek-v3")
    b.rope_interleave = False
    x = jnp.asarray(inputs())
    assert ref.rel_err(jitted(a)(x), jitted(b)(x)) > 1e-3


@pytest.mark.parametrize("variant", tiered(sorted(VARIANTS), fast=("deepseek-v3",)))
def test_matches_deepseek_v3_attention_under_torch_autograd(hf, variant):
    import torch
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    s = VARIANTS[variant]["scaling"]
    scaling = dict(rope_type="yarn", **YARN, **({"mscale": s.mscale, "mscale_all_dim": s.mscale_all_dim}
                                               if s.mscale else {}))
    cfg = transformers.DeepseekV3Config(
        hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=Q_RANK, kv_lora_rank=KV_RANK,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, rms_norm_eps=EPS, rope_theta=10000.0,
        rope_scaling=scaling, rope_interleave=VARIANTS[variant]["rope_interleave"], attention_bias=False,
        max_position_embeddings=64, attn_implementation="eager")
    mla, theirs = make_mla(variant), DeepseekV3Attention(cfg, layer_idx=0).eval()
    rotary = DeepseekV3RotaryEmbedding(cfg)
    rows = hf.unit_rows(MLA_KEYS, "attn.", "self_attn.")
    hf.load(theirs, mla, rows)
    for m in theirs.modules():   # transformers' MLA norms take their eps default (1e-6), not the config's
        if hasattr(m, "variance_epsilon"):
            assert m.variance_epsilon == EPS
    x, ct = inputs(), inputs(seed=2)
    pos = torch.arange(S)[None]

    def forward(xt):
        return theirs(xt, position_embeddings=rotary(xt, pos), attention_mask=hf.causal_mask(S))[0]
    out, dx = hf.torch_vjp(forward, x, ct)
    got, got_dx, got_params = hf.jax_vjp(mla, x, ct)
    assert ref.rel_err(got, out) < 1e-5
    assert ref.rel_err(got_dx, dx) < 1e-5
    want = hf.grads(theirs, mla, rows)
    assert set(want) == set(got_params)
    for path in want:
        assert ref.rel_err(got_params[path], want[path]) < 1e-5, path
