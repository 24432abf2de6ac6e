"""RoPE (zoo.layers.rope) as a unit: the frequencies of plain RoPE, Llama 3.1's scaling and YaRN against the
published reference code (Meta's `apply_scaling`, DeepSeek's `precompute_freqs_cis`), YaRN's two mscale factors,
the rotation against a rotation of pairs, gradients against finite differences in float64, and against
transformers' `LlamaRotaryEmbedding` (rope_type llama3) and `DeepseekV3RotaryEmbedding` (rope_type yarn) with
`apply_rotary_pos_emb` under torch autograd (float32)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tests.helpers import tiered
from tests.layers import reference as ref
from zoo.emitted import emitted
from zoo.layers import Rope, WavelengthScaling, YarnScaling

B, S, H, DIM = 2, 8, 3, 16
# Small original contexts, so that the tiny head dim has frequencies in every band of each scaling (Llama 3.1's:
# wavelengths 6.3 kept, 20 smoothed, 63 and longer divided by the factor).
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
# YaRN's: the ramp from 0 to 4 puts frequency 0 in extrapolation, 1-3 on the ramp, the rest interpolated.
YARN = dict(factor=4.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0)
ROPES = {
    "plain": (Rope(dim=DIM, theta=10000.0), ref.rope_inv_freq(DIM, 10000.0), 1.0),
    "llama3": (Rope(dim=DIM, theta=10000.0, scaling=WavelengthScaling(**LLAMA3)),
               ref.llama3_inv_freq(DIM, 10000.0, **LLAMA3), 1.0),
    # DeepSeek-V3's mscale == mscale_all_dim: cos/sin unscaled
    "yarn": (Rope(dim=DIM, scaling=YarnScaling(**YARN, mscale=1.0, mscale_all_dim=1.0)),
             ref.yarn_inv_freq(DIM, 10000.0, **YARN), 1.0),
    # mscale != mscale_all_dim: cos/sin scaled by their ratio
    "yarn-mscale": (Rope(dim=DIM, scaling=YarnScaling(**YARN, mscale=0.707, mscale_all_dim=1.0)),
                    ref.yarn_inv_freq(DIM, 10000.0, **YARN),
                    ref.yarn_mscale(4.0, 0.707) / ref.yarn_mscale(4.0, 1.0)),
}


def positions(seed=0):
    """[B, S] positions past the original context (where the scalings matter), increasing in each row."""
    return np.sort(np.random.default_rng(seed).integers(0, 200, (B, S)), axis=1).astype(np.int32)


def inputs(dtype=np.float32, seed=1):
    return np.random.default_rng(seed).normal(size=(B, S, H, DIM)).astype(dtype)


@pytest.mark.parametrize("name", sorted(ROPES))
def test_frequencies_match_published_code(name):
    rope, inv_freq, _ = ROPES[name]
    np.testing.assert_allclose(rope.inv_freq(), inv_freq, rtol=1e-13)
    # each scaling changes some frequencies and keeps others (the test would see a band ignored)
    if rope.scaling is not None:
        plain = ref.rope_inv_freq(DIM, rope.theta)
        kept, divided = np.isclose(inv_freq, plain, rtol=1e-12), np.isclose(inv_freq, plain / rope.scaling.factor)
        assert kept.any() and divided.any() and not (kept | divided).all()


def test_yarn_mscales():
    """cos/sin's factor and the softmax scale's mscale^2 (DeepSeek-V3: 0.1 ln 40 + 1, squared)."""
    paper = YarnScaling(factor=4.0, mscale=0.0, mscale_all_dim=0.0)
    assert paper.attention_factor() == pytest.approx(0.1 * math.log(4.0) + 1) and paper.softmax_mscale() == 1.0
    ds = YarnScaling()
    assert ds.attention_factor() == 1.0 and ds.softmax_mscale() == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert ROPES["yarn-mscale"][0].scaling.attention_factor() == pytest.approx(ROPES["yarn-mscale"][2])


@pytest.mark.parametrize("name", tiered(sorted(ROPES), fast=("llama3", "yarn-mscale")))
def test_rotation_matches_reference_in_float64(name):
    rope, inv_freq, factor = ROPES[name]
    pos = positions()
    with ref.float64():
        x = jnp.asarray(inputs(np.float64))
        got = rope(x, jnp.asarray(pos))
        assert got.shape == x.shape and got.dtype == jnp.float64
        want = jnp.stack([ref.rope_half(x[b:b + 1], pos[b], inv_freq, factor)[0] for b in range(B)])
        assert ref.rel_err(got, want) < 1e-12
        # positions [S] broadcast over the batch
        assert ref.rel_err(rope(x, jnp.asarray(pos[0])), ref.rope_half(x, pos[0], inv_freq, factor)) < 1e-12
        check_grads(jax.jit(lambda x: rope(x, jnp.asarray(pos))), (x,), order=1, modes=("rev",))


def test_dtype_and_no_tags():
    rope = ROPES["llama3"][0]
    x = jnp.asarray(inputs()).astype(jnp.bfloat16)
    assert rope(x, jnp.arange(S)).dtype == jnp.bfloat16
    assert emitted(lambda x: rope(x, jnp.arange(S)), x) == {}


def _check_against_torch(hf, rope, rotary, x):
    """zoo's rotation of x against transformers' cos/sin from `rotary` and apply_rotary_pos_emb (float32, rel 1e-5),
    the output and the gradient w.r.t. x."""
    import torch
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    pos = positions()
    cos, sin = rotary(torch.zeros(1), torch.tensor(pos, dtype=torch.long))
    ct = inputs(seed=2)
    out, dx = hf.torch_vjp(lambda q: apply_rotary_pos_emb(q, q, cos, sin, unsqueeze_dim=2)[0], x, ct)

    def rotate(x):
        return rope(x, jnp.asarray(pos))
    got, got_dx = jax.jit(lambda x: (rotate(x), jax.grad(lambda x: jnp.sum(rotate(x) * ct))(x)))(jnp.asarray(x))
    assert ref.rel_err(got, out) < 1e-5
    assert ref.rel_err(got_dx, dx) < 1e-5
    return rotary


def test_llama3_matches_transformers(hf):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rope = ROPES["llama3"][0]
    cfg = transformers.LlamaConfig(hidden_size=H * DIM, num_attention_heads=H, head_dim=DIM, rope_theta=rope.theta,
                                   rope_scaling=dict(rope_type="llama3", **LLAMA3), max_position_embeddings=256)
    rotary = _check_against_torch(hf, rope, LlamaRotaryEmbedding(cfg), inputs())
    np.testing.assert_allclose(rotary.inv_freq.numpy(), rope.inv_freq(), rtol=1e-6)


@pytest.mark.parametrize("name", tiered(["yarn", "yarn-mscale"], fast=("yarn-mscale",)))
def test_yarn_matches_transformers(hf, name):
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
    rope = ROPES[name][0]
    s = rope.scaling
    cfg = transformers.DeepseekV3Config(
        hidden_size=32, num_attention_heads=2, qk_rope_head_dim=DIM, qk_nope_head_dim=8, v_head_dim=8,
        rope_theta=rope.theta, max_position_embeddings=1024,
        rope_scaling=dict(rope_type="yarn", **YARN, mscale=s.mscale, mscale_all_dim=s.mscale_all_dim))
    rotary = _check_against_torch(hf, rope, DeepseekV3RotaryEmbedding(cfg), inputs())
    np.testing.assert_allclose(rotary.inv_freq.numpy(), rope.inv_freq(), rtol=1e-6)
    assert rotary.attention_scaling == pytest.approx(s.attention_factor())
