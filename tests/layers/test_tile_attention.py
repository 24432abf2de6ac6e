"""A query tile's causal attention against the keys up to it (zoo.layers.tile_attention): tiles equal the rows of
whole causal attention, forward and gradients (float32, 1e-5), with the XLA kernel here and cuDNN's and
mosaic_cudnn's on a GPU; one program serves every tile (its start traced); two key blocks merge into the softmax over
both; a part given a key length reads only those keys; a start within a block is refused; cuDNN's tile attention
traces with a traced start (on the CPU, its checks stubbed)."""
import jax
import jax.numpy as jnp
import pytest

from zoo.layers import causal_attention
from zoo.layers.attention_kernel import attention_part
from zoo.layers.tile_attention import merge, prefix_attention

B, S, H, KV, D = 2, 16, 4, 2, 8


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def qkv(dtype=jnp.float32, s=S, d=D):
    ks = jax.random.split(jax.random.key(0), 4)
    return (jax.random.normal(ks[0], (B, s, H, d), dtype), jax.random.normal(ks[1], (B, s, KV, d), dtype),
            jax.random.normal(ks[2], (B, s, KV, d), dtype), jax.random.normal(ks[3], (B, s, H, d), dtype))


def tiles_of(impl, tiles):
    @jax.jit
    def attend(q, k, v):
        n = q.shape[1] // tiles
        return jnp.concatenate([prefix_attention(q[:, t * n:(t + 1) * n], k[:, t * n:(t + 1) * n],
                                                 v[:, t * n:(t + 1) * n], k, v, t * n, impl=impl)
                                for t in range(tiles)], axis=1)
    return attend


def test_one_program_serves_every_tile_its_start_traced():
    q, k, v, g = qkv()
    n = S // 4
    one = jax.jit(lambda q, k, v, start: prefix_attention(q, k, v, *kv_all, start, impl="xla"))
    kv_all = (k, v)
    ref = causal_attention(q, k, v, impl="xla")
    for t in range(4):
        here = slice(t * n, (t + 1) * n)
        assert rel(one(q[:, here], k[:, here], v[:, here], jnp.int32(t * n)), ref[:, here]) < 1e-6


def rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


def check_against_whole(impl, dtype, tol, s=S, tiles=4, d=D):
    q, k, v, g = qkv(dtype, s, d)
    out, vjp = jax.vjp(tiles_of(impl, tiles), q, k, v)
    ref, ref_vjp = jax.vjp(jax.jit(lambda *a: causal_attention(*a, impl=impl)), q, k, v)
    assert out.shape == ref.shape and rel(out, ref) < tol
    for got, want in zip(vjp(g), ref_vjp(g)):
        assert got.shape == want.shape and rel(got, want) < tol


@pytest.mark.parametrize("tiles", [2, 4])
def test_query_tiles_equal_whole_causal_attention_forward_and_gradients(tiles):
    check_against_whole("xla", jnp.float32, 1e-5, tiles=tiles)


def test_a_part_over_the_first_keys_given_their_number_is_the_part_over_those_keys():
    q, k, v, _ = qkv()
    n = jnp.int32(5)
    out, lse = jax.jit(lambda q, k, v, n: attention_part("xla", q, k, v, D ** -0.5, causal=False, kv_len=n))(q, k, v, n)
    want, want_lse = attention_part("xla", q, k[:, :5], v[:, :5], D ** -0.5, causal=False)
    assert rel(out, want) < 1e-6 and rel(lse, want_lse) < 1e-6


def test_a_start_within_a_block_is_refused():
    q, k, v, _ = qkv()
    with pytest.raises(ValueError, match="start=2 must be a multiple of the tile's length 4"):
        prefix_attention(q[:, 2:6], k[:, 2:6], v[:, 2:6], k, v, 2, impl="xla")


def test_merge_of_two_key_blocks_is_the_softmax_over_both():
    q, k, v, _ = qkv()
    half = S // 2
    parts = [attention_part("xla", q, k[:, a:b], v[:, a:b], D ** -0.5, causal=False) for a, b in ((0, half),
                                                                                                  (half, S))]
    out, lse = merge(*parts[0], *parts[1])
    whole, whole_lse = attention_part("xla", q, k, v, D ** -0.5, causal=False)
    assert rel(out, whole) < 1e-6 and rel(lse, whole_lse) < 1e-6


def test_cudnns_tile_attention_traces_with_a_traced_start(monkeypatch):
    """jax's cuDNN attention, traced on the CPU (its version and flash-attention checks stubbed; nothing runs): a
    tile's gradient through its own keys' call and the loop over the blocks before it (as many as its traced start
    has) has the inputs' shapes, and the kernel's residuals are read as cuDNN's."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not all(hasattr(fa, f) for f in ("check_cudnn_version", "check_is_flash_attention")):
        pytest.skip("jax's cuDNN attention checks moved")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fa, "check_is_flash_attention", lambda *a, **kw: None)
    sds = jax.ShapeDtypeStruct
    tile, whole = (sds((1, 64, H, 64), jnp.bfloat16), sds((1, 64, KV, 64), jnp.bfloat16),
                   sds((1, 64, KV, 64), jnp.bfloat16)), (sds((1, 256, KV, 64), jnp.bfloat16),) * 2

    def loss(q, k, v, ka, va, start):
        return jnp.sum(prefix_attention(q, k, v, ka, va, start, impl="cudnn").astype(jnp.float32))

    grads = jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *tile, *whole, sds((), jnp.int32))
    assert [(x.shape, x.dtype) for x in grads] == [(x.shape, x.dtype) for x in tile + whole]


gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's and tokamax's kernels need a GPU")


@gpu
@pytest.mark.parametrize("impl", ["cudnn", "mosaic_cudnn"])
def test_gpu_kernels_over_query_tiles_equal_the_whole_kernel(impl):
    if impl == "mosaic_cudnn":
        pytest.importorskip("tokamax")
    check_against_whole(impl, jnp.bfloat16, 2e-2, s=1024, d=128)   # the head dims the GPU kernels take


