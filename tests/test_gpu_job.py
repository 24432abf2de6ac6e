"""The GPU user's job, checked on the CPU: the nested-loop guard of zoo.tags in both directions, host offload with a
loop-holding grouped matmul inside the MoE layer (a stand-in for tokamax's kernel), the choice of attention kernel
and MoE backend per device, and the main job's dropped-copy accounting."""
import collections
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

import zoo
from recipes.deepseek_v3 import RECIPES
from tests.helpers import cuda_lowering, hlo_type, pinned_host_shapes
from zoo import tags
from zoo.layers import attention
from zoo.layers.moe import MoEAux
from zoo.layers.moe import dispatch as moe
from zoo.plan import measure as audit

X = jnp.ones((4, 3))


# -- the guard: a loop is refused only when it holds a tag or an offload ----------------------------------------
def _with_inner_scan(body):
    def f(x):
        y = tags.name(x * 2.0, "mlpwi_0")
        c, _ = jax.lax.scan(body, jnp.zeros(3), y)
        return c
    return f


def test_a_loop_without_tags_or_offloads_is_allowed():
    got = tags.emitted(_with_inner_scan(lambda c, a: (c + jnp.sin(a), None)), X)
    assert list(got) == ["mlpwi_0"] and got["mlpwi_0"].shape == (4, 3)


def test_a_loop_holding_a_tag_is_refused():
    with pytest.raises(ValueError, match="scan whose body holds the tag 'mlpwi_1'"):
        tags.emitted(_with_inner_scan(lambda c, a: (c + checkpoint_name(a, "mlpwi_1"), None)), X)


def test_a_loop_holding_a_tag_deeper_down_is_refused():
    def body(c, a):
        inner = jax.jit(lambda v: jax.lax.fori_loop(0, 2, lambda i, w: w + checkpoint_name(w, "mlpwo"), v))
        return c + inner(a), None
    with pytest.raises(ValueError, match="holds the tag 'mlpwo'"):
        tags.emitted(_with_inner_scan(body), X)


def test_a_loop_holding_an_offload_is_refused():
    def body(c, a):
        back = jax.device_put(jax.device_put(a, jax.memory.Space.Host), jax.memory.Space.Device)
        return c + back, None
    with pytest.raises(ValueError, match="offload to host memory"):
        tags.emitted(_with_inner_scan(body), X)


