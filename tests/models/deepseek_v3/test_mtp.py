"""DeepSeek-V3 multi-token prediction: shapes and stacks, a NumPy reference of the MTP forward, the loss's causal
shift, gradients under every recipe against recompute-nothing, placements in the MTP stack, counts, configs."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.deepseek_v3 import RECIPES
from tests.helpers import max_rel_err, plain, tiered
from zoo import train_step
from zoo.models.deepseek_v3 import FAMILY, DeepSeekDecoderLayer
from zoo.models.deepseek_v3.mtp import mtp_loss
from zoo.models.stack import module_at
from zoo.plan import measure

# one dense main layer (no scan) and two MTP depths (MoE layers), so that depth 2 reads depth 1's output
CFG = zoo.models.DeepSeekV3Config.preset("tiny", num_layers=1, first_dense_layers=1, mtp_depths=2)
B, S, D = 2, 8, 2


# the recipes of tags alone (tiles and groups: tests/models/test_stack.py)
PLAIN = [n for n in RECIPES if plain(RECIPES[n])]


@pytest.fixture(scope="module")
def model():
    return zoo.models.deepseek_v3(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward():
    return nnx.jit(lambda m, t: m(t, return_aux=True))


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.key(1), (B, S + 1), 0, CFG.vocab_size, dtype=jnp.int32)
    weights = jnp.ones((B, S)).at[0, 3].set(0.0)   # one excluded target
    return {"tokens": tokens, "weights": weights}


def test_the_mtp_stack_and_its_tags(model):
    assert tuple(model.stacks()) == ("dense_layers", "mtp") and model.stack_names == ("dense_layers",)
    assert model.mtp.layers.num_layers == D and model.mtp.heads.eh_proj.kernel.shape == (D, 2 * 64, 64)
    layer = nnx.eval_shape(lambda: DeepSeekDecoderLayer(CFG, moe=True, rngs=nnx.Rngs(0)))
    want = {"decoder_layer_input": (B, S, 64), **{t: s.shape for t, s in layer.tag_shapes(B, S).items()}}
    assert {t: s.shape for t, s in model.tag_shapes(B, S)["mtp"].tags.items()} == want
    # the MTP layers emit the MoE tags the main stack of this config does not: a recipe naming them is accepted
    model.set_recipe(RECIPES["mla_moe_offload"])


def test_forward_shapes_and_aux(model, batch, forward):
    logits, aux = forward(model, batch["tokens"][:, :-1])
    assert logits.shape == (B, S, CFG.vocab_size)
    assert aux["mtp_logits"].shape == (D, B, S, CFG.vocab_size)
    assert aux["mtp"].load.shape == (D, CFG.num_experts) and aux["mtp"].balance_loss.shape == (D,)
    np.testing.assert_array_equal(np.asarray(aux["mtp"].load.sum(-1)), B * S * CFG.num_experts_per_tok)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(model(batch["tokens"][:, :-1])),
                               atol=1e-5)   # a plain call: the same logits, no MTP


def _rms(x, scale, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(scale, np.float64)


def test_mtp_logits_match_a_numpy_reference(model, batch, forward):
    """Everything MTP adds, in NumPy (the decoder layers, checked elsewhere, called as they are): the shifted
    embeddings, the two norms, the [embedding; hidden] projection, each depth's norm, the shared head."""
    tokens = batch["tokens"][:, :-1]
    _, aux = forward(model, tokens)
    x, _ = model.dense_layers(model.embed(tokens), model.recipe.policy())
    h = np.asarray(model.norm(x), np.float64)
    emb = np.asarray(model.embed.embedding[...], np.float64)
    head = np.asarray(model.lm_head.proj.kernel[...], np.float64)
    eps = CFG.norm_eps
    for k in range(1, D + 1):
        p = jax.tree.map(lambda v, k=k: np.asarray(v[k - 1], np.float64), nnx.state(model.mtp.heads, nnx.Param))
        ahead = np.zeros((B, S, CFG.dim))
        ahead[:, :S - k] = emb[np.asarray(tokens)[:, k:]]   # Emb(t_(i+k)); nothing past the input
        x = np.concatenate([_rms(ahead, p["enorm"]["scale"], eps), _rms(h, p["hnorm"]["scale"], eps)], -1)
        x = x @ p["eh_proj"]["kernel"]
        y, _ = module_at(model.mtp.layers.layers, k - 1)(jnp.asarray(x, jnp.float32))
        h = _rms(y, p["norm"]["scale"], eps)
        np.testing.assert_allclose(np.asarray(aux["mtp_logits"][k - 1]), h @ head, rtol=2e-4, atol=2e-4)


