"""Run by tests/test_sharding.py in a subprocess with 8 fake CPU devices:
`python -m tests.sharded_steps llama|deepseek|stream`.

For each mesh: the model is created sharded (`zoo.sharding.create`), every parameter's sharding is checked against
the rules (and against Flax's own nnx resolution of the same rules), one float32 training step's loss and gradients
are compared with one device's, and the lowered CUDA program is read: every value moved to pinned host memory must
be the output of a sharding constraint with the expected mesh axes. Prints OK at the end.
"""
from __future__ import annotations

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import zoo
from tests.helpers import max_rel_err
from zoo import sharding
from zoo.layers.moe import moe_records, total_balance_loss

TOL = 1e-5



def loss_fn(graphdef, params, rest, tokens):
    logits, aux = nnx.merge(graphdef, params, rest, copy=True)(tokens, return_aux=True)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce = -jnp.mean(jnp.take_along_axis(logp, jnp.roll(tokens, -1, axis=1)[..., None], axis=-1))
    load = [a.load for a in moe_records(aux)]
    return ce + total_balance_loss(aux), load


def step(model):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, rest, t), has_aux=True)), params


def one_device(model, tokens):
    f, params = step(model)
    return jax.device_get(f(params, tokens))


def sharded(build, cfg, recipe, spec, tokens, want_host, all_to_all=False, ragged=False):
    """Build under `spec`, check parameter shardings, run the step, check the offloaded values' shardings (and,
    with `all_to_all`, that the compiled step moves token copies between devices with all-to-alls; with `ragged`,
    that the step lowered for CUDA does so with ragged-all-to-alls, forward and backward)."""
    mesh = sharding.make_mesh(spec)
    rules = sharding.rules_for(mesh)
    sharding.check_mesh(cfg, mesh, batch=tokens.shape[0])
    model = sharding.create(build, cfg, recipe=recipe, mesh=mesh, seed=0)
    check_parameters(model, build, cfg, mesh, rules)
    f, params = step(model)
    with sharding.use(mesh, rules):
        t = jax.device_put(tokens, sharding.batch_sharding(mesh))
        traced = f.trace(params, t)   # one trace: compiled for the CPU devices, lowered for CUDA to read
        compiled = traced.lower().compile()
        out = jax.device_get(compiled(params, t))
        cuda = traced.lower(lowering_platforms=("cuda",))
        text, hlo = cuda.as_text(), cuda.as_text(dialect="hlo") if ragged else ""
    got = offloaded_shardings(text)
    assert got == want_host, f"{spec}: offloaded values {got}, expected {want_host}"
    if all_to_all:  # forward dispatch, combine, and their transposes in the backward pass
        n = compiled.as_text().count(" all-to-all(")
        assert n >= 2, f"{spec}: {n} all-to-alls in the compiled step"
    if ragged:  # dispatch and return, and their transposes
        n = hlo.count(" ragged-all-to-all(")
        assert n >= 4, f"{spec}: {n} ragged-all-to-alls in the step lowered for CUDA"
    return out


