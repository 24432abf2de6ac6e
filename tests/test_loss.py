"""The loss in chunks (`zoo.loss`, `zoo.train_step`): the chunked LM head and cross-entropy give the unchunked loss
and gradients (float32, every family, tied and untied heads, DeepSeek-V3's multi-token prediction on); bad chunk
lengths are ValueErrors before anything is traced; the default chunk length; the compiled step's temporaries fall
with chunking where the logits dominate."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import max_rel_err
from zoo import loss as loss_lib
from zoo import train_step
from zoo.models import registry
from zoo.recipe import Recipe
from zoo.training import Training

B, S = 2, 16
FAMILIES = {  # float32 parameters and activations; DeepSeek-V3 with two MTP depths
    "llama3": dict(num_layers=1, dtype="float32"),
    "deepseek_v3": dict(num_layers=1, first_dense_layers=1, mtp_depths=2),   # two MTP depths (MoE layers)
    "qwen3_moe": dict(num_layers=2, mlp_only_layers=(0,)),
}


def _batch(vocab):
    tokens = jax.random.randint(jax.random.key(1), (B, S + 1), 0, vocab, dtype=jnp.int32)
    weights = jax.random.uniform(jax.random.key(2), (B, S)).at[0, 3].set(0.0)   # uneven, one target excluded
    return {"tokens": tokens, "weights": weights}


def _losses_and_grads(model, fam, batch, *chunks, grad_accum=1):
    """loss_and_grads under each of `chunks`, in one jitted function (one compile)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    @jax.jit
    def f(params):
        m = nnx.merge(graphdef, params, rest, copy=True)
        return [train_step.loss_and_grads(m, batch, aux_loss=fam.aux_loss, grad_accum=grad_accum, loss_chunk=c)
                for c in chunks]
    return f(params)


# fast: Llama's two heads and DeepSeek-V3's MTP; the rest in the full set (-m 'slow or not slow')
FAST = {("llama3", False), ("llama3", True)}
CASES = [pytest.param(n, t, id=f"{n}-{'tied' if t else 'untied'}",
                      marks=[] if (n, t) in FAST else [pytest.mark.slow])
         for n in FAMILIES for t in (False, True)]


@pytest.mark.parametrize("name, tied", CASES)
def test_chunked_loss_and_gradients_equal_the_unchunked(name, tied):
    fam = registry.family(name)
    cfg = fam.config("tiny", tie_embeddings=tied, **FAMILIES[name])
    assert cfg.dtype == cfg.param_dtype == "float32"
    model = fam.build(cfg, recipe=Recipe.none(), rngs=nnx.Rngs(0))
    assert (model.lm_head is None) == tied
    ref, (loss, lm, extra, _, grads) = _losses_and_grads(model, fam, _batch(cfg.vocab_size), None, 4)
    assert float(loss) == pytest.approx(float(ref[0]), rel=1e-5)
    assert float(lm) == pytest.approx(float(ref[1]), rel=1e-5)
    assert set(extra) == set(ref[2]) == ({"mtp"} if name == "deepseek_v3" else set())
    for k in extra:   # the MTP loss, chunked the same way
        assert float(extra[k]) == pytest.approx(float(ref[2][k]), rel=1e-5)
    assert max_rel_err(grads, ref[4]) < 1e-5
    # the head's gradient is there, and (tied) it is the embedding's
    head = grads["embed"]["embedding"] if tied else grads["lm_head"]["proj"]["kernel"]
    assert float(jnp.abs(head[...]).max()) > 0


@pytest.mark.slow   # the micro-batch scan runs the same loss function
def test_chunked_loss_with_micro_batches():
    fam = registry.family("llama3")
    cfg = fam.config("tiny", **FAMILIES["llama3"])
    model = fam.build(cfg, recipe=Recipe.none(), rngs=nnx.Rngs(0))
    batch = _batch(cfg.vocab_size)
    ref = _losses_and_grads(model, fam, batch, None)[0]
    loss, _, _, _, grads = _losses_and_grads(model, fam, batch, 4, grad_accum=2)[0]
    assert float(loss) == pytest.approx(float(ref[0]), rel=1e-5)
    assert max_rel_err(grads, ref[4]) < 1e-5