def test_depth_k_sees_no_token_past_i_plus_k(model, batch, forward):
    tokens = batch["tokens"][:, :-1]
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % CFG.vocab_size)
    a, b = forward(model, tokens)[1]["mtp_logits"], forward(model, changed)[1]["mtp_logits"]
    for k in range(1, D + 1):   # position i reads tokens up to i + k: those before S - 1 - k never see the change
        np.testing.assert_allclose(np.asarray(a[k - 1, :, :S - 1 - k]), np.asarray(b[k - 1, :, :S - 1 - k]),
                                   atol=1e-6)
        assert not np.allclose(np.asarray(a[k - 1, :, S - 1 - k]), np.asarray(b[k - 1, :, S - 1 - k]))


def test_mtp_loss_predicts_the_token_k_plus_one_ahead():
    """A loop over positions: depth k at position i is scored on token i + k + 1 (targets[i + k]) with that
    target's weight; positions whose target is past the sequence are left out."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((D, B, S, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (B, S))
    weights = rng.integers(0, 2, (B, S)).astype(np.float32)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    per_depth = []
    for k in range(1, D + 1):
        num = den = 0.0
        for b in range(B):
            for i in range(S - k):
                num -= weights[b, i + k] * logp[k - 1, b, i, targets[b, i + k]]
                den += weights[b, i + k]
        per_depth.append(num / den)
    got = mtp_loss(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    assert float(got) == pytest.approx(np.mean(per_depth), rel=1e-5)


def _losses_and_grads(model, batch, recipe, grad_accum=1):
    model.set_recipe(recipe)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def f(params):
        m = nnx.merge(graphdef, params, rest, copy=True)
        loss, lm, extra, aux, grads = train_step.loss_and_grads(m, batch, aux_loss=FAMILY.aux_loss,
                                                                grad_accum=grad_accum)
        return loss, lm, extra["mtp"], aux, grads   # the MTP module is the model's extra head "mtp"
    return jax.jit(f)(params)


@pytest.fixture(scope="module")
def reference(model, batch):
    return _losses_and_grads(model, batch, RECIPES["none"])


def test_total_loss_is_main_plus_lambda_mtp_plus_balance(model, batch, forward, reference):
    loss, lm, mtp, aux, grads = reference
    tokens = batch["tokens"]
    logits, out = forward(model, tokens[:, :-1])
    assert float(lm) == pytest.approx(float(train_step.next_token_loss(logits, tokens[:, 1:], batch["weights"])))
    assert float(mtp) == pytest.approx(float(mtp_loss(out["mtp_logits"], tokens[:, 1:], batch["weights"])))
    balance = float(FAMILY.aux_loss(CFG, aux))
    assert balance > 0 and float(loss) == pytest.approx(float(lm) + CFG.mtp_lambda * float(mtp) + balance, rel=1e-6)
    for part in ("heads", "layers"):   # the MTP loss trains the MTP module
        assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads["mtp"][part])), part


@pytest.mark.slow
def test_micro_batches_add_up_to_the_batch(model, batch, reference):
    loss, lm, mtp, _, grads = _losses_and_grads(model, batch, RECIPES["none"], grad_accum=2)
    assert [float(x) for x in (loss, lm, mtp)] == pytest.approx([float(x) for x in reference[:3]], rel=1e-5)
    assert max_rel_err(grads, reference[4]) < 1e-5


@pytest.mark.parametrize("name", tiered([n for n in PLAIN if n != "none"], fast=("mla_moe_offload",)))
def test_gradients_equal_under_every_recipe(model, batch, reference, name):
    loss, _, mtp, _, grads = _losses_and_grads(model, batch, RECIPES[name])
    assert abs(float(loss) - float(reference[0])) < 1e-6 and abs(float(mtp) - float(reference[2])) < 1e-6
    assert max_rel_err(grads, reference[4]) < 1e-5


# the default set keeps the study's offload recipe; the other recipes are further cases (slow set, docs/testing.md)
@pytest.mark.parametrize("name", tiered([n for n in PLAIN if RECIPES[n].special is None], fast=("mla_moe_offload",)))
def test_mtp_layers_place_their_tags_as_the_recipe_says(model, batch, name):
    """In the stack the planner measures, and in the training loss itself: each offloaded tag the MTP layers need
    is on the host once per depth (the depths run one by one, unstacked)."""
    recipe = RECIPES[name]
    model.set_recipe(recipe)
    needed = measure.residual_tags(model, "mtp")
    seen = measure.placements_seen(model, "mtp", B, S)
    assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}
    want = collections.Counter()
    for stack, st in model.tag_shapes(B, S).items():   # a scanned stack's residuals are stacked over its layers
        copies = [()] * st.num_layers if stack == "mtp" or st.num_layers == 1 else [(st.num_layers,)]
        needed = measure.residual_tags(model, stack)
        want.update(c + st.tags[t].shape for t in recipe.offload if t in needed for c in copies)
    graphdef, state = nnx.split(model)

    def only_mtp(state):   # the MTP loss alone still runs (and differentiates) the main layers under it
        _, aux = nnx.merge(graphdef, state, copy=True)(batch["tokens"][:, :-1], return_aux=True)
        return mtp_loss(aux["mtp_logits"], batch["tokens"][:, 1:], batch["weights"])
    res = measure.residuals(only_mtp, state)
    assert collections.Counter(r.shape for r in res if r.host) == want


def test_parameter_counts_with_and_without_mtp():
    cfg = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    assert cfg.mtp_depths == 0 and cfg.mtp_lambda == 0.3
    off = nnx.eval_shape(lambda: zoo.models.deepseek_v3(cfg, rngs=nnx.Rngs(0)))
    on = nnx.eval_shape(lambda: zoo.models.deepseek_v3(dataclasses.replace(cfg, mtp_depths=1), rngs=nnx.Rngs(0)))
    assert zoo.models.count_params(off) == 671_026_419_200
    assert zoo.models.count_params(on) == 682_636_487_424
    assert zoo.models.count_params(on.mtp.layers) == 11_507_286_272   # one MoE layer, its routing bias included
    assert zoo.models.count_params(on.mtp.heads) == 2 * 7168 * 7168 + 3 * 7168
    assert on.config.without_mtp() == cfg


@pytest.mark.parametrize("change, field", [
    (dict(mtp_depths=-1), "DeepSeekV3Config.mtp_depths must be non-negative, got -1"),
    (dict(mtp_lambda=-0.1), "DeepSeekV3Config.mtp_lambda must be non-negative, got -0.1"),
    (dict(mtp_depths=1.5), "DeepSeekV3Config.mtp_depths must be an int"),
    (dict(mtp_lambda=float("nan")), "DeepSeekV3Config.mtp_lambda must be a finite number"),
])
def test_bad_mtp_configs_raise_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CFG, **change)


def test_the_mtp_loss_weight_is_zero_without_depths():
    """The MTP loss weighs nothing in a preset without MTP depths (tiny) and mtp_lambda with them (`--set` of the MTP
    fields: tests/train/test_cli.py)."""
    cls = zoo.models.DeepSeekV3Config
    assert cls.preset("tiny").mtp_loss_weight() == 0.0 and CFG.mtp_loss_weight() == 0.3
