"""What the loss's chunk length costs: the LM head and its cross-entropy (`zoo.loss.head_loss`, forward and backward,
the hidden states' and the head's gradients) of the Llama 3.1 8B shapes (dim 4096, vocab 128,256, bf16) at each
sequence length, in chunks of each length given. The step runs the same head once a step, so the difference between
two chunk lengths here is the difference between the two steps. `python -m bench.loss_chunks --seq 8192 131072
--chunk whole 64 1024 8192` (one JSON line per (seq, chunk); a chunk that does not divide the length is skipped)."""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import emit
from zoo.layers.embed import LMHead
from zoo.loss import default_chunk, head_loss

DIM, VOCAB = 4096, 128256
WHOLE_LIMIT = 16 * 2 ** 30   # the whole sequence is tried where its float32 logits are at most this


def _time(fn, *args, steps: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def measure(seq: int, chunk: int | None, *, dim: int, vocab: int, steps: int) -> dict:
    head_module = LMHead(dim=dim, vocab=vocab, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(head_module)
    leaves, treedef = jax.tree.flatten(params)

    def head(weights, x):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))(x)

    keys = jax.random.split(jax.random.key(0), 2)
    hidden = jax.random.normal(keys[0], (1, seq, dim), jnp.bfloat16)
    targets = jax.random.randint(keys[1], (1, seq), 0, vocab)
    weights = jnp.ones((1, seq), jnp.float32)
    grad = jax.jit(jax.value_and_grad(lambda w, h: head_loss(head, w, h, targets, weights, chunk=chunk),
                                      argnums=(0, 1)))
    compiled = grad.lower(leaves, hidden).compile()
    seconds = _time(compiled, leaves, hidden, steps=steps)
    flops = 3 * 2 * seq * dim * vocab   # the head's matmul, forward and its two gradients
    return dict(bench="loss-chunks", recipe=None, B=1, S=seq, L=0, step_s=seconds, tflops=flops / seconds / 1e12,
                peak_gib=compiled.memory_analysis().temp_size_in_bytes / 2 ** 30, chunk=chunk or seq,
                chunks=seq // (chunk or seq), default_chunk=default_chunk(1, seq, vocab) or seq)


def main():
    ap = argparse.ArgumentParser(description="the loss head's time and temporaries per chunk length")
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 131072, 262144])
    ap.add_argument("--chunk", nargs="+", default=["whole", "64", "1024", "8192"],
                    help="chunk lengths, or 'whole' (the whole sequence at once)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    a = ap.parse_args()
    dim, vocab = (64, 512) if a.smoke else (DIM, VOCAB)
    seqs = [256] if a.smoke else a.seq
    for seq in seqs:
        for c in a.chunk:
            chunk = None if c == "whole" else int(c)
            if chunk is not None and (seq % chunk or chunk >= seq):
                continue
            if chunk is None and 4 * seq * vocab > WHOLE_LIMIT:   # the whole float32 logits and their gradient
                continue                                             # would not fit: not tried
            try:
                emit(measure(seq, chunk, dim=dim, vocab=vocab, steps=1 if a.smoke else a.steps))
            except Exception as e:   # an out-of-memory is a result of this length, not the end of the sweep
                emit(dict(bench="loss-chunks", B=1, S=seq, L=0, chunk=chunk or seq,
                          error=f"{type(e).__name__}: {str(e)[:300]}"))


if __name__ == "__main__":
    main()
