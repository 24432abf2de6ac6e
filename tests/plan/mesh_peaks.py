"""Run by tests/plan/test_mesh_plan.py in a subprocess with 8 fake CPU devices: `python -m tests.plan.mesh_peaks`.

The planner's peak under a mesh whose devices are present is the sharded step compiled (`zoo.plan.plan(...,
mesh=, peak="compile")`), and XLA's memory analysis of an SPMD-partitioned step is one device's:
- tiny Llama and tiny DeepSeek-V3 under fsdp=4 (4 of the 8 devices): the source says compiled for 4 devices and
  the mesh; the peak is below the one-device compiled peak; the argument bytes are the planner's own per-device
  model state (parameters + optimizer state + other variables, from the sharding rules) plus the per-device batch,
  to a few bytes of replicated scalars (step counters), as the one-device arguments are the one-device state plus
  the batch: a per-device figure, not a global one.
- the main job (`recipes.train.loop.run`) under fsdp=4 x tp=2 (8 devices) plans its peak from its own compiled sharded
  step, labelled with the mesh, and `zoo.plan.plan(..., mesh="fsdp=4,tp=2", peak="compile")` compiles the same program:
  XLA's memory analysis is equal field by field.
Prints OK at the end.
"""
from __future__ import annotations

import jax

import zoo
from recipes.deepseek_v3 import RECIPES as DS_RECIPES
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from recipes.train import loop, prepare
from zoo.plan import Parallelism
from zoo.plan import peak as peak_lib

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


def main_job_plans_its_compiled_sharded_step():
    seen = {}
    real_compile, real_show = prepare.compile_for_shapes, prepare.show_memory_plan

    def spy_compile(*args, **kwargs):
        seen["compiled"], graphdef, abstract = real_compile(*args, **kwargs)
        return seen["compiled"], graphdef, abstract

    def spy_show(*args, **kwargs):
        seen["plan"] = real_show(*args, **kwargs)
        return seen["plan"]

    prepare.compile_for_shapes, prepare.show_memory_plan = spy_compile, spy_show
    try:
        loop.run(loop.RunConfig(model="llama3", preset="tiny", recipe="qkv_offload", steps=1, batch=B, seq=S,
                                mesh="fsdp=4,tp=2"))
    finally:
        prepare.compile_for_shapes, prepare.show_memory_plan = real_compile, real_show
    job = seen["plan"]
    want = "compiled for 8 x cpu (mesh fsdp=4,tp=2), per device"
    assert job.peak.compiled and job.peak_source == want, job.peak_source
    assert job.peak.detail == peak_lib.from_compiled(seen["compiled"]).detail
    planned = zoo.plan.plan(zoo.models.LlamaConfig.preset("tiny"), LLAMA_RECIPES["qkv_offload"], batch=B, seq=S,
                            peak="compile", parallel=Parallelism(mesh="fsdp=4,tp=2"))
    assert planned.peak_source == want, planned.peak_source
    assert planned.peak.detail == job.peak.detail, (planned.peak.detail, job.peak.detail)
    check_arguments(planned, 4)   # fsdp=4 splits the batch; tp=2 does not
    print(f"main job fsdp=4,tp=2: {job.peak_bytes} per device, planner {planned.peak_bytes}")


def main():
    assert jax.device_count() == 8, jax.devices()
    sharded_peak_is_per_device(zoo.models.LlamaConfig.preset("tiny"), LLAMA_RECIPES["qkv_offload"], "llama")
    sharded_peak_is_per_device(zoo.models.DeepSeekV3Config.preset("tiny", moe_backend="capacity", capacity_factor=4.0),
                               DS_RECIPES["mla_moe_offload"], "deepseek")
    main_job_plans_its_compiled_sharded_step()


if __name__ == "__main__":
    main()
    print("OK")
