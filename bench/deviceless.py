"""deviceless: the 8B's training step compiled for one H200 on a machine without a GPU, as `bench.plan_probe` compiles
it on the GPU (the main job's step, batch 1, AdamW's state and the float32 master on the host), one record per recipe.

JAX lowers the step for CUDA on the CPU's devices, whose pinned host memory keeps every placement of the state and
the offloaded residuals, and XLA's GPU compiler compiles it for the H200's description through JAX's compile-only
client (`jax.experimental.topologies`). It needs the CUDA plugin and its libraries (`pip install "jax[cuda12]"`), not a
GPU or a driver:

    python -m bench.deviceless --seq 1048576 --params stream --attention-tiles 16 --recipe carry:32:8:4

Two things the GPU's compile has and this one lacks:
- cuDNN sizes its attention calls' workspaces only on a GPU; here XLA gives them 0 bytes. `cudnn_workspace` prices
  the largest from the compiled calls' shapes, and the record's peak adds it whole (`planned_peak_gib`).
- autotuning: XLA takes its default kernels.
So the record's peak is not a bound on the GPU's own compile. The step at 1,048,576 tokens of commit ef2a5cd gives
140.5 GiB without workspaces and 157.5 GiB with the largest (17.0 GiB), against 156.4 GiB compiled on the H200
(bench/results/million-compile_2026-12-04.jsonl); `auto`'s step there at commit 0e7fb33 gives 119.1 GiB here and
125.3 GiB on the H200 (bench/results/million-compile_2026-12-05.jsonl).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import time

# The H200 as XLA's GPU compiler reads a device (a GpuTargetConfigProto): Hopper's 132 multiprocessors at 1.98 GHz
# and their limits, the H200's 141 GB of HBM3e at 4.8 TB/s, cuDNN 9 and CUDA 12.
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 150754820096
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA H200"
"""
COMPILED_ON = "the CPU for an NVIDIA H200 (bench.deviceless: jax's compile-only CUDA client)"
# The allocator's share of the H200 at XLA_PYTHON_CLIENT_MEM_FRACTION=.95 (the long-context runs' setting)
LIMIT_GIB = 132.8
_BACKWARD = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmax\w*Backward"'
                       r'.*?operand_layout_constraints=\{(.*?)\}, api')
_SHAPE = re.compile(r"\w+\[([\d,]+)\]")


def cudnn_workspace(hlo_text: str) -> int:
    """The largest workspace of the cuDNN attention backward calls in an optimized HLO module, in bytes: for queries
    [B, Sq, H, d] and keys [B, Sk, Hkv, d], 4 B H d (Sq + Sk) + 4 B H Sq + 256. Fitted to the two sizes XLA gave cuDNN's
    calls on the H200 in the 1M step (bf16, 32 query and 8 key heads of 128): 18,261,999,872 bytes for 65,536 queries
    over 1,048,576 keys and 2,155,872,512 for 65,536 over 65,536.

    Args:
        hlo_text: the optimized HLO module's text (`compiled.as_text()`).

    Returns:
        the largest workspace in bytes; 0 where no such call runs.
    """
    largest = 0
    for operands in _BACKWARD.findall(hlo_text):
        (b, sq, h, d), (_, sk, _, _) = (tuple(int(n) for n in m.split(",")) for m in _SHAPE.findall(operands)[:2])
        largest = max(largest, 4 * b * h * d * (sq + sk) + 4 * b * h * sq + 256)
    return largest


@contextlib.contextmanager
def compiling_for_h200():
    """Within: every `jax.jit(...).lower(...).compile()` lowers for CUDA and compiles for the H200 (`H200`); the zoo's
    layers take cuDNN's attention and the step its GPU compile options, as on the H200. JAX's hooks are private:
    written for jax 0.11.2."""
    import jax
    from jax._src import compiler
    from jax._src.interpreters import pxla
    from jax._src.lib import _jax
    from jax.experimental import topologies

    from zoo import compile_options
    from zoo.layers import attention_kernel

    topology = topologies.get_topology_desc(platform="cuda", target_config=H200, topology="1x1x1")
    client, devices = topology.devices[0].client, tuple(topology.devices)
    saved = (pxla.lower_sharding_computation, compiler.backend_compile_and_load, attention_kernel._cudnn_refusal,
             compile_options.for_step)
    lower, _, _, for_step = saved

    def lower_for_cuda(*args, **kwargs):
        kwargs["lowering_platforms"] = kwargs.get("lowering_platforms") or ("cuda",)
        return lower(*args, **kwargs)

    def compile_for_h200(backend, module, executable_devices, options, *_):   # no host callbacks
        return client.compile(module, executable_devices=_jax.DeviceList(devices[:len(executable_devices)]),
                              compile_options=options)

    pxla.lower_sharding_computation, compiler.backend_compile_and_load = lower_for_cuda, compile_for_h200
    attention_kernel._cudnn_refusal = lambda dtype, head_dim, device: (
        None if jax.numpy.dtype(dtype).name in ("bfloat16", "float16") else "cuDNN takes bf16/fp16")
    compile_options.for_step = lambda recipe, platform, xla_flags=None: for_step(recipe, "gpu", xla_flags)
    try:
        yield topology.devices[0]
    finally:
        (pxla.lower_sharding_computation, compiler.backend_compile_and_load, attention_kernel._cudnn_refusal,
         compile_options.for_step) = saved


