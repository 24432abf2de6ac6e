"""bench.deviceless: the cuDNN workspace it adds to a step compiled for the H200 without one, against the sizes XLA gave
cuDNN's calls on the H200; and, where the CUDA plugin is installed, a step compiled for the H200 on the CPU keeps
the host placements and runs cuDNN's attention."""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest

from bench import deviceless

# The two cuDNN backward calls of the 1M step as XLA compiled them on the H200 (bench/results/
# million-compile_2026-12-04-in-place-memory-usage-report.txt lists their workspaces: u8[18261999872] and
# u8[2155872512]), their operands as the optimized HLO prints them.
CALL = 'custom_call_target="__cudnn$fmhaSoftmax{}", operand_layout_constraints={{bf16[1,65536,32,128]{{3,2,1,0}}, '
PREFIX = (CALL.format("Backward") +
          'bf16[1,1048576,8,128]{3,2,1,0}, bf16[1,1048576,8,128]{3,2,1,0}, f32[1,32,65536]{2,1,0}, '
          'bf16[1,65536,32,128]{3,2,1,0}, bf16[1,65536,32,128]{3,2,1,0}, s32[1]{0}, s32[1]{0}}, api_version=API')
DIAGONAL = (CALL.format("Backward") +
            'bf16[1,65536,8,128]{3,2,1,0}, bf16[1,65536,8,128]{3,2,1,0}, f32[1,32,65536]{2,1,0}, '
            'bf16[1,65536,32,128]{3,2,1,0}, bf16[1,65536,32,128]{3,2,1,0}}, api_version=API')
FORWARD = (CALL.format("") +
           'bf16[1,1048576,8,128]{3,2,1,0}, bf16[1,1048576,8,128]{3,2,1,0}}, api_version=API')


def test_the_workspace_is_the_largest_backward_calls_as_xla_sized_it_on_the_h200():
    assert deviceless.cudnn_workspace(DIAGONAL) == 2155872512
    assert deviceless.cudnn_workspace(PREFIX) == 18261999872
    assert deviceless.cudnn_workspace("\n".join((FORWARD, DIAGONAL, PREFIX, DIAGONAL))) == 18261999872
    assert deviceless.cudnn_workspace(FORWARD) == 0   # a forward call's workspace is not priced


def test_the_calls_are_counted_forward_and_backward():
    assert deviceless.cudnn_calls("\n".join((FORWARD, DIAGONAL, PREFIX, FORWARD, FORWARD))) == (3, 2)
    assert deviceless.cudnn_calls("") == (0, 0)


def _cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(not _cuda_plugin(),
                    reason="compiling for the H200 needs the CUDA plugin (pip install 'jax[cuda12]')")
def test_a_step_compiled_for_the_h200_on_the_cpu_keeps_host_placements_and_runs_cudnn():
    """Compiled for the H200 on the CPU, an argument in pinned host memory is counted as host bytes (not HBM) and
    attention is cuDNN's custom calls, one forward and one backward."""
    cpu = jax.devices("cpu")[0]
    host = jax.sharding.NamedSharding(jax.sharding.Mesh([cpu], ("x",)), jax.sharding.PartitionSpec(),
                                      memory_kind="pinned_host")
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=host)
    q = jax.ShapeDtypeStruct((1, 1024, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)

    def loss(w, q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        w = jax.device_put(w, host.with_memory_kind("device"))
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.square(w))

    with deviceless.compiling_for_h200() as device:
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(w, q, kv, kv).compile()
    assert device.device_kind == "NVIDIA H200"
    ma = compiled.memory_analysis()
    assert ma.host_argument_size_in_bytes == 1024 * 1024 * 2
    text = compiled.as_text()
    assert deviceless.cudnn_calls(text) == (1, 1)
    assert deviceless.cudnn_workspace(text) == 4 * 8 * 128 * 2048 + 4 * 8 * 1024 + 256
