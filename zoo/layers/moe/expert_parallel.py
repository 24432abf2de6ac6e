"""Dropless expert parallelism (`ep_dispatch="ragged_a2a"`): under `shard_map`, each device sends its tokens' copies to
their experts' devices over `ep` with `jax.lax.ragged_all_to_all`, runs the grouped matmul over its E/ep local experts
and sends the results back (`expert_parallel`); `receive_rows` sizes a buffer nothing can overflow. XLA:CPU has no
ragged all-to-all: there the exchange is built from `jax.lax.all_to_all` (`padded_ragged_all_to_all`). Its memory cost:
docs/internals.md, "Expert parallelism".
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from zoo import sharding
from zoo.layers.moe.dispatch import sort_by_expert, unsort


def padded_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                             output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s exchange (one slice per device of `axis_name`) from `jax.lax.all_to_all` on
    padded buffers, for XLA:CPU, which has no ragged-all-to-all: slice j (operand[input_offsets[j]:][:send_sizes[j]])
    is padded to the operand's length and sent to device j, which writes it into its `output` at the offset the
    sender gave (output_offsets[j]); rows of `output` nothing is written to keep their value. Pure data movement,
    so its values and gradients are exact. Costs ep x operand per device."""
    p = jax.lax.axis_size(axis_name)
    if input_offsets.shape != (p,):
        raise ValueError(f"padded_ragged_all_to_all: one slice per device of {axis_name!r} ({p}), got offsets of "
                         f"shape {input_offsets.shape}")
    n, m = operand.shape[0], output.shape[0]
    r = jnp.arange(n, dtype=jnp.int32)
    rows = jnp.clip(input_offsets[:, None] + r, 0, n - 1)                                 # [P, N]
    keep = (r < send_sizes[:, None]).reshape(p, n, *(1,) * (operand.ndim - 1))
    sent = jnp.where(keep, operand[rows], jnp.zeros((), operand.dtype))                   # [P, N, ...]: to each device
    got = jax.lax.all_to_all(sent, axis_name, 0, 0)                                       # [P, N, ...]: from each
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)                  # [P]: where each lands here
    dest = jnp.where(r < recv_sizes[:, None], at[:, None] + r, m)                         # m: out of range, dropped
    return output.at[dest.reshape(-1)].set(got.reshape(p * n, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """The collective of `expert_parallel`, with `jax.lax.ragged_all_to_all`'s signature and semantics: jax's on
    every platform but the CPU, `padded_ragged_all_to_all` there (chosen when the step is lowered, so a step
    lowered for CUDA on a CPU machine holds the real ragged-all-to-all)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(padded_ragged_all_to_all, axis_name=axis_name),
        default=functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name))


def receive_rows(tokens: int, k: int, num_experts: int, ep: int) -> int:
    """Rows of a device's receive buffer under `expert_parallel` for `tokens` tokens per device: every copy the ep
    devices can send to one device's E/ep experts (a token's k experts are distinct), so nothing can drop."""
    return ep * tokens * min(k, num_experts // ep)


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _local_expert_parallel(x: jax.Array, idx: jax.Array, weights: tuple[jax.Array, ...], *, num_experts: int,
                           ep_axis: str | None, batch_axes: tuple[str, ...], grouped: Callable) -> jax.Array:
    """One device's part of `expert_parallel`: x [T, D], idx [T, k], its E/ep experts' weights -> [T*k, D], each
    copy through its expert, in token-copy order."""
    s = sort_by_expert(x[None], idx[None], num_experts)
    rows, sizes = s.rows[0], s.group_sizes[0]                                   # [N, D] by expert; [E]
    if ep_axis is None:
        return unsort(grouped(rows, sizes, weights)[None], s)[0]
    p, e_local = jax.lax.axis_size(ep_axis), weights[0].shape[0]
    n, d = rows.shape
    me = jax.lax.axis_index(ep_axis)
    counts = jax.lax.all_gather(sizes.reshape(p, e_local), ep_axis)             # [src, dst, local expert]
    sent = jnp.sum(counts, axis=-1)                                             # [src, dst] copies
    mine = counts[:, me]                                                        # [src, local expert] coming here
    send, recv = sent[me], sent[:, me]                                          # [dst], [src]
    send_at = _exclusive_cumsum(sent, axis=1)                                   # where src's chunk for dst starts
    recv_at = _exclusive_cumsum(sent, axis=0)                                   # where it lands on dst
    m = receive_rows(n // idx.shape[1], idx.shape[1], num_experts, p)

    def buffer(rows_: int) -> jax.Array:  # varying over the batch axes, as the rows and the exchange's result are
        return jax.lax.pcast(jnp.zeros((rows_, d), rows.dtype), batch_axes, to="varying")

    got = ragged_all_to_all(rows, buffer(m), send_at[me], send, recv_at[me], recv, axis_name=ep_axis)
    # `got` holds each source's copies in turn, each sorted by local expert; sort them by local expert (stable:
    # source order, i.e. token order, within an expert). Rows past the last copy get expert e_local: last, no group.
    seg = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(m, dtype=jnp.int32), side="right")
    order = jnp.argsort(jnp.where(seg < p * e_local, seg % e_local, e_local), stable=True)
    out = grouped(got[order], jnp.sum(mine, axis=0), weights)
    out = out[jnp.argsort(order)]                                               # back in arrival order
    back = ragged_all_to_all(out, buffer(n), _exclusive_cumsum(recv), recv, send_at[:, me], send,
                             axis_name=ep_axis)
    return unsort(back[None], s)[0]


def expert_parallel(flat: jax.Array, idx: jax.Array, weights: tuple[jax.Array, ...], grouped: Callable
                    ) -> jax.Array:
    """Dropless expert parallelism under the active mesh: flat [T, D] tokens (split over the batch axes), idx
    [T, k] their experts, `weights` the experts' stacked weights ([E, ...] each, split over ep) -> [T*k, D], each
    token copy through its expert, in token-copy order (the layer combines them). `grouped(rows, group_sizes,
    weights)` runs one device's experts over its rows sorted by expert (rows past sum(group_sizes) in no group).
    See the module's docstring (ep_dispatch "ragged_a2a")."""
    batch = sharding.mesh_axes("batch")
    ep = sharding.mesh_axes("experts")
    if len(ep) > 1:
        raise ValueError(f"ep_dispatch='ragged_a2a': experts split over one mesh axis, got {ep}")
    num_experts = weights[0].shape[0]
    body = functools.partial(_local_expert_parallel, num_experts=num_experts, ep_axis=ep[0] if ep else None,
                             batch_axes=batch, grouped=grouped)
    rows = jax.sharding.PartitionSpec(batch or None)
    experts = jax.sharding.PartitionSpec(ep[0] if ep else None)
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(rows, rows, experts),
                         out_specs=rows)(flat, idx, weights)
