"""Run by tests/layers/moe/test_expert_parallel.py in a subprocess with N fake CPU devices (N = 2 or 4):
`python -m tests.layers.moe.ep_steps N`.

Dropless expert parallelism (`ep_dispatch="ragged_a2a"`) on the CPU, where the collective is the all-to-all
stand-in (`padded_ragged_all_to_all`, chosen when the step is lowered for the CPU):
- the stand-in reproduces `jax.lax.ragged_all_to_all`'s documented example exactly;
- the dispatch (`expert_parallel`) against the one-device dropless result (sort, ragged_dot, unsort), float32:
  under ep=N the outputs and every gradient are bit-equal; under fsdp=2 x ep=2 (N=4) the outputs and the tokens'
  gradient are bit-equal and the experts' gradients, summed over the fsdp shards by XLA, agree to 1e-6 (relative error
  of each array as a whole). Once
  with the router's indices at random and once with every copy sent to the experts of device 0, the case that
  fills its receive buffer (`receive_rows`) to the last row;
- (N=2, ep=2) a DeepSeek-V3 tiny training step under mla_moe_offload against one device's (loss and gradients, relative
  error < 1e-5, as tests/sharded_steps.py): the q/k/v offloads keep their batch sharding, the experts' tags are
  offloaded inside the shard_map as one device's receive buffer [receive_rows, moe_mlp], and the step lowered for
  CUDA (the real collective) holds ragged-all-to-alls. Prints OK at the end.
"""
from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

import zoo
from tests import sharded_steps
from tests.helpers import max_rel_err
from zoo import sharding
from zoo.layers.moe import dispatch, expert_parallel


def stand_in_matches_the_documented_example():
    """jax.lax.ragged_all_to_all's docstring example over an axis of size 2, through the stand-in."""
    mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    args = dict(operand=[[1, 2, 2], [3, 4, 0]], output=[[0] * 4] * 2, input_offsets=[[0, 1], [0, 1]],
                send_sizes=[[1, 2], [1, 1]], output_offsets=[[0, 0], [1, 2]], recv_sizes=[[1, 1], [2, 1]])
    arrays = [jnp.asarray(v, jnp.float32 if k in ("operand", "output") else jnp.int32).reshape(-1)
              for k, v in args.items()]
    f = jax.shard_map(lambda *a: expert_parallel.padded_ragged_all_to_all(*a, axis_name="x"), mesh=mesh,
                      in_specs=(P("x"),) * 6, out_specs=P("x"))
    got = np.asarray(jax.jit(f)(*arrays)).reshape(2, 4)
    np.testing.assert_array_equal(got, [[1, 3, 0, 0], [2, 2, 4, 0]])


E, K, T, D, F = 8, 2, 64, 16, 24


def grouped(rows, sizes, w):
    gate, up = jax.lax.ragged_dot(rows, w[0], sizes), jax.lax.ragged_dot(rows, w[1], sizes)
    return jax.lax.ragged_dot(jax.nn.silu(gate) * up, w[2], sizes)


def one_device(x, idx, w):
    s = dispatch.sort_by_expert(x[None], idx[None], E)
    return dispatch.unsort(grouped(s.rows[0], s.group_sizes[0], w)[None], s)[0]


def vjp(f, x, idx, w):
    """(f's output, its gradients with respect to x and the weights for a fixed cotangent)."""
    out, pull = jax.vjp(lambda x, w: f(x, idx, w), x, w)
    ct = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
    return jax.device_get((out, *pull(ct)))


def dispatch_equals_one_device(spec: str):
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (T, D), jnp.float32)
    w = tuple(jax.random.normal(k, s, jnp.float32) for k, s in zip(keys[2:], [(E, D, F), (E, D, F), (E, F, D)]))
    random_idx = jnp.argsort(jax.random.uniform(keys[1], (T, E)), axis=-1)[:, :K].astype(jnp.int32)
    to_device_0 = jnp.tile(jnp.arange(K, dtype=jnp.int32), (T, 1))   # experts 0..k-1: all on device 0
    mesh = sharding.make_mesh(spec)
    ep = sharding.mesh_sizes(mesh)["ep"]
    assert expert_parallel.receive_rows(T // jax.device_count(), K, E, ep) == ep * T // jax.device_count() * K
    for name, idx in (("random", random_idx), ("all to device 0", to_device_0)):
        want = vjp(jax.jit(one_device), x, idx, w)
        with sharding.use(mesh):
            got = vjp(jax.jit(lambda x, idx, w: expert_parallel.expert_parallel(x, idx, w, grouped)), x, idx, w)
        (out, dx, dw), (out0, dx0, dw0) = got, want
        # The same sums over other row blocks: XLA's CPU kernels block a dot by its row count, so a device's share
        # of the rows rounds apart from the whole batch's in the last bits (2e-7 seen); 1e-6 is far below an error.
        for what, got_, want_ in (("output", out, out0), ("tokens' gradient", dx, dx0), ("experts' gradient", dw, dw0)):
            assert max_rel_err(got_, want_) < 1e-6, (spec, name, what, max_rel_err(got_, want_))
        print(f"{spec} {name}: dispatch equals one device's (outputs and gradients)")


def model_step_equals_one_device(spec: str):
    recipe = zoo.Recipe("mla_moe_offload", offload=("query_proj", "key_proj", "value_proj", "moe_mlpwi_0",
                                                    "moe_mlpwi_1"))
    # One dense layer and a scan of two MoE layers (the tiny preset has two of each).
    cfg = zoo.models.DeepSeekV3Config.preset("tiny", num_layers=3, first_dense_layers=1, moe_backend="ragged_dot",
                                           ep_dispatch="ragged_a2a")
    tokens = jax.random.randint(jax.random.key(1), (8, 8), 0, cfg.vocab_size, dtype=jnp.int32)
    ref = sharded_steps.one_device(zoo.models.deepseek_v3(cfg, recipe=recipe, rngs=nnx.Rngs(0)), tokens)
    ep = sharding.parse_mesh(spec, jax.device_count())["ep"]
    assert ep == jax.device_count(), spec
    # q, k [B,S,H,24] and v [B,S,H,16] split over ep; the experts' tags one device's receive buffer.
    rows = expert_parallel.receive_rows(8 * 8 // ep, cfg.num_experts_per_tok, cfg.num_experts, ep)
    want = {"tensor<8x8x4x24xf32>": "[ep,,,]", "tensor<8x8x4x16xf32>": "[ep,,,]",
            f"tensor<{rows}x{cfg.moe_mlp_dim}xf32>": "manual"}
    got = sharded_steps.sharded(zoo.models.deepseek_v3, cfg, recipe, spec, tokens, want, ragged=True)
    sharded_steps.compare(f"{spec} ragged_a2a", got, ref)


def main(n: int):
    assert jax.device_count() == n, jax.devices()
    stand_in_matches_the_documented_example()
    for spec in {2: ["ep=2"], 4: ["ep=4", "fsdp=2,ep=2"]}[n]:
        dispatch_equals_one_device(spec)
    if n == 2:
        model_step_equals_one_device("ep=2")


if __name__ == "__main__":
    main(int(sys.argv[1]))
    print("OK")