def test_head_loss_matches_next_token_loss_and_its_weight_gradient():
    """`head_loss` on a plain matmul head: value and gradients (hidden, head, loss weights) against the unchunked
    `next_token_loss` of the whole logits, with an outer factor (the cotangent is not 1)."""
    k = jax.random.split(jax.random.key(0), 4)
    h, w = jax.random.normal(k[0], (B, S, 8)), jax.random.normal(k[1], (8, 50))
    t, wt = jax.random.randint(k[2], (B, S), 0, 50), jax.random.uniform(k[3], (B, S))

    def head(w, x):
        return x @ w

    def chunked(w, h, wt):
        return 3.0 * loss_lib.head_loss(head, w, h, t, wt, jnp.float32(7.0), chunk=4)

    def whole(w, h, wt):
        return 3.0 * loss_lib.next_token_loss(h @ w, t, wt, jnp.float32(7.0))
    a = jax.value_and_grad(chunked, argnums=(0, 1, 2))(w, h, wt)
    b = jax.value_and_grad(whole, argnums=(0, 1, 2))(w, h, wt)
    assert float(a[0]) == pytest.approx(float(b[0]), rel=1e-6)
    assert max_rel_err(a[1], b[1]) < 1e-6
    assert float(jax.jit(chunked)(w, h, wt)) == pytest.approx(float(b[0]), rel=1e-6)   # no gradient: the plain loop


@pytest.mark.parametrize("chunk, match", [
    (-1, "must be a positive int.*got -1"),
    (5, "--loss-chunk 5 does not divide the sequence length 16"),
    (32, "--loss-chunk 32 does not divide the sequence length 16"),
    (2.0, "got 2.0"),
    (True, "got True"),
    ("all", "got 'all'"),
])
def test_bad_chunk_lengths_raise_before_tracing(chunk, match):
    fam = registry.family("llama3")
    cfg = fam.config("tiny")
    model = fam.build(cfg, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        train_step.loss_and_grads(model, _batch(cfg.vocab_size), aux_loss=fam.aux_loss, loss_chunk=chunk)
    with pytest.raises(ValueError, match=match):   # before anything is built or compiled
        train_step.compile_abstract(fam, cfg, Recipe.none(), batch=B, seq=S,
                                     training=Training(loss_chunk=chunk))


def test_default_chunk_length():
    # Llama 3.1's vocabulary at 32K: 1,024 positions (512 MiB of float32 logits) a chunk
    assert loss_lib.default_chunk(1, 32768, 128256) == 1024
    assert loss_lib.default_chunk(4, 8192, 128256) == 256
    assert loss_lib.default_chunk(2, 8192, 128256) is None           # 7.8 GiB of logits: whole (WHOLE_BYTES)
    assert loss_lib.default_chunk(1, 6000, 128256) is None
    assert loss_lib.chunk_under(loss_lib.CHUNK_BYTES, 1, 6000, 128256) == 1000   # the largest divisor under the limit
    assert loss_lib.default_chunk(8, 64, 256) is None                # small logits: unchunked
    assert loss_lib.default_chunk(1, 8191, 128256) is None           # a prime length: unchunked (no good divisor)
    assert loss_lib.resolve_chunk("auto", 1, 32768, 128256) == 1024
    assert loss_lib.resolve_chunk(0, 1, 32768, 128256) is None
    assert loss_lib.resolve_chunk(32768, 1, 32768, 128256) is None   # one chunk of the whole sequence


def test_compiled_temporaries_fall_with_chunking():
    """On the CPU, a tiny Llama with a large vocabulary at seq 256: XLA's temporaries of the compiled step fall by
    more than the [1, 256, 16384] float32 logits (16 MiB) when the loss runs 32 positions at a time."""
    fam = registry.family("llama3")
    cfg = fam.config("tiny", vocab_size=16384, num_layers=1)
    temp = {}
    for chunk in (None, 32):
        compiled, _, _ = train_step.compile_abstract(fam, cfg, Recipe.none(), batch=1, seq=256,
                                                     training=Training(loss_chunk=chunk))
        temp[chunk] = compiled.memory_analysis().temp_size_in_bytes
    logits = 4 * 256 * 16384
    assert temp[32] < temp[None] - logits, {k: v / 2 ** 20 for k, v in temp.items()}


def test_eval_loss_equals_the_logits_loss():
    fam = registry.family("llama3")
    cfg = fam.config("tiny", **FAMILIES["llama3"])
    model = fam.build(cfg, rngs=nnx.Rngs(0))
    batch = _batch(cfg.vocab_size)
    want = loss_lib.next_token_loss(model(batch["tokens"][:, :-1]), batch["tokens"][:, 1:], batch["weights"])
    got = nnx.jit(lambda m, b: train_step.eval_loss(m, b, 4))(model, batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