_CALL = re.compile(r'custom_call_target="__cudnn\$fmhaSoftmax\w*"')


def cudnn_calls(hlo_text: str) -> tuple[int, int]:
    """(forward, backward) cuDNN attention calls in an optimized HLO module's text, a loop's body counted once.

    Args:
        hlo_text: the optimized HLO module's text (`compiled.as_text()`).

    Returns:
        the number of forward calls and of backward calls.
    """
    calls = _CALL.findall(hlo_text)
    backward = sum(c.endswith('Backward"') for c in calls)
    return len(calls) - backward, backward


def programs(compiled) -> tuple:
    """The compiled programs of a step: the step's own, or both of a step run as two (`zoo.two_programs`).

    Args:
        compiled: a compiled training step (`zoo.train_step.compile_abstract`'s first value).

    Returns:
        the compiled programs, in the order they run.
    """
    return (compiled.first, compiled.second) if hasattr(compiled, "first") else (compiled,)


def peak_and_workspace(compiled) -> tuple[int, int]:
    """(XLA's peak of a step compiled here, the largest cuDNN workspace of its programs), in bytes: their sum is this
    tool's figure for the step's peak on the H200 (not a bound: see the module docstring). A step run as two
    programs (`zoo.two_programs`) has both read."""
    from zoo.two_programs import peak_bytes
    return peak_bytes(compiled.memory_analysis()), max(cudnn_workspace(p.as_text()) for p in programs(compiled))


@contextlib.contextmanager
def planning_for_h200(host_ram_gib: float = 128.0):
    """Within `compiling_for_h200`, the planner plans for the H200 as if on it (`zoo.plan.plan`, `longest_seq`): its
    compiled peaks are this compile's with the largest cuDNN workspace added (`peak_and_workspace`).

    Args:
        host_ram_gib: the RAM of the H200's host, which bounds the pinned pool the planner plans within.
    """
    from zoo.plan import build, longest, state, target
    from zoo.plan import peak as peak_lib

    with compiling_for_h200() as device:
        saved = (target.device_target, build.device_target, longest.device_target, peak_lib.from_compiled,
                 state.machine_ram_bytes, longest.machine_ram_bytes)

        def on_the_h200(kind):
            return "NVIDIA H200", kind in (None, "NVIDIA H200"), device

        def from_compiled(compiled, *_, **__):
            without, workspace = peak_and_workspace(compiled)
            return peak_lib.Peak(bytes=without + workspace, compiled=True, detail={"cudnn_workspace": workspace},
                                 source="compiled for NVIDIA H200 on the CPU (bench.deviceless), cuDNN's largest "
                                        "workspace added")

        def ram():
            return int(host_ram_gib * 2**30)

        target.device_target = build.device_target = longest.device_target = on_the_h200
        peak_lib.from_compiled, state.machine_ram_bytes, longest.machine_ram_bytes = from_compiled, ram, ram
        try:
            yield device
        finally:
            (target.device_target, build.device_target, longest.device_target, peak_lib.from_compiled,
             state.machine_ram_bytes, longest.machine_ram_bytes) = saved


def _args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, action="append", default=[], help="a length to compile (repeat)")
    ap.add_argument("--recipe", action="append", default=[],
                    help="auto, a Llama recipe name or carry:TILES:GROUP[:SUBGROUP] (bench.plan_probe's) (repeat)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--params", choices=("host", "stream"), default="host")
    ap.add_argument("--attention-tiles", type=int, default=1, metavar="N")
    ap.add_argument("--loss-chunk", type=int, default=None, help="positions per loss chunk (default: the planner's)")
    ap.add_argument("--longest", type=int, default=None, metavar="CAP",
                    help="instead: the planner's longest power-of-two length up to CAP that fits, auto's step compiled "
                         "here (zoo.plan.longest_seq, as --max-seq on the H200)")
    ap.add_argument("--hbm", type=float, default=LIMIT_GIB, metavar="GiB",
                    help="the HBM budget auto plans for (default: the allocator's share, which the record checks)")
    return ap.parse_args()