# -- a loop-holding grouped matmul inside the MoE layer: offload lands where planned ---------------------------
def scan_grouped_matmul(rows, weights, group_sizes):
    """A stand-in for tokamax's kernel: `jax.lax.ragged_dot`'s contract computed by a scan over the experts (each
    step multiplies the rows of its group), with no tag and no offload inside, as tokamax's jaxpr has."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    row = jnp.arange(rows.shape[0])

    def step(acc, e):
        mine = ((row >= starts[e]) & (row < ends[e]))[:, None]
        return acc + jnp.where(mine, rows @ weights[e], 0).astype(acc.dtype), None

    out, _ = jax.lax.scan(step, jnp.zeros((rows.shape[0], weights.shape[-1]), rows.dtype),
                          jnp.arange(weights.shape[0]))
    return out


@pytest.fixture
def scan_backend(monkeypatch):
    """moe_backend='tokamax' served by the scan stand-in (whether or not tokamax is installed)."""
    monkeypatch.setitem(moe.GROUPED_MATMULS, "tokamax", lambda: scan_grouped_matmul)
    monkeypatch.setattr(moe, "tokamax_status", lambda: (True, "scan stand-in"))


def _stand_in_op_for(problem, k, n):
    """The three problems of `zoo.layers.grouped_matmul.make` as the GPU runs them, on the CPU: the forward and the
    rows' gradient through the looping stand-in, the experts' gradient as a ragged contraction."""
    if problem == "drhs":
        return lambda lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers: jax.lax.ragged_dot_general(
            lhs, rhs, group_sizes, ragged_dot_dimension_numbers)
    return lambda lhs, rhs, *, group_sizes: scan_grouped_matmul(lhs, rhs, group_sizes)


@pytest.fixture
def tiled_backend(monkeypatch):
    """moe_backend='tokamax' as it runs on the H200 with measured tiles: `grouped_matmul.make`'s custom VJP, each
    problem a looping stand-in for the kernel."""
    from zoo.layers import grouped_matmul
    monkeypatch.setitem(moe.GROUPED_MATMULS, "tokamax", lambda: grouped_matmul.make(_stand_in_op_for))
    monkeypatch.setattr(moe, "tokamax_status", lambda: (True, "custom-VJP stand-in"))


CFG = zoo.models.DeepSeekV3Config.preset("tiny")
B, S = 2, 8
STACKS = ("dense_layers", "moe_layers")


def test_the_stand_in_equals_ragged_dot_and_really_loops():
    rows = jax.random.normal(jax.random.key(0), (12, 5))
    w = jax.random.normal(jax.random.key(1), (3, 5, 4))
    sizes = jnp.array([5, 0, 7], jnp.int32)
    np.testing.assert_allclose(np.asarray(scan_grouped_matmul(rows, w, sizes)),
                               np.asarray(jax.lax.ragged_dot(rows, w, sizes)), rtol=1e-5, atol=1e-5)
    assert "scan[" in str(jax.make_jaxpr(scan_grouped_matmul)(rows, w, sizes))


@pytest.mark.parametrize("backend", ["scan_backend", "tiled_backend"])
@pytest.mark.parametrize("name", ["mla_moe_offload", "lowrank_wa_offload"])
def test_offload_lands_as_planned_with_a_looping_grouped_matmul(backend, name, request):
    request.getfixturevalue(backend)
    recipe = RECIPES[name]
    model = zoo.models.deepseek_v3(dataclasses.replace(CFG, moe_backend="tokamax"), recipe=recipe, rngs=nnx.Rngs(0))
    # the MoE layer really holds a loop now, and the guard lets it through
    graphdef, state = model.moe_layers.abstract_layer()
    x = jax.ShapeDtypeStruct((B, S, CFG.dim), jnp.float32)
    assert "scan[" in str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x))(state, x))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)
    want_host, want_hlo = collections.Counter(), collections.Counter()
    for stack in STACKS:
        needed = audit.residual_tags(model, stack)
        seen = audit.placements_seen(model, stack, B, S)
        assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}, stack
        st = model.tag_shapes(B, S)[stack]
        offloaded = [t for t in recipe.offload if t in needed]
        assert stack == "dense_layers" or {"moe_mlpwi_0", "moe_mlpwi_1"} <= set(offloaded)
        want_host.update((st.num_layers,) + st.tags[t].shape for t in offloaded)
        want_hlo.update(hlo_type(st.tags[t].shape, st.tags[t].dtype) for t in offloaded)
    res = audit.model_residuals(model, tokens)
    assert collections.Counter(r.shape for r in res if r.host) == want_host
    assert pinned_host_shapes(cuda_lowering(model, tokens)) == want_hlo


@pytest.mark.parametrize("backend", ["scan_backend", "tiled_backend"])
def test_the_stand_in_backend_matches_ragged_dot_in_the_model(backend, request):
    """Outputs, and for the custom-VJP path every gradient, equal the ragged_dot backend's."""
    request.getfixturevalue(backend)
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)
    ref = zoo.models.deepseek_v3(CFG, rngs=nnx.Rngs(0))
    got = zoo.models.deepseek_v3(dataclasses.replace(CFG, moe_backend="tokamax"), rngs=nnx.Rngs(0))
    forward = nnx.jit(lambda m: m(tokens))   # compiled: op-by-op dispatch through the scan is the slow part
    np.testing.assert_allclose(np.asarray(forward(got)), np.asarray(forward(ref)), rtol=1e-5, atol=1e-5)
    if backend == "tiled_backend":
        grad = nnx.jit(nnx.grad(lambda m: jnp.sum(m(tokens) ** 2)))
        g_ref, g_got = grad(ref), grad(got)
        for a, b in zip(jax.tree.leaves(g_ref), jax.tree.leaves(g_got)):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-5)


# -- choices per device -------------------------------------------------------------------------------------
def fake_gpu(cc="9.0", kind="NVIDIA H200"):
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc,
                                 client=types.SimpleNamespace(platform_version="PJRT C API\ncuda 13000"))


CPU = jax.devices()[0]


def test_attention_auto_takes_cudnn_on_a_gpu_for_gqa_and_mla():
    llama = zoo.models.LlamaConfig.preset("llama3_1_8b")
    ds = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    assert attention.kernel_head_dim(ds) == 192
    for cfg in (llama, ds):
        assert attention.resolve_impl(cfg, fake_gpu()).impl == "cudnn"
        assert attention.resolve_impl(cfg, CPU).impl == "xla"


