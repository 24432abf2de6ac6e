"""The planner under a mesh (`zoo.plan.plan(..., parallel=Parallelism(mesh=...))`): per-device figures from the
sharding rules on an abstract mesh (no devices: this runs on one CPU). (`python -m recipes.train.plan --mesh`:
tests/train/test_plan_cli.py.)

- fsdp=8: every parameter of the tiny Llama has an `embed` axis, so parameters, gradients and optimizer state are
  one device's / 8; the batch is split 8 ways, so saved activations and host bytes are one device's / 8.
- fsdp=4 x tp=2: q, k, v are split over batch (fsdp) and heads (tp): the offloaded bytes are one device's / 8;
  a norm scale has no tp axis, so parameters are more than one device's / 8 and at most / 4.
- DeepSeek-V3 under fsdp=2 x ep=4: the offloaded MoE buffers are split over experts and groups: host / 8; expert
  weights / 8, the other parameters / 2.
- The peak under a mesh: compiled (the sharded step, per device) when the mesh's devices are present
  (`tests/plan/mesh_peaks.py`, in a subprocess with 8 fake CPU devices; the main job's plan under fsdp=4 x tp=2:
  tests/train/test_mesh_train.py); on one CPU device, `peak="compile"` under a larger mesh is a ValueError naming
  the mesh's device count and the devices present, and "auto" estimates (on the CPU, as for one device).
"""
from __future__ import annotations

import subprocess
import sys

import jax
import pytest

import zoo
from recipes.deepseek_v3 import RECIPES as DS_RECIPES
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from tests.helpers import ROOT, cpu_env
from zoo.plan import Parallelism

LLAMA = zoo.models.LlamaConfig.preset("tiny")
DS = zoo.models.DeepSeekV3Config.preset("tiny", moe_backend="capacity", capacity_factor=4.0)


def test_fsdp8_divides_everything_by_8():
    r = LLAMA_RECIPES["qkv_offload"]
    one = zoo.plan.plan(LLAMA, r, batch=8, seq=16)
    eight = zoo.plan.plan(LLAMA, r, batch=8, seq=16, parallel=Parallelism(mesh="fsdp=8"))
    assert eight.mesh == "dp=1,fsdp=8,tp=1,ep=1" and eight.shard == 8
    for field in ("params", "grads", "optimizer"):
        assert getattr(eight.state, field) * 8 == getattr(one.state, field), field
    assert eight.state.num_params == one.state.num_params
    assert one.host_bytes > 0 and eight.host_bytes * 8 == one.host_bytes
    assert eight.activation_bytes * 8 == one.activation_bytes


def test_fsdp_x_tp_splits_qkv_8_ways_and_norm_scales_4_ways():
    r = LLAMA_RECIPES["qkv_offload"]
    one = zoo.plan.plan(LLAMA, r, batch=8, seq=16)
    mixed = zoo.plan.plan(LLAMA, r, batch=8, seq=16, parallel=Parallelism(mesh={"fsdp": 4, "tp": 2}))
    assert mixed.host_bytes * 8 == one.host_bytes
    assert one.state.params / 8 < mixed.state.params <= one.state.params / 4


def test_deepseek_fsdp_x_ep_host_bytes_are_the_plan_over_8():
    r = DS_RECIPES["mla_moe_offload"]
    one = zoo.plan.plan(DS, r, batch=8, seq=16)
    ep = zoo.plan.plan(DS, r, batch=8, seq=16, parallel=Parallelism(mesh="fsdp=2,ep=4"))
    assert one.host_bytes > 0 and ep.host_bytes * 8 == one.host_bytes
    assert one.state.params / 8 < ep.state.params < one.state.params / 2   # experts / 8, the rest / 2 (fsdp)


@pytest.mark.parametrize("mesh,match", [("tp=8", "tp=8 does not divide LlamaConfig.num_heads=4"),
                                        ("fsdp=16", "the batch 8 is not divisible by dp x fsdp x ep = 16"),
                                        ("pp=2", "unknown axis 'pp'")])
def test_bad_meshes_raise_naming_both_numbers(mesh, match):
    with pytest.raises(ValueError, match=match):
        zoo.plan.plan(LLAMA, LLAMA_RECIPES["full"], batch=8, seq=16, parallel=Parallelism(mesh=mesh))


def test_compile_under_a_mesh_larger_than_the_devices_present_raises_naming_both_numbers():
    n = 2 * jax.device_count()
    if LLAMA.dim % n:
        pytest.skip(f"{n} does not divide the tiny model's dim")
    with pytest.raises(ValueError, match=rf"mesh fsdp={n} needs {n} devices, but {n // 2} cpu device\(s\) are "
                                         rf"present"):
        zoo.plan.plan(LLAMA, LLAMA_RECIPES["full"], batch=n, seq=16, peak="compile",
                      parallel=Parallelism(mesh=f"fsdp={n}"))
    p = zoo.plan.plan(LLAMA, LLAMA_RECIPES["full"], batch=n, seq=16,
                      parallel=Parallelism(mesh=f"fsdp={n}"))   # auto: an estimate, and why
    assert not p.peak.compiled and p.peak_source == f"estimate (mesh fsdp={n} needs {n} devices, {n // 2} cpu present)"
    with pytest.raises(ValueError, match="shard=2: a uniform split is not a program; give mesh='fsdp=2'"):
        zoo.plan.plan(LLAMA, LLAMA_RECIPES["full"], batch=2, seq=16, peak="compile", parallel=Parallelism(shard=2))


def test_auto_estimates_a_mesh_peak_on_the_cpu_even_with_the_devices_present():
    p = zoo.plan.plan(LLAMA, LLAMA_RECIPES["qkv_offload"], batch=8, seq=16,
                      parallel=Parallelism(mesh=f"fsdp={jax.device_count()}"))
    assert not p.peak.compiled and p.peak_source == "estimate (not compiled on the CPU: peak='compile' does)"


@pytest.mark.slow   # a mesh's case of the compiled peak (test_peak.py has one device's)
@pytest.mark.multidevice
def test_the_sharded_step_is_compiled_per_device():
    out = subprocess.run([sys.executable, "-m", "tests.plan.mesh_peaks"], env=cpu_env(8), cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-3000:] + out.stderr[-3000:]
