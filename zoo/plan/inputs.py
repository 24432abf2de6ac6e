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
    """The device planned for: `hbm_gib` (the HBM budget per device; needed by recipe "auto"), `host_gib` (host memory
    per device for "auto"; None: unbounded), `link_gbps` and `overlap` (default: the link measured on `device_kind`,
    `zoo.plan.links`; default device: the one present), `tflops` (the matmul rate for "auto" and the step time) and
    `step_tflops` (the executed rate of the family's step; default measured, else `tflops`)."""
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
    """How the step is split: `shard=N` devices (data parallel + FSDP, a uniform split: every byte divided by N),
    or `mesh` (a spec "fsdp=4,tp=2", a {axis: size} dict, a Mesh or an AbstractMesh: split by the sharding rules,
    `zoo.plan.mesh`), not both."""
    shard: int = 1
    mesh: Any = None

    def __post_init__(self):
        check_positive("shard", self.shard)
        if self.mesh is not None and self.shard != 1:
            raise ValueError(f"give shard={self.shard} or mesh={self.mesh!r}, not both (shard=N is a uniform split "
                             f"over N devices; a mesh splits by the sharding rules)")
