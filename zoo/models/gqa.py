"""What the configs of grouped-query attention decoders share: the checks of their attention and MLP fields and the
fields a tensor-parallel mesh axis must divide. Each family declares the fields itself (`num_heads`,
`num_kv_heads`, `head_dim`, `mlp_dim`, `rope_theta`), with its published defaults."""
from __future__ import annotations

from zoo.models.fields import check_divides, check_positive, check_positive_float

# tp splits the heads, the kv heads and the MLP's hidden dim (zoo.sharding's rules)
MESH_DIVISORS: tuple[tuple[str, str], ...] = (("tp", "num_heads"), ("tp", "num_kv_heads"), ("tp", "mlp_dim"))


def check_gqa(cfg, *positive: str) -> None:
    """ValueError naming the field unless the heads, kv heads, head dim, MLP dim (and `positive`'s fields) are
    positive, `rope_theta` is a positive float, the kv heads divide the heads and the head dim is even (RoPE rotates
    pairs)."""
    check_positive(cfg, "num_heads", "num_kv_heads", "head_dim", "mlp_dim", *positive)
    check_positive_float(cfg, "rope_theta")
    check_divides(cfg, "num_kv_heads", "num_heads")
    if cfg.head_dim % 2:
        raise ValueError(f"{type(cfg).__name__}.head_dim must be even for RoPE, got {cfg.head_dim}")
