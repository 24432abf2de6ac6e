"""Independent references for the layers' unit tests: each layer's published math written out again in plain
`jax.numpy` on plain arrays (no zoo code, no flax), in the form of the papers' or the published reference code
(Meta's `apply_scaling` for Llama 3.1's RoPE, DeepSeek's `precompute_freqs_cis` for YaRN, RoPE as a rotation of
pairs, attention as an explicit masked softmax, routing one token at a time in NumPy).

Weights are taken in the zoo's layout (kernels [in..., out...] with heads split out), so a test passes the layer's
own arrays. The functions are differentiable, so one reference serves the forward and the gradient checks, in
float64 (`float64()`) or float32.
"""
from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np


@contextlib.contextmanager
def float64():
    """jax in 64-bit mode inside the block only (restored on exit, so nothing leaks into other tests)."""
    with jax.enable_x64(True):
        yield


def rel_err(a, b) -> float:
    """Relative error ||a - b|| / ||b|| over all leaves of two pytrees of the same structure (the largest leaf's)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    errs = [np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64)) /
            max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30) for x, y in zip(la, lb)]
    return max(errs)


# -- RMSNorm (Zhang & Sennrich, 2019) -------------------------------------------------------------------------
def rms_norm(x, scale, eps):
    return scale * x / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


# -- RoPE frequencies ---------------------------------------------------------------------------------------------
def rope_inv_freq(dim: int, theta: float) -> np.ndarray:
    return np.array([1.0 / theta ** (2 * i / dim) for i in range(dim // 2)])


def llama3_inv_freq(dim, theta, *, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    """Meta's `apply_scaling` (llama-models, Llama 3.1), one frequency at a time."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    out = []
    for freq in rope_inv_freq(dim, theta):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor -
                                                                                       low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def yarn_inv_freq(dim, theta, *, factor, original_max_position_embeddings, beta_fast, beta_slow):
    """DeepSeek's `precompute_freqs_cis` (DeepSeek-V3 inference code), applied whatever the sequence length."""
    def correction_dim(rotations):
        return dim * math.log(original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    freqs = rope_inv_freq(dim, theta)
    return freqs / factor * (1 - smooth) + freqs * smooth


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


# -- RoPE as a rotation of pairs ------------------------------------------------------------------------------
def _rotate(a, b, angles, factor):
    cos, sin = jnp.cos(angles) * factor, jnp.sin(angles) * factor
    return a * cos - b * sin, a * sin + b * cos


def rope_half(x, positions, inv_freq, factor=1.0):
    """x [B, S, H, d]: pair i is (x[i], x[i + d/2]) (the Hugging Face "rotate half" layout), rotated by
    positions * inv_freq[i]. The output keeps that layout."""
    angles = jnp.asarray(positions, x.dtype)[:, None] * jnp.asarray(inv_freq, x.dtype)        # [S, d/2]
    angles = angles[None, :, None, :]
    half = x.shape[-1] // 2
    a, b = _rotate(x[..., :half], x[..., half:], angles, factor)
    return jnp.concatenate([a, b], axis=-1)


def rope_interleaved(x, positions, inv_freq, factor=1.0):
    """x [B, S, H, d]: pair i is (x[2i], x[2i + 1]) (DeepSeek's published layout), rotated by positions *
    inv_freq[i]. The output keeps the interleaved layout."""
    angles = jnp.asarray(positions, x.dtype)[:, None] * jnp.asarray(inv_freq, x.dtype)
    angles = angles[None, :, None, :]
    a, b = _rotate(x[..., 0::2], x[..., 1::2], angles, factor)
    return jnp.stack([a, b], axis=-1).reshape(x.shape)


# -- attention ----------------------------------------------------------------------------------------------
def causal_softmax_attention(q, k, v, scale):
    """q [B, S, H, dk], k [B, S, H, dk], v [B, S, H, dv] (one key/value head per query head)."""
    s = q.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = jnp.where(np.tril(np.ones((s, s), bool)), logits, -np.inf)
    p = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    p = p / jnp.sum(p, axis=-1, keepdims=True)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def gqa(x, p, *, inv_freq, q_norm_eps=None):
    """Grouped-query attention with RoPE; query head h reads key/value head h // (H / Hkv). `p`: {q, k, v, o}
    kernels [D, H, d], [D, Hkv, d], [D, Hkv, d], [H, d, D] and, for Qwen3, {q_norm, k_norm} scales [d]."""
    q = jnp.einsum("bsd,dhk->bshk", x, p["q"])
    k = jnp.einsum("bsd,dhk->bshk", x, p["k"])
    v = jnp.einsum("bsd,dhk->bshk", x, p["v"])
    if q_norm_eps is not None:
        q, k = rms_norm(q, p["q_norm"], q_norm_eps), rms_norm(k, p["k_norm"], q_norm_eps)
    pos = np.arange(x.shape[1])
    q, k = rope_half(q, pos, inv_freq), rope_half(k, pos, inv_freq)
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    out = causal_softmax_attention(q, k, v, q.shape[-1] ** -0.5)
    return jnp.einsum("bshk,hkd->bsd", out, p["o"])


def mla(x, p, *, nope, rope_dim, kv_lora_rank, inv_freq, eps, softmax_mscale=1.0, attention_factor=1.0,
        interleaved=True):
    """DeepSeek-V2/V3 multi-head latent attention (the "naive" form of DeepSeek's inference code). `p` holds the
    zoo-layout kernels q_a [D, r_q], q_a_norm [r_q], q_b [r_q, H, nope+rope], kv_a [D, r_kv+rope], kv_a_norm [r_kv],
    kv_b [r_kv, H, nope+v], o [H, v, D]."""
    rotate = rope_interleaved if interleaved else rope_half
    pos = np.arange(x.shape[1])
    q = jnp.einsum("bsr,rhk->bshk", rms_norm(x @ p["q_a"], p["q_a_norm"], eps), p["q_b"])
    q_nope, q_rope = q[..., :nope], rotate(q[..., nope:], pos, inv_freq, attention_factor)
    kv = x @ p["kv_a"]
    latent, k_rope = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    kv_up = jnp.einsum("bsr,rhk->bshk", rms_norm(latent, p["kv_a_norm"], eps), p["kv_b"])
    k_nope, v = kv_up[..., :nope], kv_up[..., nope:]
    k_rope = rotate(k_rope[:, :, None, :], pos, inv_freq, attention_factor)       # one rope key for every head
    heads = q.shape[2]
    q = jnp.concatenate([q_nope, q_rope], axis=-1)
    k = jnp.concatenate([k_nope, jnp.repeat(k_rope, heads, axis=2)], axis=-1)
    out = causal_softmax_attention(q, k, v, (nope + rope_dim) ** -0.5 * softmax_mscale)
    return jnp.einsum("bshk,hkd->bsd", out, p["o"])


# -- feed-forward -------------------------------------------------------------------------------------------
def silu(x):
    return x / (1 + jnp.exp(-x))


def swiglu(x, gate, up, down):
    """down(silu(x gate) * x up); kernels [D, F], [D, F], [F, D] (or with a leading token axis: per-token experts)."""
    return jnp.einsum("...f,...fd->...d", silu(jnp.einsum("...d,...df->...f", x, gate)) *
                      jnp.einsum("...d,...df->...f", x, up), down)


# -- routing (NumPy, one token at a time: which experts) and the weights it gives (jnp: differentiable) ---------
def group_limited_choice(scores, bias, *, k, n_group, topk_group) -> np.ndarray:
    """DeepSeek-V3's choice: groups scored by their two best biased affinities, the best `topk_group` groups
    kept, the k best biased affinities among their experts. scores [T, E] -> indices [T, k] (best first)."""
    scores, bias = np.asarray(scores, np.float64), np.asarray(bias, np.float64)
    t, e = scores.shape
    per = e // n_group
    out = np.zeros((t, k), np.int64)
    for i in range(t):
        biased = scores[i] + bias
        group_score = [np.sort(biased[g * per:(g + 1) * per])[-2:].sum() for g in range(n_group)]
        kept = np.argsort(group_score)[::-1][:topk_group]
        allowed = np.concatenate([np.arange(g * per, (g + 1) * per) for g in kept])
        out[i] = allowed[np.argsort(biased[allowed])[::-1][:k]]
    return out


def softmax_choice(probs, *, k) -> np.ndarray:
    """The k most probable experts of each token, best first: probs [T, E] -> indices [T, k]."""
    return np.argsort(-np.asarray(probs, np.float64), axis=-1, kind="stable")[:, :k]


def sigmoid(x):
    return 1 / (1 + jnp.exp(-x))


def softmax(x):
    e = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def chosen_weights(scores, idx, *, normalise, scale=1.0):
    """The chosen experts' (unbiased) scores, renormalised to sum to one when `normalise`, times `scale`."""
    w = jnp.take_along_axis(scores, jnp.asarray(idx), axis=-1)
    if normalise:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * scale


def moe(x, idx, weights, gate, up, down):
    """sum over each token's k experts of weight * expert(x): x [T, D], idx / weights [T, k], experts' kernels
    [E, D, F], [E, D, F], [E, F, D] -> [T, D], every (token, expert) pair computed on its own."""
    idx = jnp.asarray(idx)
    per = swiglu(x[:, None, :], gate[idx], up[idx], down[idx])                        # [T, k, D]
    return jnp.sum(per * weights[..., None], axis=1)


def sequence_balance_loss(scores, idx, *, batch, weight):
    """DeepSeek-V3's complementary sequence-wise balance loss (the paper's eqs. 17-20), one sequence at a time:
    weight * mean over sequences of sum_i f_i P_i, f_i = E / (k S) * #{t: i chosen for t}, P_i = mean_t s'_{i,t}."""
    t, e = scores.shape
    k, s = idx.shape[1], t // batch
    total = 0.0
    for b in range(batch):
        rows = slice(b * s, (b + 1) * s)
        f = np.array([(np.asarray(idx[rows]) == i).sum() for i in range(e)]) * e / (k * s)
        p = jnp.mean(scores[rows] / jnp.sum(scores[rows], axis=-1, keepdims=True), axis=0)
        total = total + jnp.sum(f * p)
    return weight * total / batch


def switch_balance_loss(probs, idx, *, weight):
    """Switch Transformer's balance loss: weight * E * sum_i f_i P_i, f_i = copies routed to i / tokens,
    P_i = mean router probability of i."""
    t, e = probs.shape
    f = np.array([(np.asarray(idx) == i).sum() for i in range(e)]) / t
    return weight * e * jnp.sum(f * jnp.mean(probs, axis=0))
