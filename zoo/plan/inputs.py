"""What a plan is asked for beyond the model, the recipe and the shape, in three small groups:

    zoo.plan.plan(cfg, recipe, batch=8, seq=4096,
                  hardware=Hardware(hbm_gib=141, link_gbps=55, tflops=800),   # the device planned for
                  parallel=Parallelism(mesh="fsdp=4,tp=2"),                    # how the step is split over devices
                  training=Training(optimizer="adamw", grad_accum=2))          # what the step keeps and how it updates

Each checks its own values when it is made (a ValueError naming the field); `Training` is the step's own
(`zoo.training`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from zoo.checks import check_positive
from zoo.training import Training

__all__ = ["Hardware", "Parallelism", "Training", "check_positive"]


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The device a plan is made for: its HBM budget, its host memory, the link between them and its FLOP rate.
    What is not given is read from the measurements of `device_kind` (`zoo.plan.links`) where there are some. A bad
    field is a ValueError naming it.

    Args:
        hbm_gib: the HBM budget per device, GiB (recipe "auto" needs it; None: no budget).
        host_gib: the pinned host memory per device recipe "auto" may fill, GiB (None: XLA's pool and the RAM bound it).
        link_gbps: the host link's rate per direction, GB/s (None: the one measured on `device_kind`).
        overlap: the fraction of copy time hidden under compute, one for both directions or a (d2h, h2d) pair (None:
            the one measured on `device_kind`).
        tflops: the matmul rate, TFLOP/s, that recipe "auto" prices recompute at and the step time runs at.
        step_tflops: the rate the family's step executes its FLOPs at (None: the one measured, else `tflops`).
        device_kind: the device planned for, as `jax.Device.device_kind` names it (None: the one present).

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> from zoo.plan import Hardware
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), zoo.Recipe.none(), batch=1, seq=8,
        ...                   hardware=Hardware(hbm_gib=1), peak=None)
        >>> p.hbm_budget
        1073741824
        >>> Hardware(hbm_gib=0)
        Traceback (most recent call last):
        ValueError: hbm_gib must be a positive number, got 0
    """
    hbm_gib: float | None = None
    host_gib: float | None = None
    link_gbps: float | None = None
    overlap: Any = None
    tflops: float | None = None
    step_tflops: float | None = None
    device_kind: str | None = None

    def __post_init__(self):
        for name in ("hbm_gib", "host_gib", "link_gbps", "tflops", "step_tflops"):
            check_positive(name, getattr(self, name), float)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How the step is split over devices: a uniform split over `shard` devices (data parallelism with FSDP, every
    byte divided by N), or a `mesh` whose axes split each tensor by the sharding rules (`zoo.sharding`,
    `zoo.plan.mesh`); not both. The plan's figures are then one device's.

    Args:
        shard: the devices of a uniform split (1: one device).
        mesh: a spec ("fsdp=4,tp=2"), an {axis: size} dict, a `jax.sharding.Mesh` or an `AbstractMesh` (None:
            none); its devices need not be present.

    Examples:
        >>> import zoo
        >>> from zoo.models import LlamaConfig
        >>> from zoo.plan import Parallelism
        >>> p = zoo.plan.plan(LlamaConfig.preset("tiny"), zoo.Recipe.none(), batch=2, seq=8,
        ...                   parallel=Parallelism(mesh="fsdp=2"), peak=None)
        >>> p.shard, p.mesh, p.state.params * 2 == 4 * p.state.num_params   # float32 parameters, half on each
        (2, 'dp=1,fsdp=2,tp=1,ep=1', True)
    """
    shard: int = 1
    mesh: Any = None

    def __post_init__(self):
        check_positive("shard", self.shard)
        if self.mesh is not None and self.shard != 1:
            raise ValueError(f"give shard={self.shard} or mesh={self.mesh!r}, not both (shard=N is a uniform split "
                             f"over N devices; a mesh splits by the sharding rules)")