def test_attention_auto_on_a_gpu_that_cudnn_cannot_serve_warns_of_quadratic_memory():
    ds = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    with pytest.warns(UserWarning, match="quadratic"):
        choice = attention.resolve_impl(ds, fake_gpu(cc="8.0", kind="NVIDIA A100"))  # 192 > 128 before Hopper
    assert choice.impl == "xla" and "QUADRATIC" in choice.reason
    with pytest.warns(UserWarning, match="float32"):
        assert attention.resolve_impl(zoo.models.LlamaConfig.preset("tiny"), fake_gpu()).impl == "xla"


def test_explicit_attention_choices_win_and_an_impossible_one_is_a_value_error():
    cfg = zoo.models.LlamaConfig.preset("llama3_1_8b", attention_impl="xla")
    assert attention.resolve_impl(cfg, fake_gpu()).impl == "xla"
    with pytest.raises(ValueError, match="attention_impl='cudnn' cannot run here: cuDNN runs only on NVIDIA"):
        attention.resolve_impl(zoo.models.LlamaConfig.preset("tiny", attention_impl="cudnn"), CPU)
    with pytest.raises(ValueError, match="cannot run here: cuDNN flash attention takes bf16/fp16"):
        attention.resolve_impl(zoo.models.LlamaConfig.preset("tiny", attention_impl="cudnn"), fake_gpu())


def test_a_built_model_says_which_attention_each_layer_runs():
    model = zoo.models.deepseek_v3(CFG, rngs=nnx.Rngs(0))
    got = attention.attention_impls(model)
    assert sorted(got) == ["dense_layers/layers/attn", "moe_layers/layers/attn"]
    assert {c.impl for c in got.values()} == {"xla"}


def test_the_main_job_refuses_cudnn_on_the_cpu_before_building(capsys):
    from recipes import train
    assert train.main(["--set", "attention_impl=cudnn", "--steps", "1", "--xla-flags", "none"]) == 2
    assert "attention_impl='cudnn' cannot run here" in capsys.readouterr().err


def test_moe_auto_backend_per_device(monkeypatch):
    assert moe.backend_choice("auto", device=CPU)[0] == "ragged_dot"
    monkeypatch.setattr(moe, "tokamax_status", lambda: (True, "tokamax 0.0.17"))
    assert moe.backend_choice("auto", dtype=jnp.bfloat16, device=fake_gpu())[0] == "tokamax"
    name, why = moe.backend_choice("auto", dtype=jnp.float32, device=fake_gpu())
    assert name == "capacity" and "bf16/fp16" in why
    monkeypatch.setattr(moe, "tokamax_status", lambda: (False, "tokamax does not import"))
    name, why = moe.backend_choice("auto", dtype=jnp.bfloat16, device=fake_gpu())
    assert name == "capacity" and "does not import" in why
    assert moe.backend_choice("capacity", device=fake_gpu())[0] == "capacity"  # explicit wins


# -- dropped copies in the main job ----------------------------------------------------------------------------
def test_moe_drops_sums_every_moe_stack():
    from recipes.loop import moe_drops
    moe_layers = MoEAux(load=jnp.ones((2, 8)) * 5, balance_loss=jnp.zeros(2), dropped=jnp.array([3, 4]))
    aux = {"dense_layers": {}, "moe_layers": moe_layers}
    dropped, routed = moe_drops(aux)
    assert (int(dropped), int(routed)) == (7, 80)
    assert tuple(map(int, moe_drops({"layers": {}}))) == (0, 0)


def test_the_main_job_logs_and_warns_about_dropped_copies(tmp_path):
    import json

    from rich.console import Console

    from recipes import loop
    out = tmp_path / "m.jsonl"
    console = Console(record=True, width=200)
    cfg = loop.RunConfig(model="deepseek_v3", preset="tiny", steps=2, batch=2, seq=16, log_every=1,
                         metrics=str(out), overrides=(("moe_backend", "capacity"), ("capacity_factor", 0.5)))
    loop.run(cfg, console=console)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["dropped"] > 0 and 0 < r["drop_fraction"] < 1 for r in rows)
    assert "capacity dispatch dropped" in console.export_text()
    quiet = Console(record=True, width=200)
    loop.run(loop.RunConfig(**{**cfg.__dict__, "max_drop_warn": 1.0, "metrics": None}), console=quiet)
    assert "capacity dispatch dropped" not in quiet.export_text()
