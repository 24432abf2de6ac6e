"""`--params stream` (`zoo.opt_state`, `zoo.models.stack.in_hbm`, `zoo.streamed_update`): the decoder stacks' bf16
parameters in pinned host memory, each layer's slice brought into HBM inside the scan. Checked on the CPU, which has
the pinned_host memory kind: a step gives the numbers of the same step with the parameters in HBM (`--params host`:
the same master and moments on the host), for every family; the stacks' parameters stay on the host and nothing
else moves there; the gradients' norm and finiteness read host leaves a slice at a time; the planner counts the
streamed bytes and their copies; the refusals. A sharded mesh: `tests/sharded_steps.py stream` (8 fake devices,
run by `tests/test_sharding.py`)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from tests import tiny_lm
from tests.helpers import max_rel_err
from zoo import sharding
from zoo import streamed_update as su
from zoo.models.registry import family
from zoo.opt_state import HOST, check_params, is_master
from zoo.optim import lr_schedule, make_optimizer
from zoo.train_step import abstract_step, all_finite
from zoo.training import Training

SCHEDULE = lr_schedule(lr=1e-3, steps=100, warmup=1)
FAMILIES = ("llama3", "qwen3", "deepseek_v3", "qwen3_moe")


def _config(name: str, **fields):
    """(family, its tiny config with bf16 parameters and `fields` replaced); Llama's the two-layer model of
    tests/tiny_lm.py."""
    fam = family(name)
    cfg = tiny_lm.config("bfloat16") if name == "llama3" else dataclasses.replace(fam.config("tiny"),
                                                                                   param_dtype="bfloat16")
    return fam, dataclasses.replace(cfg, **fields)


def _step(name: str, params: str, recipe=None, mesh=None, rows: int = 2, **fields):
    """(new state, metrics) of one AdamW step of family `name`'s tiny preset (bf16 parameters, float32 master and
    bf16 moments on the host; `fields` replaced in its config) with the parameters placed by `params`, from the same
    weights and tokens (`rows` sequences), on `mesh` (None: one device)."""
    fam, cfg = _config(name, **fields)
    recipe = recipe or zoo.Recipe.full()
    training = Training(opt_state="host", params=params, opt_dtype="bfloat16", weight_decay=0.1)
    step, _, state = abstract_step(fam, cfg, recipe, training=training, schedule=SCHEDULE, mesh=mesh)
    model = fam.build(cfg, recipe=recipe, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.1, opt_dtype="bfloat16", master=True)
    concrete = jax.tree.map(lambda c, a: jax.device_put(c, a.sharding), nnx.split((model, opt))[1], state)
    tokens = jax.random.randint(jax.random.key(1), (rows, 17), 0, cfg.vocab_size, dtype=jnp.int32)
    batch = {"tokens": tokens, "weights": jnp.ones((rows, 16), jnp.float32)}
    if mesh is None:
        return step(concrete, batch)
    batch = {k: jax.device_put(v, sharding.batch_sharding(mesh, ndim=2)) for k, v in batch.items()}
    with sharding.use(mesh):
        return step(concrete, batch)


def _arrays(state) -> list[np.ndarray]:
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(state)]


def _kinds(state) -> dict[str, str]:
    return {jax.tree_util.keystr(p): x.sharding.memory_kind for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}


GROUPED = zoo.Recipe("grouped", offload=("decoder_layer_input",), group=2, group_keep=("attention_out", "context"))


def _check_same_step(name: str, recipe=None, **fields):
    host_state, host_metrics = _step(name, "host", recipe, **fields)
    new, metrics = _step(name, "stream", recipe, **fields)
    assert float(metrics["loss"]) == float(host_metrics["loss"]) and bool(metrics["ok"])
    assert abs(float(metrics["grad_norm"]) - float(host_metrics["grad_norm"])) <= 1e-2 * float(
        host_metrics["grad_norm"])   # float32 sums of squares here, the gradients' own dtype in optax's
    assert max_rel_err(_arrays(new), _arrays(host_state)) <= 1e-5
    stacked = {k for k, kind in _kinds(new).items() if kind == HOST and k.startswith("[0]")}
    assert stacked and all("layers" in k for k in stacked), stacked
    for path, x in jax.tree_util.tree_flatten_with_path(new)[0]:   # the rest where --params host puts it
        want = host_state
        for k in path:
            want = want[k.key] if hasattr(k, "key") else getattr(want, k.name)
        if jax.tree_util.keystr(path) not in stacked:
            assert x.sharding.memory_kind == want.sharding.memory_kind, jax.tree_util.keystr(path)


def test_a_streamed_step_is_the_step_with_the_parameters_in_hbm():
    """Llama under two-level groups (group 2, the kernel's pair kept within groups) with the layer input offloaded:
    loss and every updated array (bf16 parameters, float32 master, bf16 moments) as under --params host; the
    stacks' parameters live in pinned host memory after the step, and every other leaf where it was."""
    _check_same_step("llama3", GROUPED)


@pytest.mark.slow
def test_query_tiles_stream_to_the_same_numbers():
    """Llama with attention over 4 query tiles, its layer input offloaded in groups of 2: the streamed step is the
    step with the parameters in HBM."""
    _check_same_step("llama3", zoo.Recipe("carry", offload=("decoder_layer_input",), group=2), attention_tiles=4)


@pytest.mark.slow
def test_a_groups_first_layer_offloading_the_pair_streams_to_the_same_numbers():
    """Llama's 4 layers in groups of 2 (a scan of two groups), the layer input in HBM, each group's first layer
    offloading the kernel's pair (the structure `auto` chooses at 524,288 tokens with streamed parameters): the
    streamed step is the step with the parameters in HBM."""
    pair = ("attention_out", "context")
    _check_same_step("llama3", zoo.Recipe("lead", device=("decoder_layer_input",), group=2, group_keep=pair,
                                          lead_offload=pair), num_layers=4)


@pytest.mark.slow   # the default set streams Llama's
@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_streams_to_the_same_numbers(name):
    """Each family's tiny preset under full remat: Llama, Qwen3, DeepSeek-V3 (a dense and a MoE stack, MLA, its
    router bias left in HBM) and Qwen3-MoE."""
    _check_same_step(name)


def test_norm_and_finiteness_read_host_leaves_a_slice_at_a_time():
    """`global_norm` and `all_finite` over a tree with a [3, 4, 4] leaf in pinned host memory: optax's norm and
    jnp's finiteness of the same values, under jit; a NaN in the last slice is found."""
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=HOST)
    values = {"stack": jnp.arange(48, dtype=jnp.float32).reshape(3, 4, 4) / 10, "head": jnp.ones((5,))}
    tree = {"stack": jax.device_put(values["stack"], host), "head": values["head"]}
    norm = jax.jit(su.global_norm)(tree)
    assert abs(float(norm) - float(jnp.sqrt(sum(jnp.sum(v ** 2) for v in values.values())))) < 1e-5
    assert bool(jax.jit(all_finite)(tree))
    bad = {"stack": jax.device_put(values["stack"].at[2, 3, 3].set(jnp.nan), host), "head": values["head"]}
    assert not bool(jax.jit(all_finite)(bad))