def main():
    a = _args()
    os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=true")
    # the pinned host pool the planner plans within: the million-token scenarios' (bench.scenarios)
    os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "120")
    import jax
    jax.config.update("jax_platforms", "cpu")

    import zoo
    from bench.common import emit
    from bench.plan_probe import _recipe
    from recipes.llama3 import RECIPES
    from zoo.models.registry import family_of
    from zoo.train_step import compile_abstract

    seqs = a.seq or [1048576]
    cfg = zoo.models.LlamaConfig.preset("llama3_1_8b", num_layers=a.layers, param_dtype="bfloat16",
                                        max_seq_len=max(seqs + [a.longest or 0]), attention_tiles=a.attention_tiles,
                                        attention_impl="cudnn")
    hardware = zoo.plan.Hardware(hbm_gib=a.hbm, tflops=989.0, device_kind="NVIDIA H200")   # bf16 dense peak
    if a.longest:
        training = zoo.plan.Training(opt_dtype="bfloat16", opt_state="host", params=a.params, loss_chunk="auto")
        t0 = time.perf_counter()
        with planning_for_h200():
            found = zoo.plan.longest_seq(cfg, "auto", hardware=hardware, training=training, cap=a.longest,
                                         peak="compile")
        print(found.render(), file=sys.stderr)
        emit(dict(bench="plan-probe", impl="zoo", recipe="auto", backend=None, gpus=1, B=1, S=found.seq,
                  L=cfg.num_layers, step_s=None, tflops=None, peak_gib=None, planned_peak_gib=None, dropped=0,
                  host_temp_gib=None, planned_host_gib=None, longest=found.to_dict(), params=a.params,
                  attention_tiles=a.attention_tiles, compiled_on=COMPILED_ON, wall_s=round(time.perf_counter() - t0, 1),
                  command="python -m bench.deviceless " + " ".join(sys.argv[1:])))
        return
    for seq in seqs:
        for name in a.recipe or ["carry:32:8"]:
            recipe = _recipe(name, RECIPES)
            training = zoo.plan.Training(opt_dtype="bfloat16", opt_state="host", params=a.params,
                                         loss_chunk=a.loss_chunk or "auto")
            est = zoo.plan.plan(cfg, recipe, batch=1, seq=seq, hardware=hardware, training=training,
                                peak="estimate")
            t0 = time.perf_counter()
            with compiling_for_h200():
                step = compile_abstract(family_of(cfg), cfg, est.recipe, batch=1, seq=seq,
                                        training=dataclasses.replace(training, loss_chunk=est.loss_chunk))[0]
            ma = step.memory_analysis()
            without, workspace = peak_and_workspace(step)
            forward, backward = cudnn_calls("\n".join(p.as_text() for p in programs(step)))
            emit(dict(bench="plan-probe", impl="zoo", recipe=name, backend=None, gpus=1, B=1, S=seq, L=cfg.num_layers,
                      step_s=None, tflops=None, peak_gib=None, dropped=0,
                      planned_peak_gib=round((without + workspace) / 2**30, 2),
                      host_temp_gib=round(ma.host_temp_size_in_bytes / 2**30, 2),
                      planned_host_gib=round(est.host_total / 2**30, 2),
                      compiled_on=COMPILED_ON,
                      peak_without_cudnn_workspace_gib=round(without / 2**30, 2),
                      cudnn_workspace_gib=round(workspace / 2**30, 2),
                      cudnn_forward_calls=forward, cudnn_backward_calls=backward,
                      host_state_gib=round(ma.host_argument_size_in_bytes / 2**30, 2),
                      optimizer="adamw", opt_state="host", params=a.params, opt_dtype="bfloat16",
                      param_dtype="bfloat16", attention_tiles=a.attention_tiles, recipe_run=str(est.recipe),
                      loss_chunk=est.loss_chunk, estimated_peak_gib=round(est.peak_bytes / 2**30, 2),
                      planned_step_s=round(est.step_time()["total_s"], 1), limit_gib=LIMIT_GIB, budget_gib=a.hbm,
                      host_pool_gib=int(os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]),
                      fits=(without + workspace) / 2**30 <= LIMIT_GIB, compile_s=round(time.perf_counter() - t0, 1),
                      command="python -m bench.deviceless " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