def check_parameters(model, build, cfg, mesh, rules):
    """Each variable's sharding is the rules' (flax's priority resolution, and nnx's own under the same rules);
    a spec with no mesh axis only where every logical axis of it is replicated by rule; the device shards split."""
    rule = dict(rules)
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        _, nnx_abstract = nnx.get_abstract_model(lambda: build(cfg, rngs=nnx.Rngs(0)), mesh)
    nnx_specs = {k: v.get_value().sharding.spec for k, v in nnx.to_flat_state(nnx_abstract)}
    logical = {k: v.get_value() for k, v in nnx.to_flat_state(sharding.logical_specs(nnx.state(model)))}
    for path, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        spec = value.sharding.spec
        want = nn.logical_to_mesh_axes(tuple(logical[path]), rules)
        assert P(*spec) == P(*want) == P(*nnx_specs[path]), (path, spec, want, nnx_specs[path])
        if all(a is None for a in want):
            assert all(rule[n] is None for n in logical[path]), (path, logical[path])
        shards = np.prod([mesh.shape[a] for axes in want if axes for a in ((axes,) if isinstance(axes, str) else axes)])
        assert {s.data.size for s in value.addressable_shards} == {value.size // shards}, path


def check_optimizer_state(cfg):
    """`sharding.init` of (model, AdamW): the moments are sharded like their parameters (fsdp=4 x tp=2)."""
    import optax
    mesh = sharding.make_mesh("fsdp=4,tp=2")

    def make():
        model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    model, opt = sharding.init(make, mesh)
    params = {k: v.get_value().sharding.spec for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    for moment in ("mu", "nu"):
        got = {k[3:]: v.get_value().sharding.spec for k, v in nnx.to_flat_state(nnx.state(opt))
               if k[:3] == ("opt_state", 0, moment)}
        assert got == params, (moment, got, params)
    assert params[("layers", "layers", "mlp", "up_proj", "kernel")] == P(None, "fsdp", "tp")


DEF = re.compile(r"^\s*(%[\w#]+) = sdy\.sharding_constraint (%[\w#]+) <@\w+, \[(.*)\]> : (tensor<[^>]+>)")
TO_HOST = re.compile(r"@annotate_device_placement\((%[\w#]+)\).*pinned_host.*-> (tensor<[^>]+>)")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def offloaded_shardings(text: str) -> dict[str, str]:
    """{tensor type: mesh axes per dim} of every value moved to pinned host memory, read from the operand's
    definition: it must be a sharding constraint (else the value is reported as 'unconstrained'), or the value is
    one device's, moved inside a `shard_map` ('manual')."""
    lines = text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = TO_HOST.search(line)
        if not m:
            continue
        operand, ty = m.groups()
        spec = "unconstrained"
        enclosing = next((p for p in reversed(lines[:i]) if _indent(p) < _indent(line)), "")
        if "sdy.manual_computation" in enclosing:
            out.setdefault(ty, set()).add("manual")
            continue
        for prev in reversed(lines[:i]):
            if prev.strip().startswith(operand + " "):
                d = DEF.match(prev)
                if d:
                    dims = re.findall(r"\{([^}]*)\}", d.group(3))
                    spec = "[" + ",".join(" ".join(a.strip().strip('"') for a in dim.split(",") if a.strip())
                                          for dim in dims) + "]"
                break
        out.setdefault(ty, set()).add(spec)
    return {k: "|".join(sorted(v)) for k, v in out.items()}


def compare(name, got, want):
    (loss, aux), grads = got
    (loss0, aux0), grads0 = want
    err = max_rel_err(grads, grads0)
    print(f"{name}: loss {float(loss):.7f} (one device {float(loss0):.7f}), max gradient rel. error {err:.2e}")
    assert abs(float(loss) - float(loss0)) <= TOL * abs(float(loss0)), (loss, loss0)
    assert err < TOL, err
    for a, b in zip(aux, aux0):  # the expert load (routing-bias update input) is global: as on one device
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def llama():
    from recipes.llama3 import RECIPES
    cfg = zoo.models.LlamaConfig.preset("tiny")
    recipe = RECIPES["qkv_offload"]
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, cfg.vocab_size, dtype=jnp.int32)
    ref = one_device(zoo.models.llama3(cfg, recipe=recipe, rngs=nnx.Rngs(0)), tokens)
    # tensor<B x S x heads x head_dim>: q [8,16,4,16], k and v [8,16,2,16]; batch over the data axes, heads over tp.
    check_optimizer_state(cfg)
    for spec, host in [("fsdp=8", {"tensor<8x16x4x16xf32>": "[fsdp,,,]", "tensor<8x16x2x16xf32>": "[fsdp,,,]"}),
                       ("fsdp=4,tp=2",
                        {"tensor<8x16x4x16xf32>": "[fsdp,,tp,]", "tensor<8x16x2x16xf32>": "[fsdp,,tp,]"}),
                       ("dp=4,tp=2", {"tensor<8x16x4x16xf32>": "[dp,,tp,]", "tensor<8x16x2x16xf32>": "[dp,,tp,]"})]:
        compare(spec, sharded(zoo.models.llama3, cfg, recipe, spec, tokens, host), ref)
    # each group's first layer offloading the kernel's pair: its output [8,16,4,16] and statistics [8,4,16] leave as
    # batch/heads-sharded values, one layer in two
    cfg = dataclass_replace(cfg, num_layers=4)
    pair = ("attention_out", "context")
    recipe = zoo.Recipe("lead", device=("decoder_layer_input",), group=2, group_keep=pair, lead_offload=pair)
    ref = one_device(zoo.models.llama3(cfg, recipe=recipe, rngs=nnx.Rngs(0)), tokens)
    compare("fsdp=4,tp=2 lead_offload", sharded(zoo.models.llama3, cfg, recipe, "fsdp=4,tp=2", tokens,
                                                {"tensor<8x16x4x16xf32>": "[fsdp,,tp,]",
                                                 "tensor<8x4x16xf32>": "[fsdp,tp,]"}), ref)


def deepseek():
    from recipes.deepseek_v3 import RECIPES
    recipe = RECIPES["mla_moe_offload"]
    # capacity_factor 4: every copy fits (k=2 distinct experts per token), so capacity dispatch drops nothing and
    # equals the dropless reference on one device.
    cfg = zoo.models.DeepSeekV3Config.preset("tiny", moe_backend="capacity", capacity_factor=4.0)
    tokens = jax.random.randint(jax.random.key(1), (8, 8), 0, cfg.vocab_size, dtype=jnp.int32)
    ref = one_device(zoo.models.deepseek_v3(cfg, recipe=recipe, rngs=nnx.Rngs(0)), tokens)
    qkv = {"tensor<8x8x4x24xf32>", "tensor<8x8x4x16xf32>"}  # query/key [B,S,H,24], value [B,S,H,16]
    # The capacity buffers [experts, groups x capacity, moe_mlp]: 8 groups (one per batch shard) of C = 8 each.
    ragged_cfg = dataclass_replace(cfg, moe_backend="ragged_dot")
    # Dropless (one dispatch group) under fsdp x tp: the sorted copies [B*S*k, moe_mlp] whole over the batch.
    compare("fsdp=4,tp=2 ragged_dot", sharded(zoo.models.deepseek_v3, ragged_cfg, recipe, "fsdp=4,tp=2", tokens,
                                              {**{t: "[fsdp,,tp,]" for t in qkv}, "tensor<128x40xf32>": "[,tp]"}),
            ref)
    compare("ep=8 capacity", sharded(zoo.models.deepseek_v3, cfg, recipe, "ep=8", tokens,
                                     {**{t: "[ep,,,]" for t in qkv}, "tensor<8x64x40xf32>": "[ep,,]"},
                                     all_to_all=True), ref)
    compare("fsdp=2,ep=4 capacity", sharded(zoo.models.deepseek_v3, cfg, recipe, "fsdp=2,ep=4", tokens,
                                            {**{t: "[fsdp ep,,,]" for t in qkv},
                                             "tensor<8x64x40xf32>": "[ep,fsdp,]"}, all_to_all=True), ref)


def stream():
    """--params stream under fsdp=8: the step's loss and updated state as on one device with the same placement (the
    state to a few ulp, `tests/rounding.py`); the stacks' parameters stay in pinned host memory, split over fsdp like
    the rules split them in HBM."""
    from tests.rounding import assert_same_state
    from tests.test_params_stream import _arrays, _step
    from zoo.opt_state import HOST
    want, want_metrics = _step("llama3", "stream", rows=8)
    mesh = sharding.make_mesh("fsdp=8")
    got, metrics = _step("llama3", "stream", mesh=mesh, rows=8)
    err = max_rel_err(_arrays(got), _arrays(want))
    print(f"stream fsdp=8: loss {float(metrics['loss']):.7f} (one device {float(want_metrics['loss']):.7f}), "
          f"max state rel. error {err:.2e}")
    assert abs(float(metrics["loss"]) - float(want_metrics["loss"])) <= TOL * abs(float(want_metrics["loss"]))
    # The sharded reductions add in another order: jax 0.12's CPU build rounds some bf16 parameters an ulp apart
    assert_same_state(want, got)
    hosted = [(jax.tree_util.keystr(p), x.sharding) for p, x in jax.tree_util.tree_flatten_with_path(got[0])[0]
              if x.sharding.memory_kind == HOST]
    assert hosted and all("['layers']['layers']" in k for k, _ in hosted), hosted
    assert any("fsdp" in str(s.spec) for _, s in hosted), hosted   # split over the devices' host memories


def dataclass_replace(cfg, **kw):
    import dataclasses
    return dataclasses.replace(cfg, **kw)


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    {"llama": llama, "deepseek": deepseek, "stream": stream}[sys.argv[1]]()
    print("OK")
