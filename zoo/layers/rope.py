"""Rotary position embeddings (Su et al., 2021) in the Hugging Face checkpoints' "rotate half" layout, with two
frequency scalings: `WavelengthScaling` (the frequency bands by wavelength of arXiv:2407.21783) and `YarnScaling` (YaRN,
Peng et al., 2023). Frequencies are constants of the config, computed with NumPy in float64.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from zoo import renames


@dataclasses.dataclass(frozen=True, kw_only=True)
class WavelengthScaling:
    """RoPE frequency scaling by wavelength bands, as Llama 3.1 extends its context (Grattafiori et al., 2024,
    arXiv:2407.21783): frequencies whose wavelength is longer than `original_max_position_embeddings / low_freq_factor`
    are divided by `factor`, those shorter than `original_max_position_embeddings / high_freq_factor` kept, and those
    between blended linearly. The defaults are Llama 3.1's.

    Args:
        factor: the division of the low frequencies.
        low_freq_factor: the band edge of the divided frequencies.
        high_freq_factor: the band edge of the kept frequencies.
        original_max_position_embeddings: the context the model was pre-trained at.

    Examples:
        >>> from zoo.layers import Rope, WavelengthScaling
        >>> Rope(dim=8, theta=500000.0, scaling=WavelengthScaling()).inv_freq().round(6).tolist()
        [1.0, 0.037606, 0.000525, 7e-06]
    """
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __call__(self, inv_freq: np.ndarray, theta: float) -> np.ndarray:
        """The scaled inverse frequencies.

        Args:
            inv_freq: [dim // 2] float64 inverse frequencies.
            theta: RoPE's base (unused: the bands are by wavelength).

        Returns:
            [dim // 2] float64.
        """
        del theta
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        scaled = np.where(wavelen > low_wavelen, inv_freq / self.factor, inv_freq)
        mid = (1 - smooth) * scaled / self.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(is_mid, mid, scaled)


@dataclasses.dataclass(frozen=True, kw_only=True)
class YarnScaling:
    """YaRN (Peng et al., 2023) as DeepSeek-V3 uses it (arXiv:2412.19437): low frequencies interpolated by `factor`,
    high ones kept, a linear ramp between `beta_slow` and `beta_fast` rotations; `attention_factor()` scales cos and
    sin, `softmax_mscale()` the softmax scale of MLA. The defaults are DeepSeek-V3's.

    Args:
        factor: the context extension (the interpolation of the low frequencies).
        original_max_position_embeddings: the context the model was pre-trained at.
        beta_fast: the rotations above which frequencies are kept.
        beta_slow: the rotations below which frequencies are interpolated.
        mscale: YaRN's mscale of cos and sin.
        mscale_all_dim: the mscale of the softmax (0: none).

    Examples:
        >>> from zoo.layers import YarnScaling
        >>> round(YarnScaling().softmax_mscale(), 4)
        1.8739
    """
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __call__(self, inv_freq: np.ndarray, theta: float) -> np.ndarray:
        """The interpolated inverse frequencies.

        Args:
            inv_freq: [dim // 2] float64 inverse frequencies.
            theta: RoPE's base (it places the ramp).

        Returns:
            [dim // 2] float64.
        """
        dim, base = 2 * len(inv_freq), theta

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return inv_freq / self.factor * (1 - extrapolation) + inv_freq * extrapolation

    def attention_factor(self) -> float:
        """The factor on cos/sin (transformers' `_compute_yarn_parameters`): mscale / mscale_all_dim when both are
        set (1.0 for the published 671B MoE), else the paper's 0.1 ln(factor) + 1."""
        if self.mscale and self.mscale_all_dim:
            return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)
        return yarn_get_mscale(self.factor, 1.0)

    def softmax_mscale(self) -> float:
        """arXiv:2412.19437 multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 when mscale_all_dim is set
        (transformers' `yarn_apply_mscale`): (0.1 ln 40 + 1)^2 = 1.8438... for its 671B model."""
        if not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2


def yarn_get_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rope:
    """Rotary position embedding (Su et al., 2021, "RoFormer") in the Hugging Face checkpoints' "rotate half" layout:
    each pair (x_i, x_{i + dim/2}) rotated by position * inv_freq_i, inv_freq_i = theta^(-2i/dim), optionally
    rescaled. Frequencies are constants computed with NumPy in float64; the rotation runs in float32.

    Args:
        dim: the rotated width (even).
        theta: the base of the frequencies.
        scaling: None, `WavelengthScaling` (Llama 3.1) or `YarnScaling` (DeepSeek-V3).

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers import Rope
        >>> rope = Rope(dim=4)
        >>> rope(jnp.ones((1, 3, 2, 4)), jnp.arange(3)).shape
        (1, 3, 2, 4)
    """
    dim: int
    theta: float = 10000.0
    scaling: WavelengthScaling | YarnScaling | None = None

    def inv_freq(self) -> np.ndarray:
        inv = 1.0 / (self.theta ** (np.arange(0, self.dim, 2, dtype=np.float64) / self.dim))
        return inv if self.scaling is None else self.scaling(inv, self.theta)

    def cos_sin(self, positions: jax.Array, dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
        """cos and sin of shape positions.shape + (dim,), in `dtype` (float32 unless asked for wider)."""
        angles = positions.astype(dtype)[..., None] * jnp.asarray(self.inv_freq(), dtype)
        angles = jnp.concatenate([angles, angles], axis=-1)
        factor = self.scaling.attention_factor() if isinstance(self.scaling, YarnScaling) else 1.0
        return jnp.cos(angles) * factor, jnp.sin(angles) * factor

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """Rotate `x` at `positions`.

        Args:
            x: [B, S, H, dim].
            positions: int [S] or [B, S].

        Returns:
            [B, S, H, dim] in x's dtype (computed in float32, float64 for a float64 x).
        """
        wide = jnp.promote_types(x.dtype, jnp.float32)
        cos, sin = self.cos_sin(positions, wide)
        if cos.ndim == 2:  # [S, dim] -> broadcast over batch
            cos, sin = cos[None], sin[None]
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        x32 = x.astype(wide)
        x1, x2 = jnp.split(x32, 2, axis=-1)
        rotated = jnp.concatenate([-x2, x1], axis=-1)
        return (x32 * cos + rotated * sin).astype(x.dtype)


__getattr__ = renames.attributes(__name__)   # renamed classes (docs/changes.md)
