"""tokamax's grouped matmul with a tile configuration chosen for each of its problems (``fwd``, ``dlhs``, ``drhs``),
measured on the device (`bench/tokamax_tiles.py`) and kept in `TILES`: where tokamax's cache has no entry its heuristic
tiles run far from the device's rate. `make` wraps the three in one `jax.custom_vjp`; `ZOO_TOKAMAX_TILES=<file>`
replaces the table for a run (`{}`: tokamax's own choice).
"""
from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp

PROBLEMS = ("fwd", "dlhs", "drhs")

# Contract the rows of each group: lhs [M, K], rhs [M, N] -> [G, K, N] (the experts' gradient).
RAGGED_CONTRACTING = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

# device kind -> {problem or "problem:KxN": tokamax PallasMosaicRaggedDotConfig fields}. Measured with
# bench/tokamax_tiles.py (docs/benchmarks/kernels.md); a device kind missing here runs tokamax's choice.
# H200 (2026-11-30, a 671B MoE's expert shapes 7168 x 2048 and 2048 x 7168, 131072 rows over 16 experts):
# 128 x 64 x 128 tiles, 4 stages, persistent, N-minor grid in bands of 8 took the forward from 281-312 to
# 491-531 TFLOP/s and the rows' gradient from 279-310 to 473-511; the experts' gradient (a ragged contraction)
# from 179-185 to 229-249, best with 2 stages. Larger tiles (block_k 256 or block_n 128) exceed shared memory.
_SM90_TILE = dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True, grid_minor_dim=1,
                  grid_tile_width=8)
TILES: dict[str, dict[str, dict]] = {
    "NVIDIA H200": {"fwd": _SM90_TILE, "dlhs": _SM90_TILE, "drhs": {**_SM90_TILE, "num_stages": 2}},
}

CONFIG_FIELDS = ("block_m", "block_n", "block_k", "num_stages", "split_k", "split_m", "persistent", "collective",
                 "grid_minor_dim", "grid_tile_width")


def _check(tiles, where: str) -> dict[str, dict]:
    if not isinstance(tiles, dict):
        raise ValueError(f"{where}: expected a JSON object of problem -> configuration, got {type(tiles).__name__}")
    for key, c in tiles.items():
        if key.split(":")[0] not in PROBLEMS:
            raise ValueError(f"{where}: unknown problem {key!r} (choose {', '.join(PROBLEMS)}, optionally "
                             f"'problem:KxN')")
        if not isinstance(c, dict) or set(c) - set(CONFIG_FIELDS):
            raise ValueError(f"{where}: {key!r} must map to configuration fields among {', '.join(CONFIG_FIELDS)}, "
                             f"got {c!r}")
    return tiles


def tiles_for(device_kind: str) -> tuple[dict[str, dict] | None, str]:
    """(the tile table for `device_kind`, where it comes from); (None, why) where tokamax chooses."""
    path = os.environ.get("ZOO_TOKAMAX_TILES")
    if path:
        try:
            with open(path) as f:
                tiles = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"ZOO_TOKAMAX_TILES={path}: cannot read a tile table ({e})") from e
        if not _check(tiles, f"ZOO_TOKAMAX_TILES={path}"):
            return None, f"tokamax's own configuration (ZOO_TOKAMAX_TILES={path} is empty)"
        return tiles, f"tiles from ZOO_TOKAMAX_TILES={path}"
    if device_kind in TILES:
        return TILES[device_kind], f"the zoo's measured tiles for {device_kind}"
    return None, f"tokamax's own configuration (no measured tiles for {device_kind})"


def pick(tiles: dict[str, dict], problem: str, k: int, n: int) -> dict | None:
    """The configuration for `problem` of a forward expert matrix K x N (None: tokamax chooses)."""
    return tiles.get(f"{problem}:{k}x{n}", tiles.get(problem))


def make(op_for: Callable[[str, int, int], Callable]) -> Callable:
    """A grouped matmul (rows [M, K] sorted by group, experts [G, K, N], group_sizes [G]) -> [M, N], with
    `jax.lax.ragged_dot`'s signature, whose forward and backward problems run `op_for(problem, K, N)`: a callable
    (lhs, rhs, *, group_sizes, [ragged_dot_dimension_numbers]) -> out, as tokamax's ops are."""

    @jax.custom_vjp
    def grouped(lhs, rhs, group_sizes):
        k, n = rhs.shape[1:]
        return op_for("fwd", k, n)(lhs, rhs, group_sizes=group_sizes)

    def fwd(lhs, rhs, group_sizes):
        return grouped(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

    def bwd(res, d_out):
        lhs, rhs, group_sizes = res
        k, n = rhs.shape[1:]
        d_out = d_out.astype(lhs.dtype)
        d_lhs = op_for("dlhs", k, n)(d_out, jnp.swapaxes(rhs, 1, 2), group_sizes=group_sizes)
        d_rhs = op_for("drhs", k, n)(lhs, d_out, group_sizes=group_sizes,
                                     ragged_dot_dimension_numbers=RAGGED_CONTRACTING)
        return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype), None

    grouped.defvjp(fwd, bwd)
    return grouped


def mosaic_op() -> tuple[type, type]:
    """tokamax's Mosaic GPU grouped-matmul op and its configuration class. `tokamax.ops.gpu` exports both, but it
    also imports tokamax's Triton kernels, which need jax_triton (absent from many images, e.g. our GPU's); the
    kernel's own module needs only Pallas."""
    try:
        from tokamax.ops.gpu import PallasMosaicRaggedDot, PallasMosaicRaggedDotConfig
    except ImportError:
        from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config as PallasMosaicRaggedDotConfig
        from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import PallasMosaicGpuRaggedDot as PallasMosaicRaggedDot
    return PallasMosaicRaggedDot, PallasMosaicRaggedDotConfig


def tokamax_tiled(tiles: dict[str, dict]) -> Callable:
    """`make` over tokamax's Mosaic GPU kernel, each problem with its configuration from `tiles`."""
    PallasMosaicRaggedDot, PallasMosaicRaggedDotConfig = mosaic_op()

    @functools.cache
    def op_for(problem: str, k: int, n: int):
        c = pick(tiles, problem, k, n)
        return PallasMosaicRaggedDot() if c is None else PallasMosaicRaggedDot(config=PallasMosaicRaggedDotConfig(**c))

    return make(op_for)