def test_the_planner_counts_the_streamed_parameters_and_their_copies():
    """The 8B at 128K under full remat: --params stream moves the stacks' bf16 parameters and gradients (2 bytes a
    parameter each) from HBM to pinned host memory, less one layer's of each in flight (two with groups of 2), and
    adds their copies to the predicted step time."""
    cfg = zoo.models.LlamaConfig.preset("llama3_1_8b", param_dtype="bfloat16", max_seq_len=131072)
    plans = {p: zoo.plan.plan(cfg, zoo.Recipe.full(), batch=1, seq=131072, peak=None,
                              training=Training(opt_state="host", params=p, opt_dtype="bfloat16"),
                              hardware=zoo.plan.Hardware(device_kind="H200", hbm_gib=132.8))
             for p in ("host", "stream")}
    host, stream = plans["host"].state, plans["stream"].state
    per_layer = 2 * (3 * 4096 * 14336 + 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 4096)   # bf16 bytes of one layer
    assert stream.streamed == 32 * per_layer and stream.streamed_window == 2 * per_layer
    assert host.total - stream.total == 2 * 32 * per_layer - 2 * per_layer
    assert stream.host - host.host == 2 * 32 * per_layer
    assert plans["stream"].step_time()["exposed_transfer_s"] > plans["host"].step_time()["exposed_transfer_s"]
    grouped = zoo.plan.plan(cfg, dataclasses.replace(zoo.Recipe.full(), group=2), batch=1, seq=131072, peak=None,
                            training=Training(opt_state="host", params="stream", opt_dtype="bfloat16"))
    assert grouped.state.streamed_window == 2 * stream.streamed_window


