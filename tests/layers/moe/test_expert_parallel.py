"""Dropless expert parallelism (`ep_dispatch="ragged_a2a"`): configuration errors, the auto backend it takes, the
planner's per-device tag shapes (the receive buffer), and, in subprocesses with 2 and 4 fake CPU devices
(tests/layers/moe/ep_steps.py), the dispatch against the one-device dropless result and a sharded training step."""
from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from tests.helpers import ROOT, cpu_env, fake_gpu, tiered
from zoo import sharding
from zoo.layers.moe import backend, expert_parallel
from zoo.plan import Parallelism, Training


@pytest.mark.parametrize("overrides, match", [
    (dict(ep_dispatch="alltoall"), r"ep_dispatch must be one of \('gather', 'ragged_a2a'\), got 'alltoall'"),
    (dict(ep_dispatch="ragged_a2a", moe_backend="capacity"), "ragged_a2a' is dropless expert parallelism"),
])
def test_bad_ep_dispatch_raises_before_building(overrides, match):
    with pytest.raises(ValueError, match=match):
        zoo.models.DeepSeekV3Config.preset("tiny", **overrides)


def test_auto_never_takes_capacity_under_ragged_a2a(monkeypatch):
    """On an NVIDIA GPU without tokamax, auto would take capacity dispatch (drops); under ragged_a2a it stays
    dropless (ragged_dot, and says why)."""
    monkeypatch.setattr(backend, "tokamax_status", lambda: (False, "tokamax does not import"))
    assert backend.backend_choice("auto", device=fake_gpu())[0] == "capacity"
    name, why = backend.backend_choice("auto", device=fake_gpu(), ep_dispatch="ragged_a2a")
    assert name == "ragged_dot" and "does not import" in why
    monkeypatch.setattr(backend, "tokamax_status", lambda: (True, "tokamax 0.0.17"))
    assert backend.backend_choice("auto", device=fake_gpu(), ep_dispatch="ragged_a2a")[0] == "tokamax"


def test_receive_rows_bound_every_copy_a_device_can_get():
    assert expert_parallel.receive_rows(tokens=4096, k=8, num_experts=32, ep=2) == 2 * 4096 * 8
    # 8 experts over ep=8: one expert a device, and a token's k=2 experts are distinct: at most one copy each.
    assert expert_parallel.receive_rows(tokens=16, k=2, num_experts=8, ep=8) == 8 * 16


@pytest.mark.parametrize("spec", ["ep=8", "fsdp=2,ep=4", "fsdp=8"])
def test_planner_counts_the_receive_buffer_per_device(spec):
    """Traced on an abstract 8-device mesh: the experts' tags are one device's receive buffer [receive_rows,
    moe_mlp] (per device, the ep group's copies: plan / (dp x fsdp)); the attention tags split over every batch
    shard as under capacity dispatch. With no ep axis (fsdp=8) each device runs its own copies (plan / 8)."""
    cfg = zoo.models.DeepSeekV3Config.preset("tiny", ep_dispatch="ragged_a2a")
    m = nnx.eval_shape(lambda: zoo.models.deepseek_v3(cfg, rngs=nnx.Rngs(0)))
    mesh = sharding.abstract_mesh(spec, 8)
    ep = sharding.mesh_sizes(mesh)["ep"]
    per_device = sharding.tag_shard_shapes(m, 8, 16, mesh)["moe_layers"]
    one = m.tag_shapes(8, 16)["moe_layers"].tags
    rows = expert_parallel.receive_rows(8 * 16 // 8, cfg.num_experts_per_tok, cfg.num_experts, ep)
    assert per_device["moe_mlpwi_0"] == per_device["moe_mlpwi_1"] == (rows, cfg.moe_mlp_dim)
    assert per_device["moe_mlpwo"] == (rows, cfg.dim)
    assert one["moe_mlpwi_0"].shape == (8 * 16 * cfg.num_experts_per_tok, cfg.moe_mlp_dim)
    assert per_device["query_proj"][0] * 8 == one["query_proj"].shape[0]
    # The plan of the study's recipe offloads the two receive-buffer tags at these per-device bytes.
    recipe = zoo.Recipe("mla_moe_offload", offload=("query_proj", "key_proj", "value_proj", "moe_mlpwi_0",
                                                    "moe_mlpwi_1"))
    plan = zoo.plan.plan(cfg, recipe, batch=8, seq=16, peak=None, parallel=Parallelism(mesh=spec),
                    training=Training(optimizer="sgd"))
    host = {t.tag: t.host_bytes for t in next(s for s in plan.stacks if s.name == "moe_layers").tags}
    assert host["moe_mlpwi_0"] == host["moe_mlpwi_1"] == rows * cfg.moe_mlp_dim * 4
    assert host["query_proj"] * 8 == math.prod(one["query_proj"].shape) * 4


def test_one_device_ragged_a2a_is_the_gather_path():
    """On a one-device mesh ragged_a2a runs as the dropless gather path (no shard_map): the same outputs."""
    from zoo.models.deepseek_v3 import deepseek_moe
    x = jax.random.normal(jax.random.key(1), (2, 8, 64), jnp.float32)
    out = []
    for d in ("gather", "ragged_a2a"):
        cfg = zoo.models.DeepSeekV3Config.preset("tiny", ep_dispatch=d)
        graphdef, state = nnx.split(deepseek_moe(cfg, rngs=nnx.Rngs(0)))
        with sharding.use(sharding.make_mesh()):
            out.append(jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s)(x)[0])(state, x))
    assert bool(jnp.array_equal(*out))


@pytest.mark.multidevice
@pytest.mark.parametrize("n", tiered([2, 4], fast=(2,)))
def test_ragged_a2a_on_fake_devices_equals_one_device(n):
    """N=2: the stand-in against jax's documented example; the dispatch under ep=2 equal to one device's to 1e-6
    (outputs and gradients, random routing and every copy to one device: XLA's CPU kernels block a dot by its row
    count, so a device's share rounds apart in the last bits); a DeepSeek-V3 tiny step under
    mla_moe_offload and ep=2 as one device's, its experts' tags offloaded inside the shard_map as the per-device
    receive buffer, ragged-all-to-alls in the step lowered for CUDA. N=4: the dispatch under ep=4 and fsdp=2 x ep=2
    (to 1e-6)."""
    out = subprocess.run([sys.executable, "-m", "tests.layers.moe.ep_steps", str(n)], env=cpu_env(n), cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-3000:] + out.stderr[-3000:]
    print(out.stdout)
