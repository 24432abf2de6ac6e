"""Run by tests/train/test_mesh_train.py in a subprocess with 8 fake CPU devices: `python -m tests.train.mesh_peaks`.

The main job (`recipes.train.loop.run`) under fsdp=4 x tp=2 (8 devices) plans its peak from its own compiled sharded
step, labelled with the mesh, and `zoo.plan.plan(..., mesh="fsdp=4,tp=2", peak="compile")` compiles the same program:
XLA's memory analysis is equal field by field, and its arguments are the planner's per-device state plus the batch
(the planner's own sharded peaks: tests/plan/mesh_peaks.py). Prints OK at the end.
"""
from __future__ import annotations

import jax

import zoo
from recipes.llama3 import RECIPES as LLAMA_RECIPES
from recipes.train import loop
from recipes.train.step import prepare
from tests.plan.mesh_peaks import B, S, check_arguments
from zoo.plan import Parallelism
from zoo.plan import peak as peak_lib


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


if __name__ == "__main__":
    assert jax.device_count() == 8, jax.devices()
    main_job_plans_its_compiled_sharded_step()
    print("OK")