def test_streamed_parameters_refuse_what_they_cannot_serve():
    with pytest.raises(ValueError, match=r"params='stream' \(--params stream\) with grad_accum=2"):
        Training(params="stream", grad_accum=2)
    with pytest.raises(ValueError, match="--params stream keeps a float32 master copy of 16-bit parameters.*"
                                         "param_dtype=bfloat16"):
        check_params("stream", "float32")
    fam, cfg = _config("llama3")
    with pytest.raises(ValueError, match="--params stream places the optimizer's float32 master copy"):
        zoo.opt_state.state_shardings(*_state_and_shardings(fam, cfg, master=False), params="stream")


def _state_and_shardings(fam, cfg, master: bool):
    def make():
        model = fam.build(cfg, recipe=zoo.Recipe.full(), rngs=nnx.Rngs(0))
        return model, make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.0, master=master)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        state = nnx.split(nnx.eval_shape(make))[1]
    return state, sharding.shardings(state, sharding.make_mesh(None, jax.devices()[:1]))


def test_only_the_stacks_parameters_are_placed_on_the_host():
    """state_shardings under --params stream: the stacks' Params and the whole master on the host; the embedding,
    the final norm and the head stay in HBM."""
    fam, cfg = _config("llama3")
    state, shardings = _state_and_shardings(fam, cfg, master=True)
    placed = zoo.opt_state.state_shardings(state, shardings, params="stream")
    for path, s in jax.tree_util.tree_flatten_with_path(placed)[0]:
        where = jax.tree_util.keystr(path)
        if path[0].key == 0:
            assert (s.memory_kind == HOST) == ("['layers']['layers']" in where), where
        elif is_master(path):
            assert s.memory_kind == HOST, where


def test_a_users_own_step_runs_over_parameters_in_host_memory():
    """A user's functional step (`nnx.split` of the parameters and the rest around `jax.jit`, their own loss and
    `jax.value_and_grad`) over Llama with its stacks' parameters placed in pinned host memory by
    `zoo.opt_state.streamed`: the loss and gradients of the same step with every parameter in HBM (the layers bring
    their slices in themselves), and each streamed parameter's gradient made in pinned host memory."""
    fam, cfg = _config("llama3")
    model = fam.build(cfg, recipe=GROUPED, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=HOST)
    placed = jax.tree.map(lambda v: v.replace(jax.device_put(v[...], host)) if zoo.opt_state.streamed(v) else v,
                          params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size, dtype=jnp.int32)

    @jax.jit
    def loss_and_grads(params, rest, tokens):
        def loss(params):
            logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1]).astype(jnp.float32)
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))
        return jax.value_and_grad(loss)(params)

    want_loss, want = loss_and_grads(params, rest, tokens)
    got_loss, got = loss_and_grads(placed, rest, tokens)
    assert float(got_loss) == float(want_loss)
    assert max_rel_err(_arrays(got), _arrays(want)) <= 1e-5
    on_host = {k for k, kind in _kinds(got).items() if kind == HOST}
    assert on_host == {k for k, kind in _kinds(placed).items() if kind == HOST} and on_host, _kinds(got)
    assert all("layers" in k for k in on_host)
