"""Run by tests/plan/test_mesh_plan.py in a subprocess with 8 fake CPU devices: `python -m tests.plan.mesh_peaks`.

The planner's peak under a mesh whose devices are present is the sharded step compiled (`zoo.plan.plan(...,
mesh=, peak="compile")`), and XLA's memory analysis of an SPMD-partitioned step is one device's:
- tiny Llama and tiny DeepSeek-V3 under fsdp=4 (4 of the 8 devices): the source says compiled for 4 devices and
  the mesh; the peak is below the one-device compiled peak; the argument bytes are the planner's own per-device
  model state (parameters + optimizer state + other variables, from the sharding rules) plus the per-device batch,
  to a few bytes of replicated scalars (step counters), as the one-device arguments are the one-device state plus
  the batch: a per-device figure, not a global one.
(The main job's plan under a mesh, compiled from its own sharded step: tests/train/mesh_peaks.py.)
Prints OK at the end.
"""
from __future__ import annotations

import jax

import zoo
from recipes.deepseek_v3 import RECIPES as DS_RECIPES
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from zoo.plan import Parallelism

B, S = 8, 16
SCALARS = 64   # bytes of replicated scalars in the arguments (optimizer step counters), on every device


def batch_bytes(data_shards: int) -> int:
    # tokens [B, S+1] int32 and weights [B, S] float32, split over the data axes
    return (B * (S + 1) * 4 + B * S * 4) // data_shards


def check_arguments(p, data_shards: int) -> None:
    st = p.state
    want = st.params + st.optimizer + st.other + batch_bytes(data_shards)
    got = p.peak.detail["argument"]
    assert 0 <= got - want < SCALARS, (p.peak_source, got, want)


def sharded_peak_is_per_device(cfg, recipe, name):
    one = zoo.plan.plan(cfg, recipe, batch=B, seq=S, peak="compile")
    four = zoo.plan.plan(cfg, recipe, batch=B, seq=S, peak="compile", parallel=Parallelism(mesh="fsdp=4"))
    assert one.peak_source == "compiled for cpu", one.peak_source
    assert four.peak.compiled and four.peak_source == "compiled for 4 x cpu (mesh fsdp=4), per device", \
        four.peak_source
    assert four.peak_bytes < one.peak_bytes, (four.peak_bytes, one.peak_bytes)
    check_arguments(one, 1)
    check_arguments(four, 4)
    # the state really is split: the per-device arguments are well under the one-device ones
    assert four.peak.detail["argument"] < one.peak.detail["argument"] / 3, (four.peak.detail, one.peak.detail)
    print(f"{name}: one device {one.peak_bytes} (arguments {one.peak.detail['argument']}), fsdp=4 per device "
          f"{four.peak_bytes} (arguments {four.peak.detail['argument']})")


def main():
    assert jax.device_count() == 8, jax.devices()
    sharded_peak_is_per_device(zoo.models.LlamaConfig.preset("tiny"), LLAMA_RECIPES["qkv_offload"], "llama")
    sharded_peak_is_per_device(zoo.models.DeepSeekV3Config.preset("tiny", moe_backend="capacity", capacity_factor=4.0),
                               DS_RECIPES["mla_moe_offload"], "deepseek")


if __name__ == "__main__":
    main()
    print("OK")
