"""The training loss: `next_token_loss` (the weighted mean cross-entropy of whole logits) and `head_loss`, the same
number with the LM head applied `chunk` positions at a time so the [B, S, vocab] float32 logits never exist whole (a
custom VJP: nothing recomputed). `default_chunk` chooses the chunk from the shapes (docs/internals.md, "The chunked
loss").
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from zoo.checks import check_positive

# The whole sequence's float32 logits at most this large by default (`default_chunk`), else chunks of at most
# CHUNK_BYTES.
WHOLE_BYTES = 8 * 2 ** 30
CHUNK_BYTES = 512 * 2 ** 20
# A default chunk shorter than this (a sequence length with no divisor near the limit, e.g. a prime) would run
# the head as many small matmuls: the default is then the whole sequence, and `--loss-chunk` the way to choose.
MIN_DEFAULT_CHUNK = 64


def next_token_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                    total_weight: jax.Array | None = None) -> jax.Array:
    """Weighted mean cross-entropy, in float32. `total_weight` (default: the sum of `weights`) is the denominator:
    a micro-batch's share of its whole batch's mean is its weighted sum over the batch's total weight."""
    nll = token_nll(logits, targets)
    total = jnp.sum(weights) if total_weight is None else total_weight
    return jnp.sum(nll * weights) / jnp.maximum(total, 1.0)


def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per position, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def check_chunk(seq: int, chunk: Any, *, what: str = "loss_chunk") -> None:
    """ValueError unless `chunk` is None (the whole sequence at once) or a positive integer dividing `seq`."""
    if chunk is None:
        return
    check_positive(what, chunk, hint=" (positions of the sequence per chunk of the loss) or None (unchunked)")
    if seq % chunk:
        raise ValueError(f"{what} {chunk} does not divide the sequence length {seq}: the loss runs over "
                         f"{seq} / {what} chunks of equal length")


def default_chunk(batch: int, seq: int, vocab: int) -> int | None:
    """The loss's chunk length for a [batch, seq] micro-batch: None (the whole sequence) where its float32 logits fit
    `WHOLE_BYTES`, else `chunk_under(CHUNK_BYTES, ...)`."""
    if 4 * batch * seq * vocab <= WHOLE_BYTES:
        return None
    return chunk_under(CHUNK_BYTES, batch, seq, vocab)


def chunk_under(limit_bytes: int, batch: int, seq: int, vocab: int) -> int | None:
    """The largest divisor of `seq` whose chunk's float32 logits fit `limit_bytes` (None, the whole sequence, where
    that is shorter than `MIN_DEFAULT_CHUNK`, or where the whole sequence's fit)."""
    if 4 * batch * seq * vocab <= limit_bytes:
        return None
    limit = max(1, limit_bytes // (4 * batch * vocab))
    best = max(d for d in divisors(seq) if d <= limit)
    return best if best >= min(MIN_DEFAULT_CHUNK, seq) else None


def resolve_chunk(chunk: Any, batch: int, seq: int, vocab: int) -> int | None:
    """The chunk length a setting means: "auto" -> `default_chunk`; None or 0 -> None (unchunked); else `chunk`,
    checked (`check_chunk`). A chunk of the whole sequence is None."""
    if isinstance(chunk, str) and chunk == "auto":
        chunk = default_chunk(batch, seq, vocab)
    elif isinstance(chunk, int) and not isinstance(chunk, bool) and chunk == 0:
        chunk = None
    check_chunk(seq, chunk)
    return None if chunk == seq else chunk


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


def head_loss(head: Callable[[Any, jax.Array], jax.Array], head_weights: Any, hidden: jax.Array,
              targets: jax.Array, weights: jax.Array, total_weight: jax.Array | None = None, *,
              chunk: int | None = None) -> jax.Array:
    """`next_token_loss(head(head_weights, hidden), targets, weights, total_weight)`, with the head and the
    cross-entropy run `chunk` positions at a time (None: all at once). `head(weights, x)`: [B, C, dim] -> logits
    [B, C, vocab], a pure function of its weights (a pytree of arrays: the gradient's)."""
    total = jnp.sum(weights) if total_weight is None else total_weight
    seq = hidden.shape[1]
    check_chunk(seq, chunk)
    if chunk is None or chunk == seq:
        return next_token_loss(head(head_weights, hidden), targets, weights, total)
    return _chunked_nll_sum(head, chunk, head_weights, hidden, targets, weights) / jnp.maximum(total, 1.0)


def _split(x: jax.Array, chunk: int) -> jax.Array:
    """[B, S, ...] -> [S / chunk, B, chunk, ...]."""
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(b, s // chunk, chunk, *x.shape[2:]), 1, 0)


def _join(x: jax.Array) -> jax.Array:
    """[n, B, C, ...] -> [B, n * C, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


def _chunk_nll(head, head_weights, hidden, targets, weights):
    nll = token_nll(head(head_weights, hidden), targets)
    return jnp.sum(nll * weights), nll


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_nll_sum(head, chunk, head_weights, hidden, targets, weights):
    """sum(nll * weights) over the sequence, the head run on one chunk at a time."""
    def body(total, xs):
        return total + _chunk_nll(head, head_weights, *xs)[0], None
    xs = (_split(hidden, chunk), _split(targets, chunk), _split(weights, chunk))
    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)
    return total


def _chunked_fwd(head, chunk, head_weights, hidden, targets, weights):
    """The loss and, in the same loop, its gradient: per chunk the VJP of the chunk's sum at cotangent 1."""
    def body(carry, xs):
        total, d_weights = carry
        h, t, w = xs
        s, vjp, nll = jax.vjp(lambda hw, x: _chunk_nll(head, hw, x, t, w), head_weights, h, has_aux=True)
        dw, dh = vjp(jnp.ones_like(s))
        d_weights = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), d_weights, dw)
        return (total + s, d_weights), (dh, nll)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), head_weights)
    xs = (_split(hidden, chunk), _split(targets, chunk), _split(weights, chunk))
    (total, d_weights), (dh, nll) = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), xs)
    return total, (head_weights, d_weights, _join(dh), _join(nll))


def _chunked_bwd(head, chunk, res, g):
    head_weights, d_weights, dh, nll = res
    d_head = jax.tree.map(lambda d, p: (g * d).astype(p.dtype), d_weights, head_weights)
    return d_head, (g * dh.astype(jnp.float32)).astype(dh.dtype), None, g * nll


_chunked_nll_sum.defvjp(_chunked_fwd, _chunked_bwd)
